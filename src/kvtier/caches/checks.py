"""What every tier checks of its caller: keys and values, queries and scale, trim counts,
and that one thread at a time writes a cache.

One mistake gets one error in every tier (docs/errors.md lists them):

- keys/values that are not 4-D tensors of one layout, or of a dtype the caches do not
  store (:data:`KV_DTYPES`: integers, bools, complex and float8 are refused), or that
  disagree with what the cache holds: ``ValueError``, first write or later, before
  anything is allocated;
- queries of another dtype, head count or head_dim than the cache's, and a ``scale``
  that is not a finite number > 0: ``ValueError``;
- a second thread entering a cache's ``update``/``trim`` while another is inside it:
  :class:`ConcurrentCacheUse` (a ``RuntimeError``).

Checked inputs come back detached: a cache stores copies that carry no autograd graph,
so keys that require grad never keep their graph (and its activations) alive.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from numbers import Real
from typing import Any, TypeVar

import torch

from kvtier.kernels.reference import check_window as valid_window

#: the dtypes a cache stores keys and values in
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

Method = TypeVar("Method", bound=Callable[..., Any])


class ConcurrentCacheUse(RuntimeError):
    """Two threads used one cache at once: a cache is not thread-safe."""


def exclusive(method: Method) -> Method:
    """Mark a method that mutates a cache: a second thread entering any such method of the
    same cache while one is inside raises :class:`ConcurrentCacheUse` (nested calls from
    the thread inside are fine). A plain attribute check, not a lock: it catches the
    overlaps it sees, it does not serialise them.

    Once a cache allocates tensors under ``torch.inference_mode()`` (its tier marks it
    where it allocates), they are inference tensors, which change in place only inside
    that mode: from then on its mutating methods run inside it whatever mode the caller is
    in (an ``inference_mode`` prefill, then a ``no_grad`` decode). A write there into
    storage made outside it marks nothing, so that storage stays usable with autograd."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        me, owner = threading.get_ident(), self._owner
        if owner == me:  # nested: the outer call releases
            return method(self, *args, **kwargs)
        if owner is not None:
            raise ConcurrentCacheUse(
                f"concurrent use of a kvtier cache from two threads ({type(self).__name__}."
                f"{method.__name__}); give each thread its own cache or lock around it"
            )
        self._owner = me
        try:
            if self._inference and not torch.is_inference_mode_enabled():
                with torch.inference_mode():
                    return method(self, *args, **kwargs)
            return method(self, *args, **kwargs)
        finally:
            self._owner = None

    return guarded  # type: ignore[return-value]


