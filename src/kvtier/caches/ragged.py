"""RaggedBatchKVCache: one padded buffer ``[B, H_kv, capacity, D]`` with a length per row.

For batches whose rows advance at different rates (batched speculative decoding:
a row that accepts its drafts advances by several tokens, a row that rejects them
by one, overwriting the stale slots). See docs/ragged.md.

Host and device: the host keeps an upper bound on the longest row and, while it
knows them, the exact row lengths, so growth never waits on the device. Row values
given as ints, lists or CPU tensors are checked on the host; tensors on an
accelerator are checked on the device with ``torch._assert_async`` (no sync; a bad
value ends in a device-side assertion). The offsets are read back only for host
checks after an accelerator write, in ``trim``/``size``/``stats``/``freeze_capacity``,
and once before growing or refusing a write while the bound may be loose.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.caches.base import (
    CacheCapacityError,
    CopyStats,
    CopyTimer,
    KVCache,
    RowKVCache,
    allocating,
    check_indices,
    check_kv,
    check_queries,
    check_trim,
    check_window,
    exclusive,
    fetch_taken,
    tensor_nbytes,
)
from kvtier.caches.ragged_rows import (
    check_batch_size,
    check_host_rows,
    check_int,
    check_row_mask,
    host_row_values,
    last_write_starts,
    on_accelerator,
    query_starts,
    round_up,
    row_values,
    to_device,
)
from kvtier.caches.ragged_snapshot import (
    RaggedSnapshot,
    check_snapshot,
    layout,
    restore_ragged_caches,
    restore_ragged_caches_masked,
    restore_rows,
    snapshot_ragged_caches,
)
from kvtier.caches.step_plan import StepPlan
from kvtier.caches.tail_owned import read_meta_ints
from kvtier.kernels.dispatch import KernelDispatch
from kvtier.kernels.ragged import ragged_attention
from kvtier.kernels.reference import causal_mask

__all__ = ["RaggedBatchKVCache", "RaggedCapacityError", "RaggedSnapshot", "restore_ragged_caches",
           "restore_ragged_caches_masked", "snapshot_ragged_caches"]


class RaggedCapacityError(CacheCapacityError):
    """A write, reservation or restore would pass the frozen capacity of a ragged cache."""


class RaggedBatchKVCache(RowKVCache):
    """Padded ``[B, H_kv, capacity, D]`` K/V with per-row lengths ``offset`` (int64 ``[B]``).

    ``keys``/``values`` ``[B, H_kv, T, D]`` and ``offsets`` (default ``T`` per row) seed the
    cache (copied). ``update_and_fetch`` takes ``update``'s arguments and returns the whole
    padded buffers. Example: ``cache.update(k, v)`` (``(2, H_kv, 4, D)``: offset ``[4, 4]``);
    ``cache.attention(q)``; ``cache.update(k2, v2, write_start=[4, 2], new_offsets=[6, 3])``
    (``(2, H_kv, 2, D)``: offset ``[6, 3]``). ``attention_backend`` (``auto``, ``torch``,
    ``triton``) serves one-token queries as the paged tier does. More in docs/ragged.md."""

    tier = "ragged"

    def __init__(self, batch_size: int | None = None, step: int = 256,
                 keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 offsets: Any = None, attention_backend: str = "auto"):
        self.dispatch = KernelDispatch(attention_backend, name="ragged")  # checks the name first
        self.attention_backend = attention_backend
        self.step = check_int(step, "step", 1)
        self.batch_size = None if batch_size is None else check_batch_size(batch_size)
        self.keys = self.values = None  # (B, H_kv, capacity, D) each, from the first write
        self._offsets: torch.Tensor | None = None  # (B,) int64, the row lengths
        self._last_ws, self._last_q = None, 0  # (B,) write_start of the last update, its tokens (0: none)
        self._reach = 0  # past every position the last unplanned update wrote (its tokens' queries)
        self._lengths: list[int] | None = None  # exact row lengths, while the host knows them
        self._bound = 0  # host upper bound on the longest row
        self._frozen, self._target = False, 0  # _target: capacity of the first allocation
        self._pos = self._arange = None  # (B, capacity) scratch for scatter positions; (capacity,)
        self._plan: StepPlan | None = None  # the step plan the last writes followed
        self.copy_stats = CopyStats()
        if keys is None or values is None:
            if keys is not None or values is not None or offsets is not None:
                raise ValueError("pass keys and values (and optionally offsets) together, or none")
            if batch_size is not None:
                self._set_rows([0] * batch_size, torch.device("cpu"))
            return
        keys, values = check_kv(keys, values, batch=batch_size)
        B, T = keys.shape[0], keys.shape[2]
        lengths = [T] * B if offsets is None else host_row_values(offsets, "offsets", B)
        if max(lengths) > T:
            raise ValueError(f"offsets {lengths} exceed the {T} tokens given in keys")
        self._set_rows(lengths, keys.device)
        self._reallocate(round_up(T, step), keys, values)
        self.keys[:, :, :T], self.values[:, :, :T] = keys, values

    # -- storage ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocated positions per row (0 before the first write)."""
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def host_bound(self) -> int:
        """Host upper bound on the longest row; reading it never syncs."""
        return self._bound

    def _require_rows(self) -> None:
        if self._offsets is None:
            raise ValueError("the batch size is unknown until the first update()")

    def _live(self) -> int:
        return min(self.capacity, max(self._bound, 1))

    def _changed(self) -> None:
        """Rows or buffers changed outside a step plan: the plan no longer holds."""
        if self._plan is not None:
            self._plan.valid = False
            self._plan = None

    def _set_rows(self, lengths: list[int], device: torch.device) -> None:
        self._changed()
        self.batch_size = len(lengths)
        with torch.inference_mode(False):  # plain tensors: updated in place in any mode
            self._offsets = torch.tensor(lengths, dtype=torch.long, device=device)
            self._last_ws = torch.zeros_like(self._offsets)
        self._lengths, self._bound = list(lengths), max(lengths)

    def _reallocate(self, cap: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """Zeroed ``cap``-slot buffers holding the live prefix. Zeroed, not empty: masked
        slots still enter the matmuls, and garbage there could be NaN."""
        (B, H, _, Dk), dev = like_k.shape, like_k.device
        with allocating(self, f"{cap} positions of {B} rows", "reserve or write less, or filter out rows",
                        RaggedCapacityError):
            new_k, new_v = like_k.new_zeros(B, H, cap, Dk), like_v.new_zeros(B, H, cap, like_v.shape[3])
        self._changed()
        if self.keys is not None:
            n = min(self._live(), cap)
            new_k[:, :, :n], new_v[:, :, :n] = self.keys[:, :, :n], self.values[:, :, :n]
        self.keys, self.values = new_k, new_v
        self._pos = torch.empty(B, cap, dtype=torch.long, device=dev)
        self._arange = torch.arange(cap, device=dev)
        if self._offsets is not None:  # (a first write books its rows once its buffers exist)
            self._offsets, self._last_ws = self._offsets.to(dev), self._last_ws.to(dev)
        self.copy_stats.grow_events += 1

    def _host_lengths(self) -> list[int]:
        """Exact row lengths; reads the device once when the host does not know them."""
        if self._lengths is None:
            self._lengths = self._offsets.tolist()
            self._bound = max(self._lengths)
        return self._lengths

    def _check_fits(self, end: int) -> None:
        limit = self.capacity if self.keys is not None else self._target
        if self._frozen and end > limit:
            raise RaggedCapacityError(f"position {end} is past the frozen capacity {limit}; call "
                                      f"freeze_capacity({end}) or more first, or trim")

    # -- writes -----------------------------------------------------------------------------
    @exclusive
    def update(self, keys: torch.Tensor, values: torch.Tensor, *,
               write_start: Any = None, new_offsets: Any = None, plan: StepPlan | None = None) -> None:
        """Write ``keys``/``values`` ``[B, H_kv, q, D]``, row ``r`` at ``[write_start[r], +q)``.

        ``write_start`` (an int, ints, or an integer tensor ``[B]``; default: each row's
        length) may rewrite (below the length: REPLAY) or append, never leave a gap. The
        length becomes ``new_offsets[r]`` in ``[write_start[r], write_start[r] + q]``
        (default the end; less commits part of the write). ``ValueError`` or
        :class:`RaggedCapacityError` (past a frozen capacity) leave the cache unchanged.
        ``plan``: a :class:`~kvtier.caches.step_plan.StepPlan` shared by every layer (one
        token per row at the plan's positions; no host work, no device read)."""
        keys, values = check_kv(keys, values, self.keys, batch=self.batch_size)
        if plan is not None:
            self._update_planned(keys, values, plan, write_start, new_offsets)
            return
        (B, H, q, _), dev = keys.shape, keys.device
        ws = row_values(write_start, "write_start", B, dev)
        no = row_values(new_offsets, "new_offsets", B, dev)
        on_device = on_accelerator(ws) or on_accelerator(no)
        known = [0] * B if self._offsets is None else self._lengths  # None: the host does not know
        if known is None and not on_device and (ws is not None or no is not None):
            known = self._host_lengths()
        new_lengths = None if on_device or known is None else check_host_rows(ws, no, known, q)
        if isinstance(ws, list) and max(ws) > self._bound:
            raise ValueError(f"write_start {ws} is past every row's length: a write may not leave a gap")
        end = (max(ws) if isinstance(ws, list) else self._bound) + q
        if end > max(self.capacity, self._target) and known is None:
            self._host_lengths()  # the bound may be loose: tighten it once before growing
            end = (max(ws) if isinstance(ws, list) else self._bound) + q
        self._check_fits(end)
        # every check passed: mutate
        self._changed()
        if end > self.capacity:
            self._reallocate(max(round_up(end, self.step), self._target), keys, values)
        if self._offsets is None:  # after the allocation: a refused one leaves the batch unknown
            self._set_rows([0] * B, dev)
        ws, no = (to_device(x, torch.long, dev) if isinstance(x, list) else x for x in (ws, no))
        start = self._offsets if ws is None else ws
        if on_device:
            self._assert_rows(start, no, q)
        if no is not None:  # what is not committed is stored as zeros: masked slots still enter the matmuls
            kept = (self._arange[:q] < (no - start)[:, None])[:, None, :, None]
            keys, values = keys.where(kept, 0), values.where(kept, 0)
        with CopyTimer(self.copy_stats, tensor_nbytes(keys, values)):
            self._last_ws.copy_(start)
            pos = self._pos[:, :q]
            torch.add(self._last_ws[:, None], self._arange[:q], out=pos)  # (B, q)
            self.keys.scatter_(2, pos[:, None, :, None].expand(B, H, q, keys.shape[3]), keys)
            self.values.scatter_(2, pos[:, None, :, None].expand(B, H, q, values.shape[3]), values)
            if no is None:
                torch.add(self._last_ws, q, out=self._offsets)
            else:
                self._offsets.copy_(no)
        self._last_q, self._reach = q, end  # (end: past the last write's every position)
        self._lengths = new_lengths
        self._bound = max(new_lengths) if new_lengths is not None else end

    def _update_planned(self, keys, values, plan: StepPlan, write_start, new_offsets) -> None:
        """Write at the plan's positions; the lengths are then the plan's (shared) host list."""
        plan.check_step(keys, write_start, new_offsets)
        if self.keys is None or plan.bound > self.capacity:
            raise ValueError(f"this plan reaches position {plan.bound} but the cache holds "
                             f"{self.capacity}; plan ragged caches with kvtier.caches.step_plan.StepPlanner")
        B, H, _, _ = keys.shape
        idx = plan.index  # (B, 1)
        with CopyTimer(self.copy_stats, tensor_nbytes(keys, values)):
            self._last_ws.copy_(plan.write_start)
            self.keys.scatter_(2, idx[:, None, :, None].expand(B, H, 1, keys.shape[3]), keys)
            self.values.scatter_(2, idx[:, None, :, None].expand(B, H, 1, values.shape[3]), values)
            self._offsets.copy_(plan.new_offsets)
        self._last_q, self._reach, self._lengths, self._bound = 1, 0, plan.ends, plan.bound
        self._plan = plan

    def _assert_rows(self, start: torch.Tensor, no: torch.Tensor | None, q: int) -> None:
        """The host checks, done on the device without a sync."""
        n = start + q if no is None else no
        ok = (start >= 0) & (start <= self._offsets) & (n >= start) & (n <= start + q)
        torch._assert_async(ok.all(), "RaggedBatchKVCache.update: write_start/new_offsets out of range")

    def fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole padded buffers ``[B, H_kv, capacity, D]``; mask them with :meth:`make_mask`."""
        if self.keys is None:
            raise ValueError("the cache is empty; call update() first")
        return self.keys, self.values

    # -- reads --------------------------------------------------------------------------------
    def make_mask(self, q_len: int, key_len: int | None = None, q_start: Any = None) -> torch.Tensor:
        """Boolean ``[B, 1, q_len, key_len]`` (default ``key_len``: capacity), True where key ``j``
        is visible to query ``i`` of row ``b``: ``j <= q_start[b] + i`` and ``j < offset[b]``.
        ``q_start`` defaults to the last update's ``write_start`` when the queries are its tokens
        (as many, no trim since), else to ``max(offset - q_len, 0)``, the newest positions.
        The shape never depends on the offsets."""
        self._require_rows()
        key_len = self.capacity if key_len is None else check_int(key_len, "key_len", 0)
        return causal_mask(self.batch_size, q_len, key_len, self._query_starts(q_len, q_start),
                           self._offsets, device=self._offsets.device)

    def _query_starts(self, q_len: int, q_start: Any) -> torch.Tensor:
        """Each row's first query position, int64 ``[B]`` on the offsets' device."""
        check_int(q_len, "q_len (queries a row)", 1)
        if q_start is None:  # the last write's tokens start at its rows' starts; else each row's newest
            if q_len != self._last_q and self._lengths is not None and max(self._lengths) < q_len:
                raise ValueError(f"{q_len} queries but rows of {self._lengths} tokens; give q_start")
            return self._last_ws if q_len == self._last_q else (self._offsets - q_len).clamp(min=0)
        return query_starts(q_start, self.batch_size, self._offsets.device)

    def attention(self, queries: torch.Tensor, *, scale: float | None = None,
                  q_start: Any = None, window: int | None = None) -> torch.Tensor:
        """Attention ``[B, H_q, T, D]`` of ``queries`` ``[B, H_q, T, D]``: query ``i`` of row ``b``
        sees keys ``j <= q_start[b] + i``, ``j < offset[b]`` of its own row (:meth:`make_mask`;
        padding is masked, not zeroed), with a sliding ``window`` only ``j > q_start[b] + i -
        window``. Keys are cut at the host bound, or kept whole
        when frozen (static shapes). One-token queries go through the Triton decode kernel
        when the backend resolves to it (per-row lengths, no mask; see
        :class:`~kvtier.kernels.dispatch.KernelDispatch`). The window is dropped while no row
        is longer, except for a planned step on CUDA (a graph may replay it past them)."""
        if self.keys is None:
            raise ValueError("attention() on an empty cache; call update() first")
        scale = check_queries(queries, self.keys.shape[1], self.keys.shape[3], self.keys.dtype, scale)
        # (host bounds on the rows' keys and the queries' positions, the last write's past its commit;
        # given starts: none)
        reach = max(self._live(), self._reach if queries.shape[2] == self._last_q else 0)
        planned = q_start is None and self._plan is not None and self._plan.valid and queries.is_cuda
        window = check_window(window, None if q_start is not None or planned else reach)
        if queries.shape[0] != self.batch_size:
            raise ValueError(f"queries batch {queries.shape[0]} differs from the cache's {self.batch_size}")
        S = self.capacity if self._frozen else self._live()
        qs = self._query_starts(queries.shape[2], q_start)  # (B,)
        plan = self._plan if q_start is None else None  # a planned step: its lengths are the keys seen
        known = plan.new_offsets if plan is not None and plan.valid else None
        return ragged_attention(self.dispatch, queries, self.keys[:, :, :S], self.values[:, :, :S], qs,
                                self._offsets, scale=scale, decode_len=known, window=window)

    # -- capacity -------------------------------------------------------------------------------
    @exclusive
    def reserve(self, tokens: int) -> None:
        """Grow now so writes reaching ``tokens`` positions past the longest row need no growth."""
        needed = self._bound + check_int(tokens, "reserve(tokens)", 0)
        if needed > max(self.capacity, self._target) and self._offsets is not None:
            needed = max(self._host_lengths()) + tokens  # the bound may be loose: tighten it once
        self._check_fits(needed)
        if self.keys is None:
            self._target = max(self._target, round_up(needed, self.step))
        elif needed > self.capacity:
            self._reallocate(round_up(needed, self.step), self.keys, self.values)

    @exclusive
    def freeze_capacity(self, capacity: int) -> None:
        """Pin the buffers at ``capacity`` rounded up to ``step``: no update allocates after this
        (before the first write, the first write allocates exactly that). A write past it
        raises :class:`RaggedCapacityError`. Calling it again re-pins."""
        cap = round_up(check_int(capacity, "freeze_capacity(capacity)", 1), self.step)
        if self.keys is not None:
            longest = max(self._host_lengths())
            if cap < longest:
                raise ValueError(f"capacity {capacity} is below the longest row {longest}; pass >= {longest}")
            if cap != self.capacity:
                self._reallocate(cap, self.keys, self.values)
        self._target, self._frozen = cap, True

    def can_reserve(self, tokens: int) -> bool:
        """Whether :meth:`reserve` of ``tokens`` fits: always, unless the capacity is frozen."""
        check_int(tokens, "can_reserve(tokens)", 0)
        if not self._frozen:
            return True
        longest = 0 if self._offsets is None else max(self._host_lengths())
        return longest + tokens <= (self.capacity if self.keys is not None else self._target)

    def headroom(self) -> int:
        """Positions every row can still write before the buffers must grow (0 before a write)."""
        return 0 if self.keys is None else self.capacity - max(self._host_lengths())

    def freeze(self) -> None:
        """:meth:`freeze_capacity` at the capacity held now (:meth:`reserve` first to hold more)."""
        self.freeze_capacity(max(self.capacity, self._target, 1))

    # -- rollback -------------------------------------------------------------------------------
    def snapshot(self) -> RaggedSnapshot:
        """Owned copies of every row's live prefix, the offsets and the host bookkeeping."""
        self._require_rows()
        n, held = self._live(), self.keys is not None
        return RaggedSnapshot(self.keys[:, :, :n].clone() if held else None,
                              self.values[:, :, :n].clone() if held else None,
                              self._offsets.clone(), self._last_ws.clone(), self._last_q,
                              None if self._lengths is None else tuple(self._lengths), self._bound)

    @exclusive
    def restore(self, snap: RaggedSnapshot) -> None:
        """Return every row to ``snap`` exactly, in place (frozen buffers keep their address)."""
        check_snapshot(self, snap)
        restore_rows(self, snap, None)

    @exclusive
    def restore_masked(self, snap: RaggedSnapshot, row_mask: Any) -> None:
        """Return the rows where ``row_mask`` (``[B]`` bools) is True to ``snap`` exactly (content
        and offset; a snapshot at a smaller capacity is fine); the others keep theirs. Default
        queries of a row whose last write had other tokens than the cache's last one take the
        row's newest positions (:func:`~kvtier.caches.ragged_snapshot.restore_rows`)."""
        check_snapshot(self, snap)
        restore_rows(self, snap, check_row_mask(row_mask, self.batch_size))

    # -- batch ----------------------------------------------------------------------------------
    @exclusive
    def release(self, rows: Any) -> None:
        """Empty ``rows`` (distinct indices): their lengths become 0; the buffers keep their size."""
        self._require_rows()
        gone = set(check_indices("rows", rows, self.batch_size))
        lengths = [0 if r in gone else n for r, n in enumerate(self._host_lengths())]
        if gone:
            self._set_lengths(lengths)

    @exclusive
    def filter(self, indices: Any) -> None:
        """Keep the rows ``indices`` (ints or an integer tensor; order kept, repeats allowed)."""
        self._require_rows()
        n = len(indices) if isinstance(indices, list | tuple | torch.Tensor) else 0
        idx = host_row_values(indices, "indices", n) if n else []
        if not idx or max(idx) >= self.batch_size:
            raise ValueError(f"indices {indices!r} must be a non-empty list of rows in [0, {self.batch_size})")
        t = torch.tensor(idx, device=self._offsets.device)
        self._changed()
        self._allocating_here()
        if self.keys is not None:
            self.keys, self.values = self.keys[t], self.values[t]
            self._pos = self._pos.new_empty(len(idx), self.capacity)
        self._offsets, self._last_ws, self.batch_size = self._offsets[t], self._last_ws[t], len(idx)
        if self._lengths is not None:
            self._lengths = [self._lengths[i] for i in idx]
            self._bound = max(self._lengths)

    @exclusive
    def extend(self, other: RaggedBatchKVCache) -> None:
        """Append ``other``'s rows after this cache's; capacities are aligned by zero padding (to
        the larger, or to the capacity reserved or frozen before this cache's first write)."""
        if not isinstance(other, RaggedBatchKVCache):
            raise ValueError(f"extend() takes a RaggedBatchKVCache, got {type(other).__name__}")
        if self._offsets is None or other._offsets is None:
            raise ValueError("both caches need a known batch size; give batch_size or write first")
        held = [c for c in (self, other) if c.keys is not None]
        if len({layout(c.keys, c.values) for c in held}) > 1:
            raise ValueError("the caches' heads, head_dims, dtype or device differ")
        cap = max(self.capacity, self._target, other.capacity)
        self._check_fits(other.capacity)
        self._changed()
        self._allocating_here()
        if held:
            k0, v0 = held[0].keys, held[0].values
            ks = k0.new_zeros(self.batch_size + other.batch_size, k0.shape[1], cap, k0.shape[3])
            vs = v0.new_zeros(ks.shape[0], v0.shape[1], cap, v0.shape[3])
            for c, rows in ((self, slice(0, self.batch_size)), (other, slice(self.batch_size, None))):
                if c.keys is not None:
                    ks[rows, :, : c.capacity], vs[rows, :, : c.capacity] = c.keys, c.values
            self.keys, self.values = ks, vs
            self._pos = k0.new_empty(ks.shape[0], cap, dtype=torch.long)
            self._arange = torch.arange(cap, device=k0.device)
        dev = self._offsets.device if not held else held[0].keys.device
        q = self._last_q or other._last_q  # rows whose last write had other tokens: their newest positions
        self._last_ws = torch.cat([last_write_starts(c._last_ws, c._offsets, c._last_q, q).to(dev)
                                   for c in (self, other)])
        self._offsets = torch.cat([self._offsets.to(dev), other._offsets.to(dev)])
        self._last_q, self.batch_size = q, self._offsets.shape[0]
        self._lengths = None if None in (self._lengths, other._lengths) else self._lengths + other._lengths
        self._bound = max(self._bound, other._bound)

    # -- bookkeeping ----------------------------------------------------------------------------
    @property
    def offset(self) -> torch.Tensor:
        """Row lengths, int64 ``[B]`` (CPU before the first write; ``[0]`` while the batch is
        unknown). The live tensor, updated in place by writes: ``.clone()`` it to keep a value."""
        return self._offsets if self._offsets is not None else torch.zeros(0, dtype=torch.long)

    def size(self) -> int:
        """The longest row (reads the device when the host does not know the lengths)."""
        return 0 if self._offsets is None else max(self._host_lengths())

    @property
    def lengths(self) -> list[int]:
        """Each row's length as host ints (``[]`` while the batch is unknown). The host books
        know them, except after a write whose rows were accelerator tensors: then the device
        is read once."""
        return [] if self._offsets is None else list(self._host_lengths())

    def _set_lengths(self, lengths: list[int]) -> None:
        self._changed()
        self._offsets.copy_(to_device(lengths, torch.long, self._offsets.device))
        self._lengths, self._bound, self._last_q = lengths, max(lengths), 0

    @property
    def storage_device(self) -> torch.device:
        held = self.keys if self.keys is not None else self._offsets
        return torch.device("cpu") if held is None else held.device

    def empty(self) -> bool:
        """True while nothing was ever written."""
        return self.keys is None

    @exclusive
    def trim(self, n: int) -> int:
        """Drop the newest ``n`` tokens of every row, clamped by the shortest row; returns it."""
        n = min(check_trim(n), 0 if self._offsets is None else min(self._host_lengths()))
        if n:
            self._changed()
            self._offsets.sub_(n)
            self._lengths, self._last_q = [v - n for v in self._lengths], 0
            self._bound = max(self._lengths)
        return n

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.keys, self.values, self._offsets, self._last_ws, self._pos, self._arange)

    def stats(self) -> dict[str, Any]:
        """Counters and figures; ``min_offset``/``max_offset`` may read the device."""
        lengths = [0] if self._offsets is None else self._host_lengths()
        return {
            "tier": self.tier, "step": self.step, "batch_size": self.batch_size,
            "capacity": self.capacity, "frozen": self._frozen, "host_bound": self._bound,
            "min_offset": min(lengths), "max_offset": max(lengths), "nbytes": self.nbytes,
            **self.copy_stats.as_dict(), "attention_backend": self.attention_backend,
            "attention_calls_by_backend": dict(self.dispatch.attention_calls),
            "backend_fallback_reason": self.dispatch.fallback_reason,
        }

    # -- persistence and conversion ---------------------------------------------------------------
    @property
    def state(self) -> dict[str, torch.Tensor]:
        """``offsets``, ``last_write_start`` ``[B]`` and ``keys``/``values`` ``[B, H_kv, live, D]``."""
        if self._offsets is None:
            return {}
        out = {"offsets": self._offsets.clone(), "last_write_start": self._last_ws.clone()}
        if self.keys is not None:
            n = self._live()
            out["keys"], out["values"] = self.keys[:, :, :n].clone(), self.values[:, :, :n].clone()
        return out

    @property
    def meta_state(self) -> dict[str, Any]:
        return {
            "tier": self.tier, "step": self.step, "batch_size": self.batch_size,
            "capacity": self.capacity if self.keys is not None else self._target,
            "frozen": self._frozen, "host_bound": self._bound, "last_write_tokens": self._last_q,
            "attention_backend": self.attention_backend,
        }

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], meta_state: dict[str, Any]) -> RaggedBatchKVCache:
        """Rebuild what :attr:`state`/:attr:`meta_state` describe, frozen flag included; the capacity
        exactly when frozen, else at most what the rows fill plus a slack (``ragged_capacity``)."""
        from kvtier.caches.state_checks import check_ragged_state

        cap = check_ragged_state(state, meta_state)  # every field, before anything is built
        if meta_state.get("tier") != cls.tier:
            raise ValueError(f"meta_state tier {meta_state.get('tier')!r} is not {cls.tier!r}")
        (step,) = read_meta_ints(meta_state, "step")
        backend = meta_state.get("attention_backend", "auto")  # files written before the choice
        if "keys" not in state:
            if "offsets" in state and bool(state["offsets"].any()):
                raise ValueError("state has non-zero offsets but no keys/values")
            cache = cls(batch_size=meta_state.get("batch_size"), step=step, attention_backend=backend)
        else:  # without offsets, every row holds all the keys given
            cache = cls(step=step, keys=state["keys"], values=state.get("values"),
                        offsets=state.get("offsets"), attention_backend=backend)
            if cap < cache.capacity:
                raise ValueError(f"meta_state capacity {cap} is below the {cache.capacity} the state needs")
            cache._reallocate(cap, cache.keys, cache.values)
        if "last_write_start" in state and cache._last_ws is not None:
            cache._last_ws.copy_(state["last_write_start"])
        cache._target, cache._frozen = cap, bool(meta_state.get("frozen", False))
        cache._last_q = int(meta_state.get("last_write_tokens") or 0)  # 0 in older files: offset - T
        return cache

    @classmethod
    def from_scalar_cache(cls, cache: KVCache, batch_size: int | None = None, step: int | None = None,
                          attention_backend: str = "auto") -> RaggedBatchKVCache:
        """Every row holds ``cache``'s tokens (one row is broadcast to ``batch_size``); the host
        bound is seeded, so writes need no sync. ``step``: a tail cache's own, else 256."""
        if isinstance(cache, RaggedBatchKVCache) or not isinstance(cache.offset, int):
            raise ValueError(f"from_scalar_cache needs a tier with one int offset, got "
                             f"{type(cache).__name__}; use RaggedBatchKVCache.from_cache")
        step = getattr(cache, "step", 256) if step is None else step  # a tail cache's own
        kw = {"step": step, "attention_backend": attention_backend}
        if cache.size() == 0:
            return cls(batch_size=batch_size, **kw)
        k, v = (t[:, :, : cache.offset] for t in fetch_taken(cache))  # (B', H_kv, offset, D)
        if batch_size is not None and k.shape[0] != batch_size:
            if k.shape[0] != 1:
                raise ValueError(f"batch_size {batch_size} needs a cache of 1 or {batch_size} rows, "
                                 f"not {k.shape[0]}")
            k, v = k.expand(batch_size, -1, -1, -1), v.expand(batch_size, -1, -1, -1)
        return cls(batch_size=batch_size, keys=k, values=v, **kw)

    @classmethod
    def from_cache(cls, other: KVCache, *, step: int = 256,
                   attention_backend: str = "auto") -> RaggedBatchKVCache:
        """A ragged cache holding ``other``'s rows (a ragged cache, or any one-offset tier)."""
        kw = {"step": step, "attention_backend": attention_backend}
        if isinstance(other, RaggedBatchKVCache):
            if other.keys is None:
                return cls(batch_size=other.batch_size, **kw)
            n = other._live()
            return cls(keys=other.keys[:, :, :n], values=other.values[:, :, :n],
                       offsets=other._offsets, **kw)
        if isinstance(other.offset, int):
            return cls.from_scalar_cache(other, **kw)
        raise ValueError(f"cannot convert the {other.tier!r} tier to ragged rows; write them again")
