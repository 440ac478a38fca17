"""Triton decode attention for the ragged tier: per-row lengths instead of a dense mask.

The ragged tier keeps one padded buffer ``[B, H_kv, capacity, D]`` per K and V
and a length per row. Its reference read path builds a boolean mask
``[B, 1, 1, capacity]`` and runs SDPA over the whole capacity; this kernel reads
only each row's first ``kv_len[b]`` keys, splits long rows across programs and
merges the splits (the kernel of ``kvtier.kernels.triton_attention``, reading
rows instead of pages).

Reference: ``kvtier.kernels.reference.causal_attention(q, keys, values,
q_start=kv_len - 1, kv_len=kv_len)`` (equivalently the tier's mask path).
"""

from __future__ import annotations

import torch

from kvtier.kernels.reference import causal_attention, check_window
from kvtier.kernels.triton_attention import LaunchConfig, launch_attention
from kvtier.kernels.triton_paged import check_device, check_head_dim
from kvtier.kernels.triton_quant import FP, PageFormat

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def ragged_decode_attention_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    scale: float | None = None,
    config: LaunchConfig | None = None,
    window: int | None = None,
    q_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of GQA attention over each row's first ``kv_len[b]`` keys; with a
    sliding ``window``, only keys ``j > q_start[b] - window`` of them (``q_start``, integer
    ``[B]``: the query's position, by default ``kv_len - 1``).

    ``q``: ``[B, H_q, 1, D]``; ``keys``/``values``: ``[B, H_kv, capacity, D]``
    (any strides with a contiguous last dim: views of a larger buffer are
    fine), same dtype as ``q`` (fp16/bf16/fp32); ``kv_len``: integer ``[B]`` on
    the same device, each in ``[0, capacity]``. Returns ``[B, H_q, 1, D]`` in
    ``q.dtype``; a row with ``kv_len == 0`` returns zeros. No device-to-host
    sync: the split plan depends on ``capacity`` only (checked against
    ``kv_len`` on the CPU; on CUDA the kernel clamps ``kv_len`` to ``capacity``).

    Example::

        out = ragged_decode_attention_triton(q, cache.keys, cache.values, cache.offsets)
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in _FLOATS:
        raise ValueError(f"q must be a [B, H_q, 1, D] fp16/bf16/fp32 tensor, got {q!r:.80}")
    device = q.device
    check_device(device)
    B, Hq, T, D = q.shape
    if T != 1:
        raise ValueError(f"ragged decode takes one query token per row, got T={T}; use the mask path")
    check_head_dim(D)
    for name, x in (("keys", keys), ("values", values)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype != q.dtype or x.device != device:
            raise ValueError(f"{name} must be [B, H_kv, capacity, D] {q.dtype} on {device}, got {x!r:.80}")
        if x.shape[0] != B or x.shape[3] != D or x.stride(3) != 1:
            raise ValueError(
                f"{name} {tuple(x.shape)} (strides {x.stride()}) must be [{B}, H_kv, capacity, {D}] "
                "with a contiguous last dim"
            )
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
    H_kv, cap = keys.shape[1], keys.shape[2]
    if Hq % H_kv:
        raise ValueError(f"q has {Hq} heads, not a multiple of the {H_kv} kv heads")
    if (
        not isinstance(kv_len, torch.Tensor)
        or kv_len.dtype.is_floating_point
        or kv_len.dtype == torch.bool
        or tuple(kv_len.shape) != (B,)
        or kv_len.device != device
    ):
        raise ValueError(f"kv_len must be an integer tensor [{B}] on {device}, got {kv_len!r:.80}")
    if device.type == "cpu" and B and (int(kv_len.min()) < 0 or int(kv_len.max()) > cap):
        raise ValueError(f"kv_len must lie in [0, {cap}] (the buffer's capacity), got {kv_len.tolist()}")
    check_window(window)
    if q_start is not None and (window is None or not isinstance(q_start, torch.Tensor) or q_start.shape != (B,)
                                or q_start.device != device or q_start.dtype.is_floating_point):
        raise ValueError(f"q_start goes with a window: an integer tensor [{B}] on {device}, got {q_start!r:.80}")
    if B == 0 or cap == 0:
        return q.new_zeros(B, Hq, 1, D)
    fmt = PageFormat(FP, D, D, bits=8 * q.element_size())
    kv_len = kv_len.contiguous()
    return launch_attention(
        q, keys, values, fmt, fmt,
        block_tables=None, q_start=None if window is None else kv_len - 1 if q_start is None else q_start,
        kv_len=kv_len, scale=scale,
        out_dtype=q.dtype, config=config, window=window,
    )  # fmt: skip


def ragged_decode_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_len: torch.Tensor, *, scale: float | None = None,
    window: int | None = None, q_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch reference of :func:`ragged_decode_attention_triton` (dense mask, SDPA)."""
    kl = kv_len.to(device=q.device, dtype=torch.long)
    qs = kl - 1 if q_start is None else q_start.to(device=q.device, dtype=torch.long)
    return causal_attention(q, keys, values, q_start=qs, kv_len=kl, scale=scale, window=window)


__all__ = ["ragged_decode_attention_triton", "ragged_decode_reference", "LaunchConfig"]
