"""The contract every kvtier cache tier follows.

Shapes
------
keys, values : ``[batch, kv_heads, tokens, head_dim]``
queries      : ``[batch, q_heads, tokens, head_dim]`` with ``q_heads % kv_heads == 0`` (GQA)

Semantics
---------
``update(keys, values)`` appends ``tokens`` new positions, copying them into
storage the cache owns (the caller's tensors are never kept).
``update_and_fetch(keys, values)`` does the same and returns the active K/V,
``[batch, kv_heads, offset, head_dim]`` (views where storage is contiguous,
gathered where it is not).

``attention(queries)`` is called after the update that wrote the same tokens: of
``T`` queries, query ``i`` sits at position ``offset - T + i`` and sees keys
``0 .. offset - T + i`` (causal). Each tier computes it through its own read
path, never materialising a contiguous copy where the tier avoids one.

``offset`` is the number of live tokens (an ``int``; the ragged and paged tiers
return a ``[batch]`` tensor of per-row lengths). ``size()`` is the longest row,
``empty()`` says whether nothing was ever written, ``trim(n)`` drops the newest
``n`` tokens (clamped; returns what it dropped).

``nbytes`` counts every byte the cache holds (payload and sidecars);
``state``/``meta_state`` are enough to rebuild it exactly (see
:mod:`kvtier.caches.persist`); ``stats()`` is a plain dict of counters.

Errors: a caller's mistake raises :class:`ValueError` (or a
:class:`CacheCapacityError`, a ``MemoryError``, for capacity) whose message names
the value and the fix, and leaves the cache exactly as it was.

Example::

    >>> import torch
    >>> from kvtier import TailOwnedKVCache
    >>> cache = TailOwnedKVCache(step=256)
    >>> k = v = torch.randn(1, 2, 5, 64)           # (B, H_kv, T, D)
    >>> K, V = cache.update_and_fetch(k, v)
    >>> K.shape, cache.offset
    (torch.Size([1, 2, 5, 64]), 5)
    >>> cache.attention(torch.randn(1, 8, 5, 64)).shape   # (B, H_q, T, D)
    torch.Size([1, 8, 5, 64])
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import torch


class CacheCapacityError(MemoryError):
    """A write would pass a capacity the cache must not exceed (frozen or fixed)."""


@dataclass
class CopyStats:
    """Counters of what a cache copied into its own storage."""

    updates: int = 0
    bytes: int = 0
    time_s: float = 0.0
    grow_events: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class CopyTimer:
    """Context manager that books one owned copy into a :class:`CopyStats`."""

    def __init__(self, stats: CopyStats, nbytes: int):
        self.stats, self.nbytes = stats, nbytes

    def __enter__(self) -> CopyTimer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.stats.updates += 1
            self.stats.bytes += self.nbytes
            self.stats.time_s += time.perf_counter() - self.t0


def tensor_nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def check_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    like: torch.Tensor | None = None,
    *,
    batch: int | None = None,
) -> None:
    """Validate a K/V pair against each other and against the stored tensor ``like``.

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
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must agree on "
            "batch, kv_heads and tokens"
        )
    if keys.dtype != values.dtype or keys.device != values.device:
        raise ValueError(
            f"keys ({keys.dtype}, {keys.device}) and values ({values.dtype}, "
            f"{values.device}) must share dtype and device"
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
        if keys.shape[3] != D or values.shape[3] != like.shape[3]:
            raise ValueError(
                f"head_dim {keys.shape[3]}/{values.shape[3]} differs from the cache's {D}"
            )
        if keys.dtype != like.dtype:
            raise ValueError(
                f"dtype {keys.dtype} differs from the cache's {like.dtype}; cast with "
                f".to({like.dtype})"
            )
        if keys.device != like.device:
            raise ValueError(
                f"device {keys.device} differs from the cache's {like.device}; move "
                f"with .to('{like.device}')"
            )


def check_queries(queries: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    if not isinstance(queries, torch.Tensor) or queries.dim() != 4:
        shape = tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries)
        raise ValueError(f"queries must be 4-D [batch, q_heads, tokens, head_dim], got {shape}")
    if queries.shape[1] % kv_heads:
        raise ValueError(
            f"q_heads {queries.shape[1]} is not a multiple of the cache's kv_heads {kv_heads}"
        )
    if queries.shape[3] != head_dim:
        raise ValueError(f"queries head_dim {queries.shape[3]} differs from the cache's {head_dim}")


def check_trim(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"trim(n) takes an int, got {n!r}")
    if n < 0:
        raise ValueError(f"trim(n) needs n >= 0, got {n}; to append, call update()")
    return n


class KVCache(ABC):
    """Abstract base of every tier. See the module docstring for the contract."""

    #: name used by persistence and configuration ("tail", "block", "ragged", "paged")
    tier: str = ""

    # -- writes and reads ---------------------------------------------------
    @abstractmethod
    def update(self, keys: torch.Tensor, values: torch.Tensor, **kwargs) -> None:
        """Append ``keys``/``values`` ``[B, H_kv, T, D]`` into owned storage."""

    @abstractmethod
    def fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The active K/V ``[B, H_kv, offset, D]`` (views or gathered copies)."""

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append, then return the active K/V."""
        self.update(keys, values, **kwargs)
        return self.fetch()

    @abstractmethod
    def attention(self, queries: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        """Causal attention ``[B, H_q, T, D]`` of the ``T`` newest positions' queries."""

    # -- bookkeeping ----------------------------------------------------------
    @property
    @abstractmethod
    def offset(self) -> int | torch.Tensor: ...

    @abstractmethod
    def size(self) -> int: ...

    def empty(self) -> bool:
        return self.size() == 0 and self.nbytes == 0

    def is_trimmable(self) -> bool:
        return True

    @abstractmethod
    def trim(self, n: int) -> int: ...

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    # -- persistence -----------------------------------------------------------
    @property
    @abstractmethod
    def state(self) -> dict[str, torch.Tensor]: ...

    @property
    @abstractmethod
    def meta_state(self) -> dict[str, Any]: ...

    @classmethod
    @abstractmethod
    def from_state(cls, state: dict[str, torch.Tensor], meta_state: dict[str, Any]) -> KVCache:
        """Rebuild a cache from ``state`` and ``meta_state`` exactly."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @classmethod
    @abstractmethod
    def from_cache(cls, other: KVCache, **kwargs) -> KVCache:
        """Build this tier holding ``other``'s contents."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offset={self.offset}, nbytes={self.nbytes})"


class ScalarKVCache(KVCache):
    """A tier whose rows all hold the same number of tokens: ``offset`` is an int."""

    _offset: int = 0

    @property
    def offset(self) -> int:
        return self._offset

    def size(self) -> int:
        return self._offset

    def trim(self, n: int) -> int:
        n = min(check_trim(n), self._offset)
        self._offset -= n
        return n
