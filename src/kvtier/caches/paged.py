"""PagedKVCache: many sequences in one pool of pages, optionally quantised.

Storage is the NHD paged layout of FlashInfer and vLLM: ``key_cache`` and
``value_cache`` ``[num_blocks, block_size, H_kv, D']`` (``D'`` is the codec's
packed width), codec sidecars (scales, zeros) ``[num_blocks, block_size, H_kv, G]``
beside them, and int32 block tables ``[B, num_blocks]`` mapping each row's
logical blocks to physical ones from a free list (see
:mod:`kvtier.caches.paged_pool`). Rows have their own lengths, with the ragged
tier's ``write_start`` / ``new_offsets`` semantics.

The arithmetic (encode-and-scatter, gather-and-decode, attention) lives in
:mod:`kvtier.kernels.paged`; this module books rows, blocks and codecs.

Policies:

- The pool is allocated on the first write (``num_blocks`` blocks, codecs chosen
  from that write's head_dim and dtype). With ``dynamic=True`` a write that needs
  more blocks than are free grows it by :func:`paged_grown_blocks`; otherwise,
  or after :meth:`PagedKVCache.freeze`, it raises :class:`PagedKVGrowthRefused`
  and nothing changes.
- ``trim`` only moves lengths: the blocks behind the trimmed tokens stay with
  their row (and count as waste) until the row writes over them or is released
  with :meth:`PagedKVCache.release`. Tokens a write does not commit
  (``new_offsets`` below ``write_start + T``) are not stored at all.
- Fallback: TurboQuant that cannot serve falls back to ``kv_quant`` when that is
  set, else full precision; a ``kv_quant`` mode that cannot serve falls back to
  full precision. It warns once and records why (``paged_stats()``).

Example::

    >>> import torch
    >>> cache = PagedKVCache(block_size=16, num_blocks=64, batch_size=2)
    >>> k = v = torch.randn(2, 2, 5, 64)                   # (B, H_kv, T, D)
    >>> cache.update(k, v)
    >>> cache.update(k[:, :, :1], v[:, :, :1], new_offsets=[6, 5])   # row 1 commits nothing
    >>> cache.offset.tolist()
    [6, 5]
    >>> cache.attention(torch.randn(2, 8, 1, 64)).shape     # (B, H_q, T, D)
    torch.Size([2, 8, 1, 64])
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from kvtier.caches.base import (
    BlockTableView,
    CopyStats,
    CopyTimer,
    KVCache,
    RowKVCache,
    check_kv,
    check_queries,
    check_trim,
    check_window,
    exclusive,
    fetch_taken,
)
from kvtier.caches.paged_codecs import CodecChoice, select_codecs, storage_mismatch
from kvtier.caches.paged_pool import (
    BlockPool,
    PagedKVGrowthRefused,
    RowsArg,
    check_indices,
    dynamic_paged_num_blocks,
    paged_grown_blocks,
    rows_arg,
)
from kvtier.caches.paged_state import paged_from_state, paged_meta_state, paged_state, storage_facts
from kvtier.caches.ragged_rows import check_batch_size, check_int, last_write_starts
from kvtier.caches.step_plan import StepPlan
from kvtier.kernels.dispatch import BACKENDS as ATTENTION_BACKENDS
from kvtier.kernels.dispatch import KernelDispatch, resolve_backend
from kvtier.kernels.paged import gather_rows, paged_attention, paged_write
from kvtier.quant.modes import TurboQuantConfig, check_kv_quant, check_turboquant

__all__ = [
    "PagedKVCache",
    "PagedKVGrowthRefused",
    "dynamic_paged_num_blocks",
    "paged_grown_blocks",
    "select_codecs",
]


class PagedKVCache(RowKVCache):
    """Pages ``[num_blocks, block_size, H_kv, D']`` shared by ``batch_size`` rows through block tables.

    ``offset`` is a ``[B]`` tensor of row lengths; ``fetch()`` returns gathered,
    dequantised ``[B, H_kv, max_len, D]`` K/V with rows zero-padded past their
    lengths; ``attention(q)`` reads the pages chunk by chunk (or through the
    Triton kernel) without a full-precision copy of the cache.
    """

    tier = "paged"

    def __init__(
        self,
        block_size: int = 16,
        num_blocks: int = 1024,
        *,
        batch_size: int = 1,
        dynamic: bool = False,
        context_window_tokens: int | None = None,
        kv_quant: str | None = None,
        turboquant: TurboQuantConfig | None = None,
        attention_backend: str = "auto",
    ):
        self.block_size = check_int(block_size, "block_size", 1)
        self.num_blocks = check_int(num_blocks, "num_blocks", 1)  # blocks of the first allocation
        check_batch_size(batch_size)  # before the per-row lists are built
        if not isinstance(dynamic, bool):
            raise ValueError(f"dynamic must be a bool, got {dynamic!r}")
        if context_window_tokens is not None:
            check_int(context_window_tokens, "context_window_tokens", 1)
        check_kv_quant(kv_quant)
        check_turboquant(turboquant)
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {attention_backend!r} is unknown; accepted: "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        self.dynamic, self.context_window_tokens = dynamic, context_window_tokens
        self.kv_quant, self.turboquant = kv_quant, turboquant
        self.attention_backend = attention_backend
        self.pool = BlockPool(block_size, batch_size, initial_blocks=num_blocks, dynamic=dynamic,
                              context_window_tokens=context_window_tokens)
        self.codecs: CodecChoice | None = None
        self._lengths = [0] * batch_size  # committed tokens per row
        self._write_start = [0] * batch_size
        self._last_q = 0  # tokens of the last update (0: none since a trim); see attention()
        self._dev: dict[str, torch.Tensor] = {}  # device copies of the host lists, rebuilt on change
        self._plan: StepPlan | None = None  # the step plan the books follow (kvtier.caches.step_plan)
        self.copy_stats = CopyStats()
        self.dispatch = KernelDispatch(attention_backend, name="paged")

    # -- facts ---------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self._lengths)

    @property
    def key_cache(self) -> torch.Tensor | None:
        return self.pool.key_cache

    @property
    def value_cache(self) -> torch.Tensor | None:
        return self.pool.value_cache

    @property
    def block_tables(self) -> torch.Tensor | None:
        return self.pool.block_tables

    @property
    def capacity(self) -> int:
        """Token slots in allocated pages (blocks x block_size)."""
        return self.pool.num_blocks * self.block_size

    @property
    def _device(self) -> torch.device:
        return self.pool.key_cache.device if self.pool.allocated else torch.device("cpu")

    def _rows_tensor(self, name: str, values: list[int]) -> torch.Tensor:
        if name not in self._dev:
            self._dev[name] = torch.tensor(values, dtype=torch.long, device=self._device)
        return self._dev[name]

    def _changed(self) -> None:
        """The books changed outside a step plan: drop the device copies, leave the plan."""
        self._dev = {}
        if self._plan is not None:
            self._plan.valid = False
            self._plan = None

    @property
    def offset(self) -> torch.Tensor:
        """Committed length of each row, int64 ``[B]`` on the cache's device: a copy, since the
        tensor attention reads is kept (a caller's ``pos += 1`` must not move the rows)."""
        return self._rows_tensor("lengths", self._lengths).clone()

    def size(self) -> int:
        return max(self._lengths, default=0)

    @property
    def lengths(self) -> list[int]:
        """Each row's committed length (the host books; no device read)."""
        return list(self._lengths)

    def _set_lengths(self, lengths: list[int]) -> None:
        self._lengths, self._last_q = lengths, 0  # as trim: the blocks behind dropped tokens stay
        self._changed()

    @property
    def storage_device(self) -> torch.device:
        return self._device

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    # -- writes ----------------------------------------------------------------------------
    def _check_like(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~kvtier.caches.checks.check_kv` against the pool: the pair, detached."""
        keys, values = check_kv(keys, values, batch=self.batch_size)
        if self.codecs is None:
            return keys, values
        H, D = self.pool.key_cache.shape[2], self.codecs.k_codec.head_dim
        for what, got, want in (("kv_heads", keys.shape[1], H), ("head_dim", keys.shape[3], D),
                                ("dtype", keys.dtype, self.codecs.k_codec.dtype),
                                ("device", keys.device, self._device)):
            if got != want:
                raise ValueError(f"{what} {got} differs from the cache's {want}; convert the "
                                 f"input (or use a new cache)")
        return keys, values

    def _grow_for(self, extra: int, heads: int, choice: CodecChoice, device: torch.device) -> None:
        """Make ``extra`` more blocks free (allocate, grow or raise); adopt the codecs on first use."""
        size = (self.pool.allocated, self.pool.num_blocks)
        grew = self.pool.make_room(extra, heads, choice.k_codec, choice.v_codec, device)
        if (self.pool.allocated, self.pool.num_blocks) != size:  # new tensors
            self._allocating_here()
        if self.codecs is None:
            self._adopt(choice)
        self.copy_stats.grow_events += int(grew)
        self._changed()

    def _adopt(self, choice: CodecChoice) -> None:
        self.codecs = choice
        for reason, what in ((choice.turboquant_disabled_reason, "TurboQuant"),
                             (choice.kv_quant_disabled_reason, f"kv_quant={self.kv_quant}")):
            if reason is not None:
                warnings.warn(
                    f"kvtier paged cache: {what} cannot serve ({reason}); storing as "
                    f"{choice.mode!r} instead", RuntimeWarning, stacklevel=4)

    @exclusive
    def update(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        write_start: RowsArg = None,
        new_offsets: RowsArg = None,
        plan: StepPlan | None = None,
    ) -> None:
        """Write ``keys``/``values`` ``[B, H_kv, T, D]``; row ``r`` at ``[write_start[r], +T)``.

        ``write_start`` defaults to each row's length and may be lower (rewriting
        history), never higher. Row ``r``'s length becomes ``new_offsets[r]``
        (default ``write_start[r] + T``; at least ``write_start[r]``); tokens at
        or past it are not stored and take no blocks (as in the ragged tier,
        attention only ever sees committed tokens). Both take
        an int (every row), ``B`` ints or an integer tensor ``[B]`` (read on the
        host). Raises ``ValueError`` for bad input and
        :class:`PagedKVGrowthRefused` when the pool may not grow; either way the
        cache is unchanged.

        ``plan``: a :class:`~kvtier.caches.step_plan.StepPlan` shared by every
        layer (one token per row at ``plan.slots``; no host bookkeeping, no
        device read); ``write_start``/``new_offsets`` are then the plan's or None.
        """
        keys, values = self._check_like(keys, values)
        if plan is not None:
            self._update_planned(keys, values, plan, write_start, new_offsets)
            return
        T = keys.shape[2]
        ws = rows_arg(self.batch_size, "write_start", write_start, self._lengths)
        bad = [r for r, (w, n) in enumerate(zip(ws, self._lengths)) if not 0 <= w <= n]
        if bad:
            raise ValueError(
                f"write_start {ws} must lie in [0, offset] per row (offsets {self._lengths}); "
                f"rows {bad} would leave a gap or are negative"
            )
        new = rows_arg(self.batch_size, "new_offsets", new_offsets, [w + T for w in ws])
        bad = [r for r in range(self.batch_size) if not ws[r] <= new[r] <= ws[r] + T]
        if bad:
            raise ValueError(
                f"new_offsets {new} must lie in [write_start, write_start + {T}] per row "
                f"(write_start {ws}); rows {bad} do not"
            )
        extra = self.pool.extra_blocks(new)  # uncommitted tokens are not stored
        choice = self.codecs or select_codecs(keys.shape[3], keys.dtype, self.kv_quant, self.turboquant)
        self._grow_for(sum(extra), keys.shape[1], choice, keys.device)
        self.pool.assign(extra)
        self._store(keys, values, ws, [n - w for n, w in zip(new, ws)])
        self._lengths, self._write_start, self._last_q = new, ws, T
        self._changed()

    def _update_planned(self, keys, values, plan: StepPlan, write_start, new_offsets) -> None:
        """Write at the plan's slots; the books then point at the plan's (shared) lists."""
        plan.check_step(keys, write_start, new_offsets)
        if self.codecs is None or plan.slots is None or plan.block_tables.shape[0] != self.batch_size:
            raise ValueError("this plan was not made for this cache: plan paged caches that hold tokens "
                             "with kvtier.caches.step_plan.StepPlanner")
        self._write(keys, values, plan.slots)
        self.commit_planned(plan)

    def commit_planned(self, plan: StepPlan) -> None:
        """Book ``plan``'s step, its tokens written at its slots (by :meth:`update`, or in place by
        a caller: the one-call CPU decode step, :mod:`kvtier.model.cpu_step`)."""
        if not plan.valid or plan.block_tables is None or plan.block_tables.shape[0] != self.batch_size:
            raise ValueError("commit_planned() takes a valid plan StepPlanner made for this cache")
        self._lengths, self._write_start, self._dev, self._plan = plan.ends, plan.starts, plan.memo, plan
        self._last_q = plan.tokens

    def _write(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Encode ``keys``/``values`` ``[B, H_kv, T, D]`` (or ``[1, H_kv, n, D]``) into ``slots``."""
        H = keys.shape[1]  # K and V may have other strides (a fused QKV's slices): no copy
        k_codec, v_codec = self.codecs.k_codec, self.codecs.v_codec
        if k_codec.centres_keys and k_codec.centre is None:
            k_codec.set_centre(keys)  # the first keys fix the centre every key is coded against
        nbytes = slots.numel() * H * (k_codec.bytes_per_token_head() + v_codec.bytes_per_token_head())
        with CopyTimer(self.copy_stats, nbytes):
            paged_write(
                self.dispatch, self.pool.key_cache, self.pool.value_cache, self.pool.k_sidecars,
                self.pool.v_sidecars, slots, keys, values, k_codec=k_codec, v_codec=v_codec,
            )

    def _store(self, keys: torch.Tensor, values: torch.Tensor, ws: list[int], counts: list[int]) -> None:
        """Encode the first ``counts[r]`` tokens of row ``r`` into slots from position ``ws[r]``."""
        B, H, T, D = keys.shape
        if sum(counts) == 0:
            return
        if sum(counts) < B * T:  # a partial commit: keep only what is committed
            keep = (torch.arange(T)[None, :] < torch.tensor(counts)[:, None]).reshape(-1)
            kept = keep.nonzero().squeeze(1).to(keys.device)
            keys = keys.transpose(1, 2).reshape(B * T, H, D).index_select(0, kept)  # (n, H, D)
            values = values.transpose(1, 2).reshape(B * T, H, D).index_select(0, kept)
            keys, values = keys[None].transpose(1, 2), values[None].transpose(1, 2)  # (1, H, n, D)
        self._write(keys, values, self.pool.slots(ws, counts, keys.device))

    # -- reads ---------------------------------------------------------------------------------
    def _require_storage(self, what: str) -> None:
        if not self.pool.allocated:
            raise ValueError(f"{what} on an empty paged cache; call update() first")

    def fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered, dequantised K/V ``[B, H_kv, max_len, D]``, zeros past each row's length.

        For one row this is exactly ``[1, H_kv, offset, D]``. It is a copy, built
        for compatibility; :meth:`attention` does not need it.
        """
        self._require_storage("fetch()")
        lengths, n = self._rows_tensor("lengths", self._lengths), self.size()
        p = self.pool
        return (
            gather_rows(p.key_cache, p.k_sidecars, p.block_tables, lengths, n, codec=self.codecs.k_codec),
            gather_rows(p.value_cache, p.v_sidecars, p.block_tables, lengths, n, codec=self.codecs.v_codec),
        )

    def attention(self, queries: torch.Tensor, *, scale: float | None = None, q_start: RowsArg = None,
                  window: int | None = None) -> torch.Tensor:
        """Causal attention ``[B, H_q, T, D]`` of ``queries`` ``[B, H_q, T, D]`` over each row's pages.

        Query ``i`` of row ``r`` sits at ``q_start[r] + i`` (default: the
        ``write_start`` of the last update when the queries are its tokens, as many and no
        trim since; otherwise ``offset[r] - T``, the row's newest positions, as every tier
        places them, and 0 for a shorter row) and sees the row's committed keys
        ``j <= q_start[r] + i``, ``j < offset[r]``. Rows that see nothing
        (released rows) return zeros. After a planned update the positions,
        lengths and block table are the plan's device tensors (no host work). A sliding ``window``:
        keys ``j > q_start[r] + i - window`` only; dropped while every key and query lies inside it,
        except for a planned step on CUDA (a graph may replay it past the lengths seen now).
        """
        self._require_storage("attention()")
        k_codec = self.codecs.k_codec
        scale = check_queries(queries, self.pool.key_cache.shape[2], k_codec.head_dim, k_codec.dtype, scale)
        window = check_window(window)
        if queries.shape[0] != self.batch_size or queries.device != self._device:
            raise ValueError(f"queries batch {queries.shape[0]} on {queries.device} must match the cache's "
                             f"batch {self.batch_size} on {self._device}")
        p, plan, T = self.pool, self._plan, queries.shape[2]
        last = q_start is None and self._last_q == T  # the last update's tokens, at its starts
        if planned := plan is not None and plan.valid and last:
            qs, q_start_t, kv_len, tables = self._write_start, plan.write_start, plan.new_offsets, plan.block_tables
        else:
            newest = None if q_start is not None or last else [max(0, n - T) for n in self._lengths]
            if newest is not None and max(self._lengths) < T:
                raise ValueError(f"{T} queries but rows of {self._lengths} tokens; give q_start")
            qs = rows_arg(self.batch_size, "q_start", q_start, newest or self._write_start)
            if any(q < 0 for q in qs):
                raise ValueError(f"q_start {qs} must be >= 0 per row")
            q_start_t = (self._rows_tensor("write_start", qs) if last
                         else torch.tensor(qs, device=self._device))
            width = max(1, max(len(r) for r in p.rows))  # kernels plan their split on the width
            kv_len, tables = self._rows_tensor("lengths", self._lengths), p.block_tables[:, :width]
        return paged_attention(
            self.dispatch, queries, p.key_cache, p.value_cache, tables, q_start_t, kv_len,
            k_codec=k_codec, v_codec=self.codecs.v_codec, k_sidecars=p.k_sidecars, v_sidecars=p.v_sidecars,
            scale=scale, window=window if planned and queries.is_cuda  # (else all inside it: none)
            else window and check_window(window, max(max(self._lengths), max(qs) + T)),
        )

    # -- lengths and rows ----------------------------------------------------------------------
    @exclusive
    def trim(self, n: int) -> int:
        """Drop the newest ``n`` tokens of every row (a shorter row empties); returns
        ``min(n, size())``. The rows keep their blocks (see the module docstring)."""
        n = min(check_trim(n), self.size())
        self._lengths, self._last_q = [max(0, x - n) for x in self._lengths], 0
        self._changed()
        return n

    @exclusive
    def release(self, rows: RowsArg) -> None:
        """Return the blocks of ``rows`` to the free list; those rows become empty (length 0)."""
        rows = check_indices("rows", rows, self.batch_size)
        self.pool.release(rows)
        gone = set(rows)  # new lists: a step plan's lists may be shared by other layers
        self._lengths = [0 if r in gone else n for r, n in enumerate(self._lengths)]
        self._write_start = [0 if r in gone else n for r, n in enumerate(self._write_start)]
        self._changed()

    @exclusive
    def filter(self, indices: RowsArg) -> None:
        """Keep rows ``indices`` (in that order); the other rows' blocks return to the free list."""
        keep = check_indices("indices", indices, self.batch_size)
        if not keep:
            raise ValueError("filter() needs at least one row; to drop everything, release() the rows")
        kept = set(keep)
        self.pool.release([r for r in range(self.batch_size) if r not in kept])
        self.pool.select(keep)
        for name in ("_lengths", "_write_start"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        self._changed()

    @exclusive
    def extend(self, other: PagedKVCache) -> None:
        """Append ``other``'s rows after this cache's, copying their blocks (exact, no re-encoding).

        ``other`` must use the same block size and storage (mode, head_dim, dtype, kv_heads).
        Only blocks under each row's length are copied. A row whose last write had other
        tokens than the cache's last one takes default queries at its newest positions.
        """
        if not isinstance(other, PagedKVCache):
            raise ValueError(f"extend() takes a PagedKVCache, got {type(other).__name__}; "
                             "convert it with PagedKVCache.from_cache() first")
        if other is self:
            raise ValueError("extend() with the cache itself; copy it first (from_state(state, meta_state))")
        why = storage_mismatch(self, other)
        if why is not None:
            raise ValueError(f"cannot extend with that cache: {why}")
        bs = self.block_size
        src = [row[: math.ceil(n / bs)] for row, n in zip(other.pool.rows, other._lengths)]
        B = self.batch_size
        if other.pool.allocated:
            heads = other.pool.key_cache.shape[2]
            self._grow_for(sum(map(len, src)), heads, self.codecs or other.codecs,
                           self._device if self.pool.allocated else other._device)
        self.pool.add_rows(other.batch_size)
        if other.pool.allocated:
            self.pool.assign([0] * B + [len(s) for s in src])
            dst = [b for row in self.pool.rows[B:] for b in row]
            if dst:
                self.pool.copy_blocks(other.pool, [b for s in src for b in s], dst)
        q = self._last_q or other._last_q  # (see last_write_starts)
        mine, theirs = (last_write_starts(c._write_start, c._lengths, c._last_q, q) for c in (self, other))
        self._write_start, self._lengths, self._last_q = mine + theirs, self._lengths + list(other._lengths), q
        self._changed()

    @exclusive
    def reserve(self, tokens: int) -> None:
        """Give every row blocks for ``tokens`` positions past its length now (growing the
        pool if it may). With the pool then frozen, writes there assign nothing on the
        host: what a CUDA graph needs. :class:`PagedKVGrowthRefused` leaves it unchanged."""
        check_int(tokens, "reserve(tokens)", 0)
        self._require_storage("reserve()")
        extra = self.pool.extra_blocks([n + tokens for n in self._lengths])
        if sum(extra):
            self._grow_for(sum(extra), self.pool.key_cache.shape[2], self.codecs, self._device)
            self.pool.assign(extra)
            self._changed()

    def can_reserve(self, tokens: int) -> bool:
        """Whether :meth:`reserve` of ``tokens`` fits the free blocks or the pool may grow."""
        check_int(tokens, "can_reserve(tokens)", 0)
        need = sum(self.pool.extra_blocks([n + tokens for n in self._lengths]))
        return need <= len(self.pool.free) or (self.dynamic and not self.frozen)

    def headroom(self) -> int:
        """Positions every row can still write in the blocks it holds (host books only)."""
        bs = self.block_size
        return min(len(r) * bs - n for r, n in zip(self.pool.rows, self._lengths))

    def freeze(self) -> None:
        """Never grow the pool again: a write that does not fit raises :class:`PagedKVGrowthRefused`."""
        self.pool.frozen = True

    @property
    def frozen(self) -> bool:
        return self.pool.frozen

    def block_table_view(self) -> BlockTableView:
        """Each row's blocks (host) and the block table's columns they use (device, int32)."""
        rows = tuple(tuple(r) for r in self.pool.rows)
        width = max(1, max(map(len, rows), default=0))
        tables = self.pool.block_tables
        if tables is None:  # nothing allocated yet
            tables = torch.zeros(self.batch_size, 0, dtype=torch.int32)
        return BlockTableView(self.block_size, rows, tables[:, :width])

    def graph_blocker(self, device: torch.device) -> str | None:
        """The PyTorch reference read path reads the lengths on the host: a CUDA graph needs
        the Triton kernels (and no fallback from them)."""
        if resolve_backend(self.attention_backend, device) == "triton" and not self.dispatch.fallback_reasons:
            return None
        why = self.dispatch.fallback_reason or f"attention_backend={self.attention_backend!r}"
        return (f"paged attention is served by the PyTorch reference ({why}), whose read path "
                "reads the lengths on the host; use attention_backend='auto' or 'triton'")

    # -- figures -------------------------------------------------------------------------------
    def paged_stats(self) -> dict[str, Any]:
        """Blocks, tokens, waste, bytes and the storage mode actually in use (a plain dict)."""
        c = self.codecs
        per_token = None if c is None else self.pool.key_cache.shape[2] * (
            c.k_codec.bytes_per_token_head() + c.v_codec.bytes_per_token_head())
        return {
            **storage_facts(self),
            "key_codec": None if c is None else c.k_codec.name,
            "value_codec": None if c is None else c.v_codec.name,
            **self.pool.figures(sum(self._lengths)),
            "grow_events": self.copy_stats.grow_events,
            "dynamic": self.dynamic,
            "bytes_per_token": per_token,
            "attention_backend": self.attention_backend,
            "attention_calls_by_backend": dict(self.dispatch.attention_calls),
            "write_calls_by_backend": dict(self.dispatch.write_calls),
            "backend_fallback_reasons": dict(self.dispatch.fallback_reasons),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "batch_size": self.batch_size,
            "offsets": list(self._lengths),
            "nbytes": self.nbytes,
            **self.copy_stats.as_dict(),
            **self.paged_stats(),
        }

    # -- persistence (kvtier.caches.paged_state) ---------------------------------------------
    @property
    def state(self) -> dict[str, torch.Tensor]:
        """Pages, sidecars (``k_sidecar.NAME``/``v_sidecar.NAME``), block tables, free list, lengths."""
        return paged_state(self)

    @property
    def meta_state(self) -> dict[str, Any]:
        """Constructor arguments and the storage in use (JSON-serialisable)."""
        return paged_meta_state(self)

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], meta_state: dict[str, Any]) -> PagedKVCache:
        """Rebuild a cache exactly (pages, sidecars, block tables, free list, lengths)."""
        return paged_from_state(cls, state, meta_state)

    @classmethod
    def from_cache(
        cls,
        other: KVCache,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        dynamic: bool = False,
        context_window_tokens: int | None = None,
        kv_quant: str | None = None,
        turboquant: TurboQuantConfig | None = None,
        attention_backend: str = "auto",
        batch_size: int | None = None,
    ) -> PagedKVCache:
        """A paged cache holding ``other``'s tokens; each row keeps its length and takes only the
        blocks it needs (an empty ``other``: as many empty rows as it has, else ``batch_size``,
        default 1). Keyword names match ``KVCacheConfig.tier_params()``. A paged ``other`` of the
        same block size and storage has its blocks copied as they are (:meth:`extend`: coding them
        again would move fp8 keys and TurboQuant values), in a pool at least as large as they need."""
        off = other.offset
        lengths = off.tolist() if isinstance(off, torch.Tensor) else None
        kw = dict(dynamic=dynamic, context_window_tokens=context_window_tokens, kv_quant=kv_quant,
                  turboquant=turboquant, attention_backend=attention_backend)
        c = other.codecs if isinstance(other, PagedKVCache) and other.block_size == block_size else None
        if c is not None and select_codecs(c.k_codec.head_dim, c.k_codec.dtype, kv_quant, turboquant).mode == c.mode \
                and (c.mode != "turboquant" or other.turboquant == turboquant):
            held = sum(math.ceil(n / block_size) for n in other._lengths)
            cache = cls(block_size, max(num_blocks, held), batch_size=1, **kw)
            cache.extend(other)  # (adopts other's codecs: its key centre, its rotation)
            cache.filter(list(range(1, 1 + other.batch_size)))  # (the empty row it started with)
            return cache
        if other.size() == 0:
            held = [t for t in (getattr(other, "keys", None), *getattr(other, "key_blocks", ())) if t is not None]
            rows = len(lengths) if lengths else held[0].shape[0] if held else batch_size or 1
            return cls(block_size, num_blocks, batch_size=rows, **kw)
        K, V = fetch_taken(other)
        n = other.size()
        K, V = K[:, :, :n], V[:, :, :n]  # (B, H_kv, n, D)
        cache = cls(block_size, num_blocks, batch_size=K.shape[0], **kw)
        cache.update(K, V, new_offsets=lengths)
        return cache
