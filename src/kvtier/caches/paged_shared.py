"""A paged cache whose blocks belong to an outside block manager (the serving engine's).

:class:`~kvtier.caches.paged.PagedKVCache` hands out blocks from its own free
list, one row per sequence, for as long as the cache lives. A server's rows change
every step (requests join, leave, are preempted), several requests may share the
blocks of a common prefix, and one set of books must serve every layer. So
:class:`SharedBlockPagedKVCache` keeps the paged tier's storage and read path but
not its books:

- :meth:`SharedBlockPagedKVCache.allocate` allocates the whole pool up front, with
  the codecs the paged tier would choose (quantised modes and their fallback);
- :meth:`SharedBlockPagedKVCache.bind` points the cache's rows at physical blocks
  owned elsewhere (:class:`kvtier.serve.prefix.BlockManager`) and at their lengths,
  through a :class:`RowBinding` built once per step and shared by every layer
  (one validation, one block table on the device);
- a write that needs a block its row does not hold raises
  :class:`~kvtier.caches.paged_pool.PagedKVGrowthRefused`; the cache's own free list
  is empty and its pool frozen, so nothing is ever allocated behind the manager's back.

Decode steps (one token per row) can go through a
:class:`~kvtier.caches.step_plan.StepPlan` from :func:`decode_plan`: slots,
positions, lengths and the table computed once for every layer; one row's prompt
chunk through :func:`chunk_plan`. Prompt chunks of several rows run as one
forward ``[1, N]`` with the rows' tokens side by side (:func:`packed_plan`): every
projection multiplies all ``N`` tokens at once, and attention puts each row's
queries back in a row of their own (padded to the longest chunk) for the paged
kernels.

Example::

    >>> import torch
    >>> cache = SharedBlockPagedKVCache(block_size=4, num_blocks=8)
    >>> cache.allocate(kv_heads=2, head_dim=64, dtype=torch.float32, device="cpu")
    >>> rows = RowBinding.build([[5, 2], [2]], [0, 0], block_size=4, num_blocks=8)
    >>> cache.bind(rows)                                   # row 1 would share block 2 with row 0
    >>> k = v = torch.randn(2, 2, 3, 64)                    # (B, H_kv, T, D)
    >>> cache.update(k, v, new_offsets=[3, 0])              # row 1 commits nothing
    >>> cache.offset.tolist()
    [3, 0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.caches.base import check_kv, check_queries, check_window
from kvtier.caches.paged import PagedKVCache
from kvtier.caches.paged_pool import PagedKVGrowthRefused, RowsArg, rows_arg
from kvtier.caches.step_plan import StepPlan
from kvtier.kernels.paged import paged_attention_packed
from kvtier.quant.modes import TurboQuantConfig

__all__ = ["PackedPlan", "RowBinding", "SharedBlockPagedKVCache", "chunk_plan", "decode_plan", "decode_starts",
           "packed_plan"]


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``; to a GPU through pinned memory without waiting (a copy from
    pageable memory would wait for the stream, so the host could not run ahead)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, eq=False)
class RowBinding:
    """Rows of one step: physical blocks and committed lengths, checked once for every layer.

    ``blocks[r]``: row ``r``'s block ids in logical order (rows may share blocks);
    ``lengths[r]``: tokens the row holds, at most ``len(blocks[r]) * block_size``;
    ``table``: int32 ``[B, W]`` on the pages' device, ``W`` the most blocks a row
    holds (at least 1), rows zero-padded.
    """

    blocks: list[list[int]]
    lengths: list[int]
    table: torch.Tensor
    block_size: int
    num_blocks: int

    @classmethod
    def build(cls, blocks: Sequence[Sequence[int]], lengths: Sequence[int], *, block_size: int,
              num_blocks: int, device: torch.device | str = "cpu") -> RowBinding:
        """Validate ``blocks``/``lengths`` against a pool of ``num_blocks`` x ``block_size``
        and build the block table on ``device``; ``ValueError`` names the bad row."""
        if not blocks or len(blocks) != len(lengths):
            raise ValueError(f"bind needs one block list per length and at least one row, got "
                             f"{len(blocks)} block lists and {len(lengths)} lengths")
        rows = [list(b) for b in blocks]
        lens = [int(n) for n in lengths]
        for r, (row, n) in enumerate(zip(rows, lens)):
            if not 0 <= n <= len(row) * block_size:
                raise ValueError(f"row {r} holds {len(row)} blocks of {block_size} tokens but claims "
                                 f"{n} tokens; give it the blocks first")
            bad = [b for b in row if isinstance(b, bool) or not isinstance(b, int)
                   or not 0 <= b < num_blocks]
            if bad:
                raise ValueError(f"row {r}: block ids {bad[:4]} are not in [0, {num_blocks})")
        width = max(1, max(len(r) for r in rows))
        padded = [row + [0] * (width - len(row)) for row in rows]
        table = to_device(torch.tensor(padded, dtype=torch.int32), device)  # (B, W): one copy to the device
        return cls(rows, lens, table, block_size, num_blocks)


def decode_starts(rows: RowBinding) -> list[int]:
    """Where each row of a decode step writes its token, ``lengths[r]``; ``ValueError`` naming the
    rows whose blocks do not hold that position."""
    bs, starts = rows.block_size, list(rows.lengths)
    short = [r for r, (n, b) in enumerate(zip(starts, rows.blocks)) if n >= len(b) * bs]
    if short:
        raise ValueError(f"rows {short} hold no block for position {[starts[r] for r in short]}; "
                         "grow their block lists before the step")
    return starts


def decode_plan(rows: RowBinding) -> StepPlan:
    """The :class:`StepPlan` of one decode step over ``rows``: row ``r`` writes one token at
    position ``lengths[r]`` (which its blocks must hold) and sees ``lengths[r] + 1`` keys."""
    bs, dev = rows.block_size, rows.table.device
    starts = decode_starts(rows)
    slots = [b[n // bs] * bs + n % bs for n, b in zip(starts, rows.blocks)]
    host = to_device(torch.tensor([starts, slots], dtype=torch.long), dev)  # one copy to the device
    ends = [n + 1 for n in starts]
    return StepPlan(write_start=host[0], new_offsets=host[0] + 1, starts=starts, ends=ends,
                    bound=max(ends), slots=host[1], block_tables=rows.table)


def chunk_plan(rows: RowBinding, tokens: int) -> StepPlan:
    """The :class:`StepPlan` of a prompt chunk: every row writes ``tokens`` tokens from
    position ``lengths[r]`` (which its blocks must hold), computed once for every layer
    with one copy to the device (per-layer slot lists would each cost a host sync)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    bs, dev = rows.block_size, rows.table.device
    starts = list(rows.lengths)
    ends = [n + tokens for n in starts]
    short = [r for r, (n, b) in enumerate(zip(ends, rows.blocks)) if n > len(b) * bs]
    if short:
        raise ValueError(f"rows {short} hold too few blocks for {tokens} more tokens; grow their "
                         "block lists before the step")
    slots = [b[p // bs] * bs + p % bs for n, b in zip(starts, rows.blocks) for p in range(n, n + tokens)]
    host = to_device(torch.tensor([*starts, *ends, *slots], dtype=torch.long), dev)  # one copy to the device
    B = len(starts)
    return StepPlan(write_start=host[:B], new_offsets=host[B:2 * B], starts=starts, ends=ends,
                    bound=max(ends), slots=host[2 * B:], block_tables=rows.table, tokens=tokens)


@dataclass(frozen=True, eq=False)
class PackedPlan:
    """Prompt chunks of ``B`` rows packed into one forward of ``N`` tokens, shared by every layer.

    Host: ``starts``/``ends`` (each row's length before and after), ``width`` (the
    longest chunk). Device (int64): ``write_start``/``new_offsets`` ``[B]``,
    ``slots`` ``[N]`` (where each packed token is stored), ``q_offsets`` ``[B]``
    (each row's first packed token), ``positions`` ``[1, N]`` (for RoPE) and ``last``
    ``[B]`` (each row's last packed token); ``block_tables`` int32 ``[B, W]``. ``singles``:
    how many rows lead the step with one token each (decode rows), which attention reads
    as a decode step.
    """

    starts: list[int]
    ends: list[int]
    width: int
    write_start: torch.Tensor
    new_offsets: torch.Tensor
    slots: torch.Tensor
    q_offsets: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor
    block_tables: torch.Tensor
    singles: int = 0

    @property
    def total(self) -> int:
        """``N``, the packed tokens."""
        return sum(e - s for s, e in zip(self.starts, self.ends))


def packed_plan(rows: RowBinding, counts: Sequence[int]) -> PackedPlan:
    """The :class:`PackedPlan` of row ``r`` writing ``counts[r]`` (>= 1) tokens from position
    ``lengths[r]`` (which its blocks must hold); one copy to the device."""
    B = len(rows.lengths)
    if len(counts) != B or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"counts must be {B} ints >= 1 (one per row), got {list(counts)}")
    bs, starts = rows.block_size, list(rows.lengths)
    ends = [n + c for n, c in zip(starts, counts)]
    short = [r for r, (n, b) in enumerate(zip(ends, rows.blocks)) if n > len(b) * bs]
    if short:
        raise ValueError(f"rows {short} hold too few blocks for their chunks; grow their block "
                         "lists before the step")
    positions = [p for n, e in zip(starts, ends) for p in range(n, e)]
    slots = [b[p // bs] * bs + p % bs for n, e, b in zip(starts, ends, rows.blocks) for p in range(n, e)]
    firsts, last, at = [], [], 0
    for c in counts:
        firsts.append(at)
        at += c
        last.append(at - 1)
    N = len(slots)
    host = to_device(torch.tensor([*starts, *ends, *last, *firsts, *slots, *positions],
                                  dtype=torch.long), rows.table.device)  # one copy to the device
    ws, no, la, fi, sl, po = host.split([B, B, B, B, N, N])
    singles = next((r for r, c in enumerate(counts) if c != 1), B)
    return PackedPlan(starts, ends, max(counts), ws, no, sl, fi, po[None], la, rows.table, singles)


class SharedBlockPagedKVCache(PagedKVCache):
    """A :class:`PagedKVCache` over a pool allocated up front whose blocks an outside manager owns.

    Same storage, codecs, write and read paths as the paged tier; rows come from
    :meth:`bind` (or :meth:`bind_rows`) before each forward. ``release``,
    ``filter``, ``extend`` and ``reserve`` would hand blocks out or take them back
    and raise instead.
    """

    def __init__(
        self,
        block_size: int = 16,
        num_blocks: int = 1024,
        *,
        kv_quant: str | None = None,
        turboquant: TurboQuantConfig | None = None,
        attention_backend: str = "auto",
    ):
        super().__init__(block_size, num_blocks, batch_size=1, kv_quant=kv_quant,
                         turboquant=turboquant, attention_backend=attention_backend)
        self._packed: PackedPlan | None = None  # the last write's, while attention reads packed

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        """Allocate all ``num_blocks`` pages now, choosing the codecs for ``head_dim``/``dtype``
        as the paged tier does (TurboQuant, else ``kv_quant``, else full precision; a mode
        that cannot serve falls back with a warning)."""
        if self.pool.allocated:
            raise ValueError("the pool is already allocated; allocate() once per cache")
        for name, v in (("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        zeros = torch.zeros(1, kv_heads, 1, head_dim, dtype=dtype, device=device)  # (1, H_kv, 1, D)
        super().update(zeros, zeros, new_offsets=0)  # commits nothing: allocates, adopts the codecs
        self.pool.free = []  # every block belongs to the outside manager
        self.freeze()

    # -- rows --------------------------------------------------------------------------------
    def bind(self, rows: RowBinding) -> None:
        """Point this cache's rows at ``rows`` (blocks, lengths, table); drops any step plan."""
        if not self.pool.allocated:
            raise ValueError("bind() before allocate(); allocate the pool first")
        if (rows.block_size, rows.num_blocks) != (self.block_size, self.pool.num_blocks):
            raise ValueError(f"rows built for {rows.num_blocks} blocks of {rows.block_size} tokens, "
                             f"this pool has {self.pool.num_blocks} of {self.block_size}")
        if rows.table.device != self._device:
            raise ValueError(f"the block table is on {rows.table.device}, the pages on {self._device}; "
                             "build the RowBinding with device= the pages' device")
        self.pool.rows = rows.blocks
        self.pool.block_tables = rows.table
        self._lengths, self._write_start = list(rows.lengths), list(rows.lengths)
        self._changed()
        self._packed = None

    def bind_rows(self, blocks: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
        """Point row ``r`` at physical ``blocks[r]`` holding ``lengths[r]`` tokens (one layer;
        an engine builds one :class:`RowBinding` and :meth:`bind` s every layer to it)."""
        self.bind(RowBinding.build(blocks, lengths, block_size=self.block_size,
                                   num_blocks=self.pool.num_blocks, device=self._device))

    # -- writes ------------------------------------------------------------------------------
    def update(self, keys: torch.Tensor, values: torch.Tensor, *, write_start: RowsArg = None,
               new_offsets: RowsArg = None, plan: StepPlan | PackedPlan | None = None) -> None:
        """:meth:`PagedKVCache.update`, but a write past the blocks a row holds raises
        :class:`PagedKVGrowthRefused` (nothing written) instead of taking a block.

        With a :class:`PackedPlan`, ``keys``/``values`` are ``[1, H_kv, N, D]``: the
        rows' chunks side by side, stored at the plan's slots; the next
        :meth:`attention` reads packed queries the same way."""
        if isinstance(plan, PackedPlan):
            self._update_packed(keys, values, plan, write_start, new_offsets)
            return
        self._packed = None
        check_kv(keys, values, batch=self.batch_size)
        if plan is not None:
            ends = plan.ends
        else:
            T = keys.shape[2]
            ws = rows_arg(self.batch_size, "write_start", write_start, self._lengths)
            ends = rows_arg(self.batch_size, "new_offsets", new_offsets, [w + T for w in ws])
        bs = self.block_size
        short = [r for r, (n, row) in enumerate(zip(ends, self.pool.rows)) if n > len(row) * bs]
        if short:
            raise PagedKVGrowthRefused(
                f"rows {short} would hold {[ends[r] for r in short]} tokens but own only "
                f"{[len(self.pool.rows[r]) for r in short]} blocks of {bs}; the block manager gives "
                "rows their blocks (bind the rows again with more blocks)")
        super().update(keys, values, write_start=write_start, new_offsets=new_offsets, plan=plan)

    def _update_packed(self, keys, values, plan: PackedPlan, write_start, new_offsets) -> None:
        if write_start is not None or new_offsets is not None:
            raise ValueError("with a PackedPlan pass no write_start or new_offsets: the plan has them")
        keys, values = check_kv(keys, values, batch=1)  # detached
        H, D = self.pool.key_cache.shape[2], self.codecs.k_codec.head_dim
        for what, got, want in (("kv_heads", keys.shape[1], H), ("head_dim", keys.shape[3], D),
                                ("dtype", keys.dtype, self.codecs.k_codec.dtype),
                                ("device", keys.device, self._device)):
            if got != want:
                raise ValueError(f"{what} {got} differs from the cache's {want}; convert the input")
        if keys.shape[2] != plan.total or len(plan.starts) != self.batch_size or plan.starts != self._lengths:
            raise ValueError(f"this packed plan writes {plan.total} tokens from lengths {plan.starts}; got "
                             f"keys {tuple(keys.shape)} for rows of lengths {self._lengths} (bind the "
                             "plan's rows first)")
        self._write(keys, values, plan.slots)
        self._lengths, self._write_start = list(plan.ends), list(plan.starts)
        self._changed()
        self._packed = plan

    def attention(self, queries: torch.Tensor, *, scale: float | None = None,
                  q_start: RowsArg = None, window: int | None = None) -> torch.Tensor:
        """:meth:`PagedKVCache.attention`; after a packed write, ``queries`` ``[1, H_q, N, D]``
        are the rows' chunks side by side and so is the result."""
        p = self._packed
        if p is None or q_start is not None:
            return super().attention(queries, scale=scale, q_start=q_start, window=window)
        codecs = self.codecs
        scale = check_queries(queries, self.pool.key_cache.shape[2], codecs.k_codec.head_dim,
                              codecs.k_codec.dtype, scale)
        window = check_window(window) and check_window(window, max(self._lengths))  # (all inside it: none)
        if queries.shape[0] != 1 or queries.shape[2] != p.total:
            raise ValueError(f"after a packed write, queries must be [1, H_q, {p.total}, D], got "
                             f"{tuple(queries.shape)}")
        pool = self.pool
        return paged_attention_packed(
            self.dispatch, queries, pool.key_cache, pool.value_cache, p.block_tables, p.write_start,
            p.new_offsets, q_offsets=p.q_offsets, max_q_len=p.width, single_rows=p.singles, k_codec=codecs.k_codec,
            v_codec=codecs.v_codec, k_sidecars=pool.k_sidecars, v_sidecars=pool.v_sidecars, scale=scale,
            window=window,
        )  # (1, H_q, N, D)

    def _owned_elsewhere(self, what: str):
        raise ValueError(f"{what}() on a SharedBlockPagedKVCache: its blocks belong to the block "
                         "manager; change the rows with bind()")

    def release(self, rows: RowsArg) -> None:
        self._owned_elsewhere("release")

    def filter(self, indices: RowsArg) -> None:
        self._owned_elsewhere("filter")

    def extend(self, other: PagedKVCache) -> None:
        self._owned_elsewhere("extend")

    def reserve(self, tokens: int) -> None:
        self._owned_elsewhere("reserve")
