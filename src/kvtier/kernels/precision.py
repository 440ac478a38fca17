"""Bfloat16 prefills: the dtype a float32 model's prompt forward multiplies in.

A float32 model's forward of more than :data:`PREFILL_MIN_TOKENS` tokens a row (a prompt, not a
batch of decode steps or a verification of drafts) may run its linears
(:mod:`kvtier.model.linear`) and its attention over the prompt in bfloat16 instead, on CPUs
whose AMX tiles or AVX512-BF16 units multiply bfloat16 several times faster than float32
(:func:`bf16_matmuls_fast`). The model opens :func:`prefill_matmuls` around such a forward;
within it :func:`narrow_dtype` tells a linear or an attention call of float32 inputs with more
than that many rows the dtype to multiply in (a linear returns its result in its input's dtype:
float32, or bfloat16 for an input already in it, as the MLP's SiLU product is), and :func:`sdpa`
is PyTorch's attention with its inputs rounded to it and its result back in float32. Everything
else, and every forward of fewer tokens (decode steps), stays float32.

Example::

    >>> import torch
    >>> from kvtier.kernels.precision import narrow_dtype, prefill_matmuls
    >>> x = torch.zeros(100, 8)
    >>> with prefill_matmuls(torch.bfloat16):
    ...     narrow_dtype(x), narrow_dtype(x[:64])
    (torch.bfloat16, None)
    >>> narrow_dtype(x) is None
    True
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.nn import functional as F

__all__ = ["PREFILL_MIN_TOKENS", "bf16_matmuls_fast", "narrow_dtype", "prefill_matmuls", "sdpa"]

#: calls of more rows (queries) than this take the prefill dtype (the packed linears' C kernels
#: take up to 64 rows a call: :data:`kvtier.model.packed.GROUPED_MAX_ROWS`)
PREFILL_MIN_TOKENS = 64
_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("kvtier_prefill_dtype", default=None)


@contextlib.contextmanager
def prefill_matmuls(dtype: torch.dtype | None):
    """Within the block, linears and attention calls of float32 inputs with more than
    :data:`PREFILL_MIN_TOKENS` rows multiply in ``dtype`` (``None`` or float32: as they are)."""
    token = _DTYPE.set(None if dtype in (None, torch.float32) else dtype)
    try:
        yield
    finally:
        _DTYPE.reset(token)


def narrow_dtype(x: torch.Tensor, rows: int | None = None) -> torch.dtype | None:
    """The dtype a call on ``x`` (float32, or already in that dtype) multiplies in:
    :func:`prefill_matmuls`' within it when ``rows`` (default: ``x``'s, its last dimension the
    features) exceed :data:`PREFILL_MIN_TOKENS`; ``None`` (as it is) otherwise."""
    low = _DTYPE.get()
    if low is None or x.dtype not in (torch.float32, low):
        return None
    n = x.numel() // max(x.shape[-1], 1) if rows is None else rows
    return low if n > PREFILL_MIN_TOKENS else None


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kw)`` of ``q`` ``[B, H, T, D]``; within
    :func:`prefill_matmuls`, for more than :data:`PREFILL_MIN_TOKENS` float32 queries, of
    ``q``, ``k`` and ``v`` rounded to its dtype, the result back in ``q``'s dtype."""
    low = narrow_dtype(q, q.shape[-2])
    if low is None:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    return F.scaled_dot_product_attention(q.to(low), k.to(low), v.to(low), **kw).to(q.dtype)


def bf16_matmuls_fast() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX tiles or AVX512-BF16): without, a
    bfloat16 prefill is slower than a float32 one."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
