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

Tiers whose rows have their own lengths (ragged, paged) also follow
:class:`RowKVCache`: host lengths and ``set_lengths`` (rollback), capacity
(``headroom``/``reserve``/``can_reserve``/``freeze``), rows (``release``,
``filter``, ``extend``) and a :class:`BlockTableView`. Drive code tells the two
kinds apart by type, ``isinstance(cache, RowKVCache)``, never by tier name.

``nbytes`` counts every byte the cache holds (payload and sidecars);
``state``/``meta_state`` are enough to rebuild it exactly (see
:mod:`kvtier.caches.persist`); ``stats()`` is a plain dict of counters.

Errors: a caller's mistake raises :class:`ValueError` (or a
:class:`CacheCapacityError`, a ``MemoryError``, for capacity) whose message names
the value and the fix, and leaves the cache exactly as it was; the checks every
tier shares live in :mod:`kvtier.caches.checks`. Keys and values are stored
detached: a cache never holds an autograd graph.

Threads: a cache is not thread-safe. Give each thread its own caches, or lock
around every call. A second thread that enters ``update``/``trim``/``set_lengths``
while another is inside gets :class:`ConcurrentCacheUse` (a ``RuntimeError``)
instead of a lost write; the check is cheap and catches overlaps, it does not
make concurrent use safe.

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvtier.caches.checks import ConcurrentCacheUse as ConcurrentCacheUse
from kvtier.caches.checks import check_kv as check_kv  # re-exported: the tiers' one import
from kvtier.caches.checks import check_queries as check_queries
from kvtier.caches.checks import check_trim
from kvtier.caches.checks import check_window as check_window
from kvtier.caches.checks import exclusive as exclusive


class CacheCapacityError(MemoryError):
    """A write would pass a capacity the cache must not exceed (frozen or fixed)."""


@contextmanager
def allocating(cache: KVCache, what: str, fix: str,
               error: type[CacheCapacityError] = CacheCapacityError) -> Iterator[None]:
    """Allocate a tier's new storage inside: the allocator's refusal (``torch.OutOfMemoryError``
    is a ``RuntimeError``) leaves as ``error``, a capacity error naming ``what`` and ``fix``.
    The tier allocates everything it needs inside and changes itself only after
    (:meth:`KVCache._allocating_here`)."""
    cache._allocating_here()
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, CacheCapacityError):
            raise
        raise error(f"allocating {what} failed ({str(e)[:160]}); the cache is unchanged: {fix}") from e


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


def fetch_taken(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.fetch()`` in the dtype the cache takes from its caller: a tail cache storing
    ``kv_dtype`` widens back (exactly), so a cache converted from it takes the model's dtype."""
    k, v = cache.fetch()
    dtype = getattr(cache, "dtype", None)
    return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))


def check_indices(name: str, idx: Any, batch: int) -> list[int]:
    """Validate distinct row indices in ``[0, batch)`` (ints, or an integer tensor)."""
    rows = idx.tolist() if isinstance(idx, torch.Tensor) else idx
    if isinstance(rows, int):
        rows = [rows]
    if not isinstance(rows, Sequence) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in rows
    ):
        raise ValueError(f"{name} must be row indices (ints), got {idx!r}")
    bad = [r for r in rows if not 0 <= r < batch]
    if bad or len(set(rows)) != len(rows):
        raise ValueError(
            f"{name} {list(rows)} must be distinct rows in [0, {batch}); "
            f"{'out of range: ' + str(bad) if bad else 'a row appears twice'}"
        )
    return list(rows)


def check_lengths(lengths: Any, current: list[int]) -> list[int]:
    """``lengths`` (``B`` ints or an integer tensor ``[B]``) as host ints, each within
    ``[0, current[r]]``; otherwise a ``ValueError`` naming the bad rows."""
    B = len(current)
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype == torch.bool or lengths.dtype.is_floating_point or lengths.dim() != 1:
            raise ValueError(f"set_lengths takes an integer tensor [{B}], got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
        lengths = lengths.tolist()
    if (not isinstance(lengths, Sequence) or len(lengths) != B
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in lengths)):
        raise ValueError(f"set_lengths takes {B} ints (one per row), got {lengths!r}")
    bad = [r for r, (n, c) in enumerate(zip(lengths, current)) if not 0 <= n <= c]
    if bad:
        raise ValueError(
            f"set_lengths({list(lengths)}): rows {bad} are outside [0, their length] (lengths "
            f"now {current}); it only drops tokens, write new ones with update()"
        )
    return list(lengths)


class KVCache(ABC):
    """Abstract base of every tier. See the module docstring for the contract.

    Not thread-safe: one thread at a time (see the module docstring); the methods that
    write are marked :func:`~kvtier.caches.checks.exclusive` and raise
    :class:`ConcurrentCacheUse` when a second thread enters them.
    """

    #: name used by persistence and configuration ("tail", "block", "ragged", "paged")
    tier: str = ""
    #: the thread inside an exclusive method (kvtier.caches.checks.exclusive), else None
    _owner: int | None = None
    #: tensors made under torch.inference_mode(): mutating methods run inside it (exclusive)
    _inference: bool = False

    def _allocating_here(self) -> None:
        """Record that the caller makes the cache's tensors now: under ``torch.inference_mode()``
        they are inference tensors, so the cache's writes run inside it from then on
        (:func:`~kvtier.caches.checks.exclusive`)."""
        self._inference = self._inference or torch.is_inference_mode_enabled()

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
    def attention(self, queries: torch.Tensor, *, scale: float | None = None,
                  window: int | None = None) -> torch.Tensor:
        """Causal attention ``[B, H_q, T, D]`` of the ``T`` newest positions' queries; with a
        sliding ``window`` each query sees only the ``window`` newest keys up to its own."""

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

    @exclusive
    def trim(self, n: int) -> int:
        n = min(check_trim(n), self._offset)
        self._offset -= n
        return n


