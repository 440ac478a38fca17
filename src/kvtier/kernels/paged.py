"""Paged attention and paged writes: the PyTorch reference, and both through the dispatch.

Layout (NHD, byte-compatible with FlashInfer's and vLLM's paged layout)::

    key_pages, value_pages : [num_blocks, block_size, H_kv, D']   payload of a codec
    sidecars               : {name: [num_blocks, block_size, H_kv, G]}   scales, zeros
    block_tables           : int32 [B, max_blocks]   logical block -> physical block
    slot_mapping           : int64 [B * T]           physical slot = block * block_size + pos % block_size

Row ``b`` holds position ``p`` in physical block ``block_tables[b, p // block_size]``
at in-block position ``p % block_size``. Entries of a block table past what the
row holds are never read unmasked (the cache pads them with 0).

The reference gathers and dequantises a bounded chunk of blocks at a time and
folds each chunk into an :class:`~kvtier.kernels.reference.OnlineSoftmax`, so it
never builds a full-precision copy of the whole cache. The Triton kernels
(``kvtier.kernels.triton_paged``) take exactly the same arguments;
:func:`paged_attention` and :func:`paged_write` route a call through a cache's
:class:`~kvtier.kernels.dispatch.KernelDispatch`, which picks the backend, falls back
to the reference when a kernel cannot serve, and counts which backend served each call.

Example::

    >>> import torch
    >>> from kvtier.quant.codec import IdentityCodec
    >>> codec = IdentityCodec(64, torch.float32)
    >>> kp = torch.zeros(4, 16, 2, 64); vp = torch.zeros(4, 16, 2, 64)
    >>> k = v = torch.randn(1, 2, 5, 64)                       # (B, H_kv, T, D)
    >>> slots = torch.arange(5) + 2 * 16                        # row 0 lives in block 2
    >>> paged_write_reference(kp, vp, {}, {}, slots, k, v, k_codec=codec, v_codec=codec)
    >>> bt = torch.tensor([[2]], dtype=torch.int32)
    >>> out = paged_attention_reference(torch.randn(1, 4, 5, 64), kp, vp, bt,
    ...     torch.tensor([0]), torch.tensor([5]), k_codec=codec, v_codec=codec,
    ...     k_sidecars={}, v_sidecars={})
    >>> out.shape
    torch.Size([1, 4, 5, 64])
    >>> dispatch = KernelDispatch("torch")                      # the reference everywhere
    >>> out = paged_attention(dispatch, torch.randn(1, 4, 1, 64), kp, vp, bt,
    ...     torch.tensor([4]), torch.tensor([5]), k_codec=codec, v_codec=codec,
    ...     k_sidecars={}, v_sidecars={})
    >>> dict(dispatch.attention_calls)
    {'torch': 1}
"""

from __future__ import annotations

import functools
import importlib
import math

import torch

from kvtier.kernels import precision
from kvtier.kernels.cpu_attention import paged_decode_cpu
from kvtier.kernels.dispatch import BACKENDS as BACKENDS  # re-exported: earlier import paths
from kvtier.kernels.dispatch import KernelDispatch
from kvtier.kernels.dispatch import resolve_backend as resolve_backend
from kvtier.kernels.reference import (
    OnlineSoftmax,
    causal_mask,
    check_window,
    partial_attention,
    zero_unseen,
)
from kvtier.quant.codec import Codec

#: the most bytes of decoded keys one chunk of the reference read path holds (the values
#: as many again); at least one block a chunk
DEFAULT_CHUNK_BYTES = 64 * 2**20
TRITON_MODULE = "kvtier.kernels.triton_paged"


# -- checks -------------------------------------------------------------------------
def _check_pages(key_pages: torch.Tensor, value_pages: torch.Tensor) -> None:
    if key_pages.dim() != 4 or value_pages.dim() != 4:
        raise ValueError(
            f"pages must be 4-D [num_blocks, block_size, H_kv, D'], got key_pages "
            f"{tuple(key_pages.shape)} and value_pages {tuple(value_pages.shape)}"
        )
    if key_pages.shape[:3] != value_pages.shape[:3]:
        raise ValueError(
            f"key_pages {tuple(key_pages.shape)} and value_pages {tuple(value_pages.shape)} "
            "must agree on num_blocks, block_size and H_kv"
        )