def check_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    like: torch.Tensor | None = None,
    *,
    batch: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a K/V pair ``[B, H_kv, T, D]`` against each other and against the stored
    tensor ``like`` ``[B, H_kv, capacity, D]`` (``None`` on a first write); return them
    detached (views, no copy), ready to be copied into the cache. ``dtype``: the dtype the
    cache takes, where it stores another (default ``like``'s).

    Raises ``ValueError`` naming the offending value and the fix.
    """
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, kv_heads, tokens, head_dim], got shape "
                f"{tuple(t.shape)}; reshape it (e.g. q.view(B, H, T, D))"
            )
    if keys.shape != values.shape:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must agree on "
            "batch, kv_heads, tokens and head_dim"
        )
    if keys.dtype != values.dtype or keys.device != values.device:
        raise ValueError(
            f"keys ({keys.dtype}, {keys.device}) and values ({values.dtype}, "
            f"{values.device}) must share dtype and device"
        )
    if keys.dtype not in KV_DTYPES:
        raise ValueError(
            f"keys and values of dtype {keys.dtype} cannot be stored; a cache holds "
            f"{', '.join(str(d) for d in KV_DTYPES)}: cast with .to(torch.float16) (or "
            "quantise through the paged tier's kv_quant)"
        )
    if keys.shape[2] == 0:
        raise ValueError("keys and values hold 0 tokens; pass at least one token")
    if batch is not None and keys.shape[0] != batch:
        raise ValueError(
            f"batch size {keys.shape[0]} differs from the cache's {batch}; "
            "use filter()/extend() to change the batch"
        )
    if like is not None:
        B, H, _, D = like.shape
        if keys.shape[0] != B:
            raise ValueError(
                f"batch size {keys.shape[0]} differs from the cache's {B}; "
                "use a new cache for a different batch"
            )
        if keys.shape[1] != H:
            raise ValueError(f"kv_heads {keys.shape[1]} differs from the cache's {H}")
        if keys.shape[3] != D:
            raise ValueError(f"head_dim {keys.shape[3]} differs from the cache's {D}")
        want = dtype or like.dtype
        if keys.dtype != want:
            raise ValueError(
                f"dtype {keys.dtype} differs from the cache's {want}; cast with "
                f".to({want})"
            )
        if keys.device != like.device:
            raise ValueError(
                f"device {keys.device} differs from the cache's {like.device}; move "
                f"with .to('{like.device}')"
            )
    return keys.detach(), values.detach()


def check_scale(scale: Any, dtype: torch.dtype | None = None) -> float | None:
    """``scale`` as a float (``None``: the default ``1/sqrt(head_dim)``); a ``ValueError``
    unless it is a finite real number > 0, finite in ``dtype`` too (the queries')."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, Real) or not (
            math.isfinite(scale) and scale > 0):
        raise ValueError(
            f"scale must be a finite number > 0, got {scale!r}; pass a float such as "
            "1 / math.sqrt(head_dim), or None for that default"
        )
    if dtype is not None and dtype.is_floating_point and scale > torch.finfo(dtype).max:
        raise ValueError(f"scale {scale!r} overflows the queries' {dtype} (largest "
                         f"{torch.finfo(dtype).max:.4g}): every score would be infinite; pass a "
                         "float such as 1 / math.sqrt(head_dim), or None for that default")
    return float(scale)


def check_queries(
    queries: torch.Tensor, kv_heads: int, head_dim: int, dtype: torch.dtype, scale: Any = None
) -> float | None:
    """Validate queries ``[B, H_q, T, D]`` against a cache of ``kv_heads`` heads of
    ``head_dim`` stored as ``dtype`` (queries must share it), and ``scale``; returns the
    scale (:func:`check_scale`)."""
    if not isinstance(queries, torch.Tensor) or queries.dim() != 4:
        shape = tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries)
        raise ValueError(f"queries must be 4-D [batch, q_heads, tokens, head_dim], got {shape}")
    if queries.shape[1] % kv_heads:
        raise ValueError(
            f"q_heads {queries.shape[1]} is not a multiple of the cache's kv_heads {kv_heads}"
        )
    if queries.shape[2] == 0:
        raise ValueError("queries hold no token (T = 0); attention needs at least one query")
    if queries.shape[3] != head_dim:
        raise ValueError(f"queries head_dim {queries.shape[3]} differs from the cache's {head_dim}")
    if queries.dtype != dtype:
        raise ValueError(
            f"queries dtype {queries.dtype} differs from the cache's {dtype}; cast with "
            f"queries.to({dtype})"
        )
    return check_scale(scale, queries.dtype)


def check_window(window: Any, longest: int | None = None) -> int | None:
    """``window`` (the keys a query sees through a sliding window, its own included) checked: a
    positive int or ``None`` (every key). ``None`` too where no row is ``longest`` tokens (a
    host bound) is longer: then every query sees all its keys."""
    valid_window(window)
    return None if longest is not None and window is not None and longest <= window else window


def check_trim(n: int) -> int:
    """``n`` for ``trim(n)``: an int >= 0."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"trim(n) takes an int, got {n!r}")
    if n < 0:
        raise ValueError(f"trim(n) needs n >= 0, got {n}; to append, call update()")
    return n