@dataclass(frozen=True)
class BlockTableView:
    """Which physical blocks each row of a paged cache holds (a snapshot of the books).

    ``block_size``: tokens per block. ``rows``: row ``r``'s physical block ids in
    logical order (host). ``tables``: int32 ``[B, W]`` on the storage device, a view of
    the cache's block table limited to the columns rows hold (``W`` = the most blocks a
    row holds, at least 1): ``tables[r, i] == rows[r][i]`` for ``i < len(rows[r])``, 0
    past it. The tensor is the cache's own: valid until the next write or row change.
    """

    block_size: int
    rows: tuple[tuple[int, ...], ...]
    tables: torch.Tensor


class RowKVCache(KVCache):
    """A tier whose rows have their own lengths: the per-row protocol of the ragged and paged tiers.

    Drive code (step plans, CUDA graphs, speculative rollback, the ``transformers``
    adapter, a serving engine) uses only this interface and ``update(keys, values, *,
    write_start=None, new_offsets=None, plan=None)``; it never reads a tier's
    storage or pool. In the spirit of vLLM v1's ``KVCacheBlocks``:

    - ``batch_size`` (rows) and ``lengths``: each row's committed length as host ints;
    - ``set_lengths(lengths)``: roll rows back (rejected drafts), each to a value in
      ``[0, its length]``; the tokens past it are dropped (``ValueError`` naming the
      bad rows otherwise, and nothing changes);
    - ``storage_device``; capacity: ``headroom()``, ``reserve(tokens)``,
      ``can_reserve(tokens)``, ``freeze()``/``frozen`` (no allocation after it: what a
      CUDA graph needs);
    - rows: ``release(rows)`` (they become empty), ``filter(indices)``, ``extend(other)``;
    - ``block_table_view()``: a :class:`BlockTableView` for a tier that stores rows in
      blocks of a shared pool (paged), else ``None`` (ragged);
    - ``graph_blocker(device)``: why a CUDA graph could not capture this cache's decode
      step on ``device`` (``None``: it can).

    Example::

        >>> import torch
        >>> from kvtier import RaggedBatchKVCache
        >>> cache = RaggedBatchKVCache(batch_size=2, step=16)
        >>> k = v = torch.randn(2, 2, 5, 64)                 # (B, H_kv, T, D)
        >>> cache.update(k, v)
        >>> cache.set_lengths([3, 5])                        # row 0 drops its 2 newest tokens
        >>> cache.lengths, cache.headroom()
        ([3, 5], 11)
    """

    batch_size: int

    @property
    @abstractmethod
    def lengths(self) -> list[int]:
        """Each row's committed length, ``B`` host ints (a copy)."""

    @exclusive
    def set_lengths(self, lengths: Sequence[int] | torch.Tensor) -> None:
        """Set row ``r``'s committed length to ``lengths[r]`` in ``[0, lengths now]``: the newer
        tokens are dropped (the storage behind them is kept and written over later).
        ``lengths``: ``B`` ints or an integer tensor ``[B]`` (read on the host). Setting
        the lengths a cache already has changes nothing (a step plan stays valid)."""
        current = self.lengths
        new = check_lengths(lengths, current)
        if new != current:
            self._set_lengths(new)

    @abstractmethod
    def _set_lengths(self, lengths: list[int]) -> None:
        """Commit checked ``lengths`` (each at most the row's length now)."""

    @property
    @abstractmethod
    def storage_device(self) -> torch.device:
        """Where the keys and values live (the CPU before the first write)."""

    # -- capacity --------------------------------------------------------------------------
    @abstractmethod
    def headroom(self) -> int:
        """Positions every row can still write without allocating (0 before the first write)."""

    @abstractmethod
    def reserve(self, tokens: int) -> None:
        """Hold capacity for ``tokens`` more positions in every row now (a
        :class:`CacheCapacityError` when frozen or out of room; nothing changes then)."""

    @abstractmethod
    def can_reserve(self, tokens: int) -> bool:
        """Whether :meth:`reserve` of ``tokens`` would succeed."""

    @abstractmethod
    def freeze(self) -> None:
        """Never allocate again: a write past what is held raises :class:`CacheCapacityError`."""

    @property
    @abstractmethod
    def frozen(self) -> bool: ...

    # -- rows --------------------------------------------------------------------------------
    @abstractmethod
    def release(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Empty ``rows`` (distinct indices): their lengths become 0 and a pooled tier
        takes their blocks back."""

    @abstractmethod
    def filter(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep rows ``indices`` in that order."""

    @abstractmethod
    def extend(self, other: RowKVCache) -> None:
        """Append ``other``'s rows (a cache of the same tier and storage) after this one's."""

    # -- views ---------------------------------------------------------------------------------
    def block_table_view(self) -> BlockTableView | None:
        """The rows' blocks, for a tier that stores rows in blocks of a shared pool; else None."""
        return None

    def graph_blocker(self, device: torch.device) -> str | None:
        """Why a CUDA graph could not capture a decode step over this cache on ``device``
        (a read path that reads lengths on the host, say); ``None`` when it can."""
        return None