def _check_rows(name: str, t: torch.Tensor, batch: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.shape != (batch,):
        got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an integer tensor of shape [{batch}], got {got}")


def _check_attention_args(q, key_pages, value_pages, block_tables, q_start, kv_len) -> None:
    _check_pages(key_pages, value_pages)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, H_q, T, D], got {tuple(q.shape)}")
    B, Hq = q.shape[:2]
    Hkv = key_pages.shape[2]
    if Hq % Hkv:
        raise ValueError(f"q_heads {Hq} is not a multiple of the pages' kv_heads {Hkv}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [{B}, max_blocks], got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    _check_rows("q_start", q_start, B)
    _check_rows("kv_len", kv_len, B)


# -- gathering --------------------------------------------------------------------------
def gather_pages(
    pages: torch.Tensor,
    sidecars: dict[str, torch.Tensor],
    block_ids: torch.Tensor,
    *,
    codec: Codec,
    first_block: int | None = None,
) -> torch.Tensor:
    """Gather and decode whole blocks: ``[B, H_kv, nb * block_size, D]`` in ``codec.dtype``.

    ``pages``: ``[N, bs, H_kv, D']``; ``sidecars``: ``{name: [N, bs, H_kv, G]}``;
    ``block_ids``: integer ``[B, nb]`` physical blocks, in logical order.
    ``first_block``: the caller knows that ``B == 1`` and the blocks are
    ``first_block, first_block + 1, ...`` (see :func:`consecutive_blocks`); they
    are then read as a view, and a lossless codec copies nothing.
    """
    B, nb = block_ids.shape
    _, bs, H, Dp = pages.shape
    if first_block is not None:
        payload = pages[first_block : first_block + nb].reshape(nb * bs, H, Dp)  # a view
        sc = {n: s[first_block : first_block + nb].reshape(nb * bs, H, -1) for n, s in sidecars.items()}
        return codec.decode(payload, sc).reshape(1, nb * bs, H, -1).transpose(1, 2)
    flat = block_ids.reshape(-1).long()
    payload = pages.index_select(0, flat).reshape(B * nb * bs, H, Dp)  # (B*nb*bs, H, D')
    sc = {n: s.index_select(0, flat).reshape(B * nb * bs, H, -1) for n, s in sidecars.items()}
    x = codec.decode(payload, sc)  # (B*nb*bs, H, D)
    return x.reshape(B, nb * bs, H, -1).transpose(1, 2)  # (B, H, nb*bs, D)


def consecutive_blocks(block_ids: torch.Tensor) -> int | None:
    """The first block of ``block_ids`` ``[1, nb]`` when they are consecutive, else ``None``.

    A single sequence takes its blocks from the free list in order, so its pages
    usually lie back to back and can be read as one view. Only CPU tables are
    inspected (on CUDA the check would stall on a device read), and only one row.
    """
    if block_ids.shape[0] != 1 or block_ids.device.type != "cpu" or block_ids.numel() == 0:
        return None
    ids = block_ids[0].tolist()  # one host read; the comparison is plain Python (per row, per layer)
    first = ids[0]
    return first if ids == list(range(first, first + len(ids))) else None


def gather_rows(
    pages: torch.Tensor,
    sidecars: dict[str, torch.Tensor],
    block_tables: torch.Tensor,
    kv_len: torch.Tensor,
    length: int,
    *,
    codec: Codec,
) -> torch.Tensor:
    """Each row's first ``length`` positions, decoded: ``[B, H_kv, length, D]``.

    Positions at or past a row's ``kv_len`` are zeros. ``block_tables`` must hold
    at least ``ceil(length / block_size)`` columns.
    """
    B = block_tables.shape[0]
    bs, H = pages.shape[1], pages.shape[2]
    if length == 0:
        return torch.zeros(B, H, 0, codec.head_dim, dtype=codec.dtype, device=pages.device)
    nb = math.ceil(length / bs)
    x = gather_pages(pages, sidecars, block_tables[:, :nb], codec=codec)[:, :, :length]
    live = torch.arange(length, device=pages.device)[None, :] < kv_len.to(pages.device)[:, None]
    return x.masked_fill(~live[:, None, :, None], 0)  # (B, H, length, D)


# -- the reference kernels --------------------------------------------------------------
def paged_attention_reference(
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
    chunk_tokens: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` over each row's pages, ``[B, H_q, T, D]`` in ``q.dtype``.

    ``q``: ``[B, H_q, T, D]`` (GQA: ``H_q % H_kv == 0``); pages ``[N, bs, H_kv, D']``;
    ``block_tables`` int32 ``[B, max_blocks]``; ``q_start``, ``kv_len`` integer
    ``[B]``: query ``i`` of row ``b`` sees keys ``j <= q_start[b] + i`` with
    ``j < kv_len[b]``. Queries that see no key return zeros. Keys and values are
    gathered and decoded ``chunk_tokens`` (rounded to whole blocks) at a time;
    by default as many as keep one chunk's decoded keys within
    :data:`DEFAULT_CHUNK_BYTES` (64 MiB: 1024 tokens of 16 rows x 8 heads x 128 fp32).

    One chunk goes straight through SDPA (causal SDPA for a prefill from empty);
    several are merged by log-sum-exp, each through PyTorch's fused CPU kernel on
    the CPU. On the CPU a single row on consecutive blocks is read as a view, and a
    chunk that every query sees whole gets no mask; rows of different lengths or
    starts, each within the byte budget, are attended row by row over their own keys
    (causal from empty, unmasked for a decode step, masked otherwise).

    ``window``: query ``i`` of row ``b`` sees only keys ``j > q_start[b] + i - window`` too (a
    sliding window); the blocks before a row's first query's window are not read.
    """
    _check_attention_args(q, key_pages, value_pages, block_tables, q_start, kv_len)
    B, Hq, T, D = q.shape
    bs = key_pages.shape[1]
    if window is not None:
        block_tables, q_start, kv_len = _skip_unseen_blocks(block_tables, q_start, kv_len, window, bs)
    max_len = int(kv_len.max()) if B else 0
    if max_len <= 0:
        return q.new_zeros(B, Hq, T, D)
    given_chunk = chunk_tokens
    if chunk_tokens is None:
        chunk_tokens = DEFAULT_CHUNK_BYTES // (B * key_pages.shape[2] * k_codec.head_dim * 4)
    per_chunk = max(1, chunk_tokens // bs)  # blocks per chunk
    total = math.ceil(max_len / bs)
    if block_tables.shape[1] < total:
        raise ValueError(
            f"kv_len {max_len} needs {total} blocks but block_tables has "
            f"{block_tables.shape[1]} columns"
        )
    q_start, kv_len = q_start.to(q.device), kv_len.to(q.device)
    cpu = q.device.type == "cpu"
    # rows of different lengths or starts, each within the byte budget (or the chunk the
    # caller gave): row by row, over its own keys, instead of all padded to the longest
    shortest = int(kv_len.min()) if cpu else 0
    row_tokens = given_chunk or DEFAULT_CHUNK_BYTES // (key_pages.shape[2] * k_codec.head_dim * 4)
    if (cpu and (B > 1 or window is not None) and max_len <= row_tokens
            and (window is not None or shortest < max_len or bool((q_start != q_start[0]).any()))):
        return _attend_rows(q, key_pages, value_pages, block_tables, q_start, kv_len, k_codec=k_codec,
                            v_codec=v_codec, k_sidecars=k_sidecars, v_sidecars=v_sidecars, scale=scale,
                            window=window)
    first = consecutive_blocks(block_tables[:, :total])  # None on CUDA and for several rows
    if first is not None and k_codec.lossless and v_codec.lossless:
        per_chunk = total  # the keys are read as a view: one chunk copies nothing
    # On the CPU the bounds are cheap host reads: a chunk every query sees whole needs no mask.
    sees_all = min(int(q_start.min()) + 1, shortest) if cpu and window is None else 0
    # a prefill from empty (every row's T queries are its keys 0..T-1): plain causal SDPA
    from_empty = (cpu and window is None and per_chunk >= total and shortest == max_len == T
                  and int(q_start.max()) == 0)
    partial = fused_partial_attention if cpu and _FUSED_CPU is not None else partial_attention
    acc = OnlineSoftmax()
    for b0 in range(0, total, per_chunk):
        ids = block_tables[:, b0 : min(b0 + per_chunk, total)]  # (B, nb)
        at = None if first is None else first + b0
        k = gather_pages(key_pages, k_sidecars, ids, codec=k_codec, first_block=at)  # (B, H_kv, nb*bs, D)
        v = gather_pages(value_pages, v_sidecars, ids, codec=v_codec, first_block=at)
        end = min(k.shape[2], max_len - b0 * bs)  # keys past the longest row are never visible
        k, v = k[:, :, :end], v[:, :, :end]
        if from_empty:
            return precision.sdpa(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale,
                                  enable_gqa=Hq > k.shape[1])
        mask = (None if b0 * bs + end <= sees_all
                else causal_mask(B, T, end, q_start, kv_len, key_start=b0 * bs, device=q.device, window=window))
        if per_chunk >= total:  # one chunk: nothing to merge, so SDPA needs no log-sum-exp
            return masked_attention(q, k, v, mask, scale).to(q.dtype)
        acc.add(*partial(q, k, v, mask, scale))
    return acc.result(q.dtype)


def _skip_unseen_blocks(block_tables: torch.Tensor, q_start: torch.Tensor, kv_len: torch.Tensor, window: int,
                       bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's block table, first query and length from its first block that a query's sliding
    ``window`` reaches: the blocks before hold no key any of its queries sees. Positions move by
    whole blocks, so every query keeps its distance to every key (the mask is unchanged)."""
    width, longest = block_tables.shape[1], int(kv_len.max()) if kv_len.numel() else 0
    if -(-longest // bs) > width:  # (before the columns move: a narrow table would read a wrong block)
        raise ValueError(f"kv_len {longest} needs {-(-longest // bs)} blocks but block_tables has {width} columns")
    skip = (q_start - window + 1).clamp(min=0) // bs  # (B,) blocks out of every query's window
    cols = torch.arange(width, device=block_tables.device) + skip[:, None].to(block_tables.device)
    cols = cols.clamp(max=width - 1)  # (past a row's last column: never read)
    moved = skip.to(q_start.dtype) * bs
    return block_tables.gather(1, cols), q_start - moved, (kv_len - moved.to(kv_len.dtype)).clamp(min=0)


def _decode_in_window(q, key_pages, value_pages, block_tables, q_start, kv_len, window: int, **kw):
    """:func:`~kvtier.kernels.cpu_attention.paged_decode_cpu` of one query a row over the last
    ``window`` keys up to it: each row from its first block in the window, from its first key there."""
    tables, q_start, kv_len = _skip_unseen_blocks(block_tables, q_start, kv_len, window, key_pages.shape[1])
    return paged_decode_cpu(q, key_pages, value_pages, tables, q_start, kv_len,
                            first=(q_start - window + 1).clamp(min=0), **kw)


def _attend_rows(q, key_pages, value_pages, block_tables, q_start, kv_len, *, k_codec, v_codec,
                 k_sidecars, v_sidecars, scale, window=None) -> torch.Tensor:
    """:func:`paged_attention_reference` one row at a time (CPU): each row's own blocks,
    gathered to its length (a view where they are consecutive), through SDPA: causal
    for a prompt from empty, unmasked where every query sees the whole row (a decode
    step), masked otherwise. For rows of different lengths, gathering every row to the
    longest and masking the rest costs 2-4x more (a decode step of B=32 rows of 64-576
    tokens: 18-23 ms against 5-10 ms per layer on 2 cores)."""
    B, Hq, T, D = q.shape
    bs = key_pages.shape[1]
    out = q.new_zeros(B, Hq, T, v_codec.head_dim)
    sdpa = functools.partial(precision.sdpa, scale=scale,
                             enable_gqa=Hq > key_pages.shape[2])
    for b, (start, n) in enumerate(zip(q_start.tolist(), kv_len.tolist())):
        if n <= 0:
            continue  # a row that sees no key: zeros
        ids = block_tables[b : b + 1, : -(-n // bs)]  # (1, nb)
        at = consecutive_blocks(ids)
        k = gather_pages(key_pages, k_sidecars, ids, codec=k_codec, first_block=at)[:, :, :n]
        v = gather_pages(value_pages, v_sidecars, ids, codec=v_codec, first_block=at)[:, :, :n]
        qb = q[b : b + 1].to(k.dtype)  # (1, H_q, T, D)
        if window is not None and start + T > window and T == 1 and start + 1 >= n:
            first = start - window + 1  # a decode step past the window: its last keys, no mask
            out[b : b + 1] = sdpa(qb, k[:, :, first:], v[:, :, first:]).to(q.dtype)
        elif window is not None and start + T > window:  # a sliding window cuts the last query's keys
            mask = causal_mask(1, T, n, start, n, device=q.device, window=window)
            out[b : b + 1] = masked_attention(qb, k, v, mask, scale).to(q.dtype)
        elif start + 1 >= n:  # every query sees the whole row (a decode step)
            out[b : b + 1] = sdpa(qb, k, v).to(q.dtype)
        elif start == 0 and n <= T:  # a prompt from empty: causal over its n queries, and
            out[b : b + 1, :, :n] = sdpa(qb[:, :, :n], k, v, is_causal=True).to(q.dtype)
            if n < T:  # queries past the row's keys see all of them
                out[b : b + 1, :, n:] = sdpa(qb[:, :, n:], k, v).to(q.dtype)
        else:
            out[b : b + 1] = masked_attention(qb, k, v, causal_mask(1, T, n, start, n, device=q.device),
                                              scale).to(q.dtype)
    return out


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """SDPA of ``q`` ``[B, H_q, T, D]`` over ``k``/``v`` ``[B, H_kv, S, D]``: ``[B, H_q, T, Dv]``.

    ``mask``: boolean ``[B, 1, T, S]`` (True = visible) or ``None`` (every key
    visible to every query, not causal). A query that sees nothing gets zeros.
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * T, D).to(k.dtype)  # query heads of a group share K: no K/V copy
    mg = mask if mask is None or G == 1 else mask.repeat(1, 1, G, 1)  # (B, 1, G*T, S)
    out = precision.sdpa(qg, k, v, attn_mask=mg, scale=scale)
    if mask is not None:
        out = zero_unseen(out, mg)  # a query that sees no key
    return out.reshape(B, Hq, T, v.shape[3])


def _fused_cpu_op():
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):  # an older or trimmed PyTorch build: the plain path
        return None


#: PyTorch's fused CPU attention that also returns the log-sum-exp (None where absent)
_FUSED_CPU = _fused_cpu_op()


def fused_partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~kvtier.kernels.reference.partial_attention` through PyTorch's fused CPU kernel.

    Same arguments and result (``out`` float32 ``[B, H_q, T, Dv]``, ``lse``
    ``[B, H_q, T]``, ``-inf`` where a query sees no key of the chunk); one kernel
    call instead of materialising the scores. CPU tensors only.
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.float().reshape(B, Hkv, G * T, D)  # (B, H_kv, G*T, D): query heads of a group share K
    bias = None
    if mask is not None:  # the kernel takes an additive mask of the query's dtype
        mg = mask if G == 1 else mask.repeat(1, 1, G, 1)  # (B, 1, G*T, S)
        bias = torch.zeros(mg.shape, dtype=torch.float32).masked_fill_(~mg, float("-inf"))
    out, lse = _FUSED_CPU(qg, k.float(), v.float(), attn_mask=bias, scale=scale)
    if mask is not None:  # a query that sees nothing gets out 0 and lse 0 from the kernel
        lse = lse.masked_fill(~mg.any(-1), float("-inf"))  # (B, H_kv, G*T)
    return out.reshape(B, Hq, T, v.shape[3]), lse.reshape(B, Hq, T)


def paged_write_reference(
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
    """Encode ``keys``/``values`` ``[B, H_kv, T, D]`` and scatter them into their slots, in place.

    ``slot_mapping``: int64 ``[B * T]``, row-major over ``(b, t)``; slot ``s`` is
    block ``s // block_size``, in-block position ``s % block_size``. Sidecars
    ``{name: [N, bs, H_kv, G]}`` receive the codec's scales and zeros.
    """
    _check_pages(key_pages, value_pages)
    B, H, T, _ = keys.shape
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (B * T,):
        raise ValueError(
            f"slot_mapping must be int64 [{B * T}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    for pages, sidecars, x, codec in (
        (key_pages, k_sidecars, keys, k_codec),
        (value_pages, v_sidecars, values, v_codec),
    ):
        payload, sc = codec.encode(x.transpose(1, 2).reshape(B * T, H, -1))  # (B*T, H, D)
        pages.view(-1, H, pages.shape[3]).index_copy_(0, slot_mapping, payload)
        for name, side in sidecars.items():
            side.view(-1, H, side.shape[3]).index_copy_(0, slot_mapping, sc[name].to(side.dtype))


# -- through the dispatch -----------------------------------------------------------------
def _import_triton():
    return importlib.import_module(TRITON_MODULE)


def paged_attention(
    dispatch: KernelDispatch,
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    kv_len: torch.Tensor,
    **kw,
) -> torch.Tensor:
    """:func:`paged_attention_reference` (arguments, without ``chunk_tokens``, and result
    ``[B, H_q, T, D]``) through ``dispatch``: Triton's ``paged_attention_triton`` where it
    serves, on the CPU the C decode kernel (:func:`~kvtier.kernels.cpu_attention.paged_decode_cpu`)
    for the calls it covers; with a sliding ``window``, the C kernel for one query a row (from its
    window's first key), Triton's for every query count."""
    args = (q, key_pages, value_pages, block_tables, q_start, kv_len)
    window = kw.pop("window", None)
    check_window(window)  # (here: a kernel's refusal would send every later call to the reference)
    if window is None:
        cpu_kernel = lambda: paged_decode_cpu(*args, **kw)  # noqa: E731
    else:  # one query a row: the C kernel from its window's first key
        cpu_kernel = (lambda: _decode_in_window(*args, window, **kw)) if q.shape[2] == 1 else None
    return dispatch.serve(
        "attention", q.device,
        lambda: _import_triton().paged_attention_triton(*args, window=window, **kw),
        lambda: paged_attention_reference(*args, window=window, **kw),
        cpu_kernel=cpu_kernel,
    )


def paged_attention_packed_reference(
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    q_offsets: torch.Tensor,
    max_q_len: int,
    **kw,
) -> torch.Tensor:
    """:func:`paged_attention_reference` over packed rows: ``q`` ``[1, H_q, N, D]`` holds row
    ``b``'s ``kv_len[b] - q_start[b]`` queries from token ``q_offsets[b]``; the result has
    ``q``'s shape (tokens no row names are zero). Row by row, each over its own queries
    (a view of ``q``) and its own blocks: no query is padded to the longest row."""
    B = block_tables.shape[0]
    counts = (kv_len - q_start).tolist()
    offsets = q_offsets.tolist()
    if len(counts) != B or len(offsets) != B or any(c < 0 or c > max_q_len for c in counts) or any(
            o < 0 or o + c > q.shape[2] for o, c in zip(offsets, counts)):
        raise ValueError(f"packed rows must name queries inside q's {q.shape[2]} tokens, at most "
                         f"max_q_len {max_q_len} each: got q_offsets {offsets} and counts {counts}")
    result = torch.zeros_like(q)
    for b, (o, c) in enumerate(zip(offsets, counts)):
        if c:
            result[:, :, o : o + c] = paged_attention_reference(
                q[:, :, o : o + c], key_pages, value_pages, block_tables[b : b + 1], q_start[b : b + 1],
                kv_len[b : b + 1], **kw)
    return result


def paged_attention_packed(
    dispatch: KernelDispatch,
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    q_offsets: torch.Tensor,
    max_q_len: int,
    single_rows: int = 0,
    **kw,
) -> torch.Tensor:
    """:func:`paged_attention_packed_reference` through ``dispatch``: Triton's
    ``paged_attention_triton`` reads the packed queries in place (no padding), the first
    ``single_rows`` rows (one query each, tokens ``0 .. single_rows - 1``) as a decode launch."""
    args = (q, key_pages, value_pages, block_tables, q_start, kv_len)
    check_window(kw.get("window"))
    return dispatch.serve(
        "attention", q.device,
        lambda: _import_triton().paged_attention_triton(*args, q_offsets=q_offsets, max_q_len=max_q_len,
                                                        single_rows=single_rows, **kw),
        lambda: paged_attention_packed_reference(*args, q_offsets=q_offsets, max_q_len=max_q_len, **kw),
    )


def paged_write(
    dispatch: KernelDispatch,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    k_sidecars: dict[str, torch.Tensor],
    v_sidecars: dict[str, torch.Tensor],
    slot_mapping: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    **kw,
) -> None:
    """:func:`paged_write_reference` (arguments; in place) through ``dispatch``: Triton's
    ``paged_write_triton`` where it serves."""
    args = (key_pages, value_pages, k_sidecars, v_sidecars, slot_mapping, keys, values)
    dispatch.serve(
        "write", keys.device,
        lambda: _import_triton().paged_write_triton(*args, **kw),
        lambda: paged_write_reference(*args, **kw),
    )

