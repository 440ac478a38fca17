"""Triton kernels for the paged tier: attention over pages and quantise-on-write.

The two entry points take exactly the arguments of the PyTorch reference in
``kvtier.kernels.paged`` (``paged_attention_reference``,
``paged_write_reference``), which is what they are tested against:

- :func:`paged_attention_triton`: decode (``T == 1``, split-KV with a merge step,
  the GQA group packed into one ``tl.dot`` tile) and extend (``T > 1``: chunked
  prefill, speculative verify) over NHD pages ``[num_blocks, block_size, H_kv, D']``
  of any supported codec, dequantised in registers.
- :func:`paged_write_triton`: one launch that writes every row's new K and V
  tokens into their slots, quantising on the way.

A codec or shape the kernels do not cover raises
:class:`~kvtier.quant.codec.CodecUnsupported`; the dispatch then serves the call
from the reference. On the CPU the kernels run under Triton's interpreter, which
needs ``TRITON_INTERPRET=1`` in the environment before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.kernels import triton_attention
from kvtier.kernels.reference import check_window
from kvtier.kernels.triton_attention import LaunchConfig, launch_attention
from kvtier.kernels.triton_paged_write import launch_write
from kvtier.kernels.triton_quant import PageFormat, check_format_tensors, page_format
from kvtier.kernels.triton_rotate import rotate_back
from kvtier.quant.codec import Codec, CodecUnsupported

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def interpreted() -> bool:
    """True when the kernels, and Triton's own library (``tl.zeros``, ``tl.sum``, ...), were
    built for the CPU interpreter: ``TRITON_INTERPRET=1`` was set before ``triton`` was imported."""
    compiled = triton.runtime.jit.JITFunction
    return not isinstance(triton_attention._attention_kernel, compiled) and not isinstance(tl.zeros, compiled)


def check_device(device: torch.device) -> None:
    """Raise :class:`CodecUnsupported` when the kernels cannot run on ``device``."""
    if device.type == "cuda":
        if not isinstance(triton_attention._attention_kernel, triton.runtime.jit.JITFunction):
            raise CodecUnsupported("the Triton kernels were built for the interpreter; unset TRITON_INTERPRET")
        return
    if device.type == "cpu" and interpreted():
        return
    raise CodecUnsupported(
        f"Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set before triton is imported for the CPU; "
        f"got tensors on {device}"
    )


def check_head_dim(D: int) -> None:
    if D & (D - 1) or not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise CodecUnsupported(
            f"the Triton kernels need head_dim a power of two in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {D}"
        )


def _check_rows(name: str, t: torch.Tensor, B: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor [{B}], got {t!r:.80}")
    if tuple(t.shape) != (B,) or t.device != device:
        raise ValueError(f"{name} must be [{B}] on {device}, got {tuple(t.shape)} on {t.device}")
    if t.stride(0) != 1 and B > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")


def _check_pages(key_pages: torch.Tensor, value_pages: torch.Tensor, device: torch.device) -> None:
    for name, p in (("key_pages", key_pages), ("value_pages", value_pages)):
        if p.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, H_kv, D'], got {tuple(p.shape)}")
        if p.device != device:
            raise ValueError(f"{name} is on {p.device}, the other tensors on {device}")
    if key_pages.shape[:3] != value_pages.shape[:3]:
        raise ValueError(
            f"key_pages {tuple(key_pages.shape)} and value_pages {tuple(value_pages.shape)} "
            "must agree on num_blocks, block_size and H_kv"
        )


def _formats(
    k_codec: Codec, v_codec: Codec, key_pages, value_pages, k_sidecars, v_sidecars, D: int
) -> tuple[PageFormat, PageFormat]:
    for name, codec in (("k_codec", k_codec), ("v_codec", v_codec)):
        if not isinstance(codec, Codec):
            raise ValueError(f"{name} must be a kvtier Codec, got {type(codec).__name__}")
        if codec.head_dim != D:
            raise ValueError(f"{name} has head_dim {codec.head_dim} but the tensors have {D}")
    k_fmt = page_format(k_codec, key_pages, k_sidecars)
    v_fmt = page_format(v_codec, value_pages, v_sidecars)
    check_format_tensors(k_fmt, key_pages, "key")
    check_format_tensors(v_fmt, value_pages, "value")
    return k_fmt, v_fmt


def paged_attention_triton(
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    k_codec: Codec,
    v_codec: Codec,
    k_sidecars: dict[str, torch.Tensor],
    v_sidecars: dict[str, torch.Tensor],
    scale: float | None = None,
    config: LaunchConfig | None = None,
    q_offsets: torch.Tensor | None = None,
    max_q_len: int | None = None,
    single_rows: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention over paged K/V: ``[B, H_q, T, D]`` in ``q.dtype``.

    ``q``: ``[B, H_q, T, D]`` fp16/bf16/fp32, last dim contiguous; pages
    ``[num_blocks, block_size, H_kv, D']`` in the codecs' payload dtypes,
    sidecars ``{name: [num_blocks, block_size, H_kv, G]}``; ``block_tables``
    int32 ``[B, max_blocks]``; ``q_start``, ``kv_len`` integer ``[B]``. Query
    ``i`` of row ``b`` sees keys ``j <= q_start[b] + i`` with ``j < kv_len[b]``;
    a query that sees nothing returns zeros. A sliding ``window`` (a positive int): only
    keys ``j > q_start[b] + i - window`` too, on the kernel of every query count (the
    Gluon and CUDA-core decode kernels step aside). ``config`` overrides tile sizes and
    the split plan (benchmarks, tests).

    Packed rows (prompt chunks of several rows in one forward): ``q`` is
    ``[1, H_q, N, D]`` with row ``b``'s ``kv_len[b] - q_start[b]`` queries from token
    ``q_offsets[b]`` (integer ``[B]``, ``B`` the table's rows), each row's count at
    most ``max_q_len``; the result is ``[1, H_q, N, D]`` and tokens no row names stay
    unwritten. Nothing is padded: :func:`~kvtier.kernels.paged.paged_attention_packed`.
    ``single_rows``: the first rows feed one query each, tokens ``0 .. single_rows - 1``
    (decode rows beside prompt chunks); they run as a decode launch of their own.

    The caller guarantees that the table entries a row reads name allocated
    blocks and that ``kv_len <= max_blocks * block_size`` (checked on the CPU;
    on CUDA the kernel clamps ``kv_len`` to the table and never syncs).

    Example::

        out = paged_attention_triton(q, kp, vp, bt, q_start, kv_len,
                                     k_codec=codec, v_codec=codec,
                                     k_sidecars={}, v_sidecars={})
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in _FLOATS:
        raise ValueError(f"q must be a [B, H_q, T, D] fp16/bf16/fp32 tensor, got {q!r:.80}")
    device = q.device
    check_device(device)
    B, Hq, T, D = q.shape
    packed = q_offsets is not None
    if packed:
        B = block_tables.shape[0] if isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2 else -1
        if q.shape[0] != 1 or B < 0:
            raise ValueError(f"packed rows need q [1, H_q, N, D] and a 2-d block table, got q "
                             f"{tuple(q.shape)} and {block_tables!r:.80}")
        if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or not 1 <= max_q_len <= max(T, 1):
            raise ValueError(f"max_q_len must be an int in [1, {T}] (the longest row's queries), got {max_q_len!r}")
    elif max_q_len is not None:
        raise ValueError("max_q_len goes with q_offsets (packed rows); pass both or neither")
    if isinstance(single_rows, bool) or not isinstance(single_rows, int) or not 0 <= single_rows <= max(B, 0):
        raise ValueError(f"single_rows must be an int in [0, {max(B, 0)}] (rows of one query), got {single_rows!r}")
    if single_rows and not packed:
        raise ValueError("single_rows goes with q_offsets (packed rows)")
    check_window(window)
    check_head_dim(D)
    if q.stride(3) != 1:
        raise ValueError(f"q needs a contiguous last dim, got strides {q.stride()}")
    _check_pages(key_pages, value_pages, device)
    H_kv, page = key_pages.shape[2], key_pages.shape[1]
    if Hq % H_kv:
        raise ValueError(f"q has {Hq} heads, not a multiple of the pages' {H_kv} kv heads")
    if (
        not isinstance(block_tables, torch.Tensor)
        or block_tables.dtype != torch.int32
        or block_tables.dim() != 2
        or block_tables.shape[0] != B
        or block_tables.device != device
    ):
        raise ValueError(f"block_tables must be int32 [{B}, max_blocks] on {device}, got {block_tables!r:.80}")
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables needs a contiguous last dim, got strides {block_tables.stride()}")
    _check_rows("q_start", q_start, B, device)
    _check_rows("kv_len", kv_len, B, device)
    if packed:
        _check_rows("q_offsets", q_offsets, B, device)
    k_fmt, v_fmt = _formats(k_codec, v_codec, key_pages, value_pages, k_sidecars, v_sidecars, D)
    if device.type == "cpu":
        cap = block_tables.shape[1] * page
        if B and (int(kv_len.max()) > cap or int(kv_len.min()) < 0 or int(q_start.min()) < 0):
            raise ValueError(
                f"kv_len must lie in [0, {cap}] (the block table's capacity) and q_start be >= 0, "
                f"got kv_len {kv_len.tolist()} and q_start {q_start.tolist()}"
            )
        counts = kv_len - q_start
        if packed and B and (int(counts.min()) < 0 or int(counts.max()) > max_q_len
                             or int(q_offsets.min()) < 0 or int((q_offsets + counts).max()) > T):
            raise ValueError(
                f"packed rows must name queries inside q's {T} tokens, at most max_q_len {max_q_len} "
                f"each: got q_offsets {q_offsets.tolist()} and counts (kv_len - q_start) {counts.tolist()}"
            )
        s = single_rows
        if s and (counts[:s].ne(1).any() or q_offsets[:s].ne(torch.arange(s)).any()):
            raise ValueError(f"the first single_rows={s} rows must feed one query each from tokens 0 .. {s - 1}; "
                             f"got q_offsets {q_offsets[:s].tolist()} and counts {counts[:s].tolist()}")
    if B == 0 or T == 0:
        return q.new_zeros(q.shape if packed else (B, Hq, T, D))

    rotated_q = k_fmt.rotation is not None
    qk = q
    if rotated_q:
        qk = torch.matmul(q.float(), k_fmt.rotation).to(q.dtype)  # (B, Hq, T, D): <qR, kR> = <q, k>
    out_rot = v_fmt.rotation is not None
    out = launch_attention(
        qk, key_pages, value_pages, k_fmt, v_fmt,
        block_tables=block_tables, q_start=q_start, kv_len=kv_len, scale=scale,
        out_dtype=torch.float32 if out_rot else q.dtype, config=config,
        q_offsets=q_offsets, max_q_len=max_q_len or 0, single_rows=single_rows, window=window,
    )  # fmt: skip
    if out_rot:  # back from the values' domain
        out = rotate_back(out, v_fmt.rotation, q.dtype)
    return out


def paged_write_triton(
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    k_sidecars: dict[str, torch.Tensor],
    v_sidecars: dict[str, torch.Tensor],
    slot_mapping: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    k_codec: Codec,
    v_codec: Codec,
) -> None:
    """Encode ``keys``/``values`` ``[B, H_kv, T, D]`` into their slots, in one launch, in place.

    ``slot_mapping``: int64 ``[B * T]``, row-major over ``(b, t)``; slot ``s`` is
    block ``s // block_size``, position ``s % block_size``; a negative slot is
    padding and is skipped. Pages ``[num_blocks, block_size, H_kv, D']`` and
    sidecars ``{name: [num_blocks, block_size, H_kv, G]}`` as the codecs lay
    them out (``kvtier.quant``). Slots must be distinct and inside the pool
    (checked on the CPU; on CUDA the caller guarantees it).

    Example::

        paged_write_triton(kp, vp, {}, {}, slots, k, v, k_codec=codec, v_codec=codec)
    """
    for name, x in (("keys", keys), ("values", values)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in _FLOATS:
            raise ValueError(f"{name} must be a [B, H_kv, T, D] float tensor, got {x!r:.80}")
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must have the same shape")
    device = keys.device
    check_device(device)
    B, H, T, D = keys.shape
    check_head_dim(D)
    if keys.stride(3) != 1 or values.stride(3) != 1:
        raise ValueError(f"keys/values need a contiguous last dim, got strides {keys.stride()} and "
                         f"{values.stride()}; pass .contiguous() copies")
    if values.device != device:
        raise ValueError(f"values are on {values.device}, keys on {device}")
    _check_pages(key_pages, value_pages, device)
    nb, page, H_kv = key_pages.shape[:3]
    if H_kv != H:
        raise ValueError(f"keys have {H} heads but the pages hold {H_kv}")
    if (
        not isinstance(slot_mapping, torch.Tensor)
        or slot_mapping.dtype != torch.int64
        or tuple(slot_mapping.shape) != (B * T,)
        or slot_mapping.device != device
        or (B * T > 1 and slot_mapping.stride(0) != 1)
    ):
        raise ValueError(f"slot_mapping must be contiguous int64 [{B * T}] on {device}, got {slot_mapping!r:.80}")
    k_fmt, v_fmt = _formats(k_codec, v_codec, key_pages, value_pages, k_sidecars, v_sidecars, D)
    if device.type == "cpu" and B * T:
        live = slot_mapping[slot_mapping >= 0]
        if int(slot_mapping.max()) >= nb * page or live.unique().numel() != live.numel():
            raise ValueError(
                f"slot_mapping must hold distinct slots below {nb * page} (negative: padding), "
                f"got {slot_mapping.tolist()}"
            )
    launch_write(key_pages, value_pages, k_fmt, v_fmt, slot_mapping, keys, values)


__all__ = ["paged_attention_triton", "paged_write_triton", "LaunchConfig", "interpreted"]
