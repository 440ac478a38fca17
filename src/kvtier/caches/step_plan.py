"""One plan per decode step for every layer: positions, lengths and page slots, computed once.

A decode step of an L-layer model writes one token per row into each of its L
per-layer caches. Left alone, every layer works the same things out again: each
row's write position and new length, and for the paged tier the slot of that
position in the row's block table (host lists, device copies, block assignment).
With a plan, the engine computes them once per step and every layer reads them:

- :class:`StepPlan` holds the step's device tensors (``write_start``,
  ``new_offsets``, ``index`` ``[B, 1]``, paged ``slots`` ``[B]`` and the one
  ``block_tables`` of every layer) and the host lists every layer's books point at.
- :class:`StepPlanner` keeps a plan for a list of ragged or paged caches.
  :meth:`StepPlanner.prepare` books one step on the host and returns the
  ``cache_kwargs`` of ``model(tokens, caches, cache_kwargs=...)``;
  :meth:`StepPlanner.device_step` moves the device tensors on by one token with
  no host read, so a CUDA graph can capture it (:mod:`kvtier.cuda_graph`).

The planner talks to the caches only through the per-row protocol
(:class:`~kvtier.caches.base.RowKVCache`: ``lengths``, ``headroom``, ``reserve``,
``can_reserve``, ``storage_device``, ``block_table_view``). The layers of one model
receive identical writes, so the block tables of a pooled tier are identical: the
planner checks that once, reserves blocks for all layers together (every
``reserve_tokens`` tokens), and computes the slots from one table. A cache that is
changed outside the plan (trim, restore, filter, ...) drops out of it, and the
planner's next step raises instead of writing at stale positions.

Example::

    >>> import torch
    >>> from kvtier.caches.paged import PagedKVCache
    >>> caches = [PagedKVCache(block_size=4, num_blocks=16, batch_size=2) for _ in range(3)]
    >>> for c in caches:
    ...     c.update(torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8), new_offsets=[5, 3])
    >>> planner = StepPlanner(caches, [5, 3])
    >>> kw = planner.prepare()                  # positions [5, 3], slots from one table
    >>> for c in caches:                        # what each layer of a forward does
    ...     c.update(torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8), **kw)
    >>> caches[2].offset.tolist()
    [6, 4]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.caches.base import BlockTableView, KVCache, RowKVCache


@dataclass(eq=False)
class StepPlan:
    """What one decode step writes, shared by every layer (``tokens`` per row, one by default).

    Device tensors (int64 unless said): ``write_start`` ``[B]`` (each row's
    position this step), ``new_offsets`` ``[B]`` (its length after it), ``index``
    ``[B, 1]`` (a view of ``write_start``), paged ``slots`` ``[B]`` and
    ``block_tables`` int32 ``[B, n]`` (the table every layer reads: the first ``n``
    columns of layer 0's, ``n`` the most blocks a row holds). A plan of ``tokens`` > 1
    (a prompt chunk) has ``slots`` ``[B * tokens]``, row by row.
    Host: ``starts``/``ends``, the same values as lists (every paged layer's books
    point at these two lists), ``bound`` (an upper bound on ``ends`` while the plan
    holds) and ``memo`` (device copies of the lists, shared). ``valid`` turns False
    when a cache is changed outside the plan.
    """

    write_start: torch.Tensor
    new_offsets: torch.Tensor
    starts: list[int]
    ends: list[int]
    bound: int
    slots: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    memo: dict[str, torch.Tensor] = field(default_factory=dict)
    valid: bool = True
    tokens: int = 1

    @property
    def index(self) -> torch.Tensor:
        return self.write_start[:, None]  # (B, 1)

    def check_step(self, keys: torch.Tensor, write_start: Any, new_offsets: Any) -> None:
        """A layer's check of its planned write: ``ValueError`` if it does not follow the plan."""
        if not self.valid:
            raise ValueError("this step plan no longer holds (a cache was changed outside it); "
                             "build a new StepPlanner")
        if keys.shape[0] != len(self.ends) or keys.shape[2] != self.tokens:
            raise ValueError(f"a step plan writes {self.tokens} token(s) for each of {len(self.ends)} rows, got "
                             f"keys {tuple(keys.shape)}; write other shapes without plan=")
        for name, got, own in (("write_start", write_start, self.write_start),
                               ("new_offsets", new_offsets, self.new_offsets)):
            if got is not None and got is not own:
                raise ValueError(f"with plan= pass no {name} or the plan's own tensor (plan.{name})")


class StepPlanner:
    """Plans decode steps for per-layer caches of a per-row tier that hold the same rows.

    ``caches``: one :class:`~kvtier.caches.base.RowKVCache` per layer, all of one tier
    and batch; ``lengths``: each row's length now (``B`` ints; default: the first
    cache's ``lengths``). Every layer must hold exactly those lengths and, for a tier
    with block tables (paged), the same tables (checked here, once).
    ``reserve_tokens``: how far ahead capacity is reserved when a step needs more.

    Per step: ``kw = planner.prepare()``, then ``model(tokens, caches,
    cache_kwargs=kw)``. While the caches hold nothing (the first step of an empty
    prompt) ``prepare`` returns plain ``write_start``/``new_offsets`` (CPU tensors)
    instead of a plan, and each layer books that write itself.
    """

    def __init__(self, caches: Sequence[KVCache], lengths: Sequence[int] | None = None, *,
                 reserve_tokens: int = 256):
        if not caches:
            raise ValueError("StepPlanner needs one cache per layer, got none")
        kinds = {type(c) for c in caches}
        if len(kinds) != 1 or not issubclass(kinds.pop(), RowKVCache):
            names = sorted({type(c).__name__ for c in caches})
            raise ValueError(f"step plans serve per-layer caches of one per-row tier (RowKVCache), got "
                             f"{names}; build the caches with tier='ragged' or 'paged'")
        if isinstance(reserve_tokens, bool) or not isinstance(reserve_tokens, int) or reserve_tokens < 1:
            raise ValueError(f"reserve_tokens must be an int >= 1, got {reserve_tokens!r}")
        self.caches: list[RowKVCache] = list(caches)
        self.reserve_tokens = reserve_tokens
        self.batch_size = caches[0].batch_size
        if self.batch_size is None:
            raise ValueError("the caches do not know their batch size yet; build them with batch_size")
        lengths = caches[0].lengths if lengths is None else [int(n) for n in lengths]
        if len(lengths) != self.batch_size or min(lengths) < 0:
            raise ValueError(f"lengths must be {self.batch_size} ints >= 0 (one per row), got {lengths}")
        view = caches[0].block_table_view()
        #: tokens per block of a tier with block tables (the slots come from them), else None
        self.block_size = None if view is None else view.block_size
        self._check_caches(lengths, view)
        self.plan: StepPlan | None = None
        self._lengths = lengths
        self._headroom = 0  # steps that fit before capacity must be reserved (host)

    def _check_caches(self, lengths: list[int], first: BlockTableView | None) -> None:
        for i, c in enumerate(self.caches):
            if c.batch_size != self.batch_size or c.lengths != lengths:
                raise ValueError(f"layer {i} holds rows of lengths {c.lengths}, not {lengths}; "
                                 "every layer must hold the same rows")
        if first is not None:
            for i, c in enumerate(self.caches):
                view = c.block_table_view()
                if (view.block_size, view.rows) != (first.block_size, first.rows):
                    raise ValueError(f"layer {i}'s block tables differ from layer 0's; a plan reads one "
                                     "table for all layers: build the caches alike and write them alike")

    # -- facts ------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether the caches hold storage, so that a step can be planned."""
        return all(not c.empty() for c in self.caches)

    @property
    def lengths(self) -> list[int]:
        """Each row's length after the steps booked so far (a copy)."""
        return list(self._lengths)

    def headroom(self) -> int:
        """Steps every layer can take before capacity must be reserved (reads host books only)."""
        if not self.ready:
            return 0
        return min(c.headroom() for c in self.caches)

    # -- steps --------------------------------------------------------------------------------
    def prepare(self, *, device: bool = True) -> dict[str, Any]:
        """Book one step on the host; returns the ``cache_kwargs`` of the step's forward.

        Reserves capacity on every layer when the step needs it (``reserve_tokens``
        ahead; a frozen cache that cannot give it raises its
        :class:`~kvtier.caches.base.CacheCapacityError`, and nothing is booked).
        With ``device`` (the default) it also runs :meth:`device_step`; a CUDA
        graph that captured that passes ``device=False``.
        """
        if not self.ready:  # nothing to plan from yet: the layers book this write themselves
            starts, self._lengths = self._lengths, [n + 1 for n in self._lengths]
            return {"write_start": torch.tensor(starts), "new_offsets": torch.tensor(self._lengths)}
        if self.plan is not None and not self.plan.valid:
            raise ValueError("a cache was changed outside this StepPlanner (trim, restore, filter, "
                             "a write without plan=); build a new planner")
        if self.plan is None or self._headroom < 1:
            self._reserve()
        plan = self.plan
        plan.starts[:] = plan.ends  # in place: every paged layer's books point at these lists
        plan.ends[:] = [n + 1 for n in plan.ends]
        plan.memo.clear()
        plan.bound = max(plan.ends)
        self._lengths = list(plan.ends)
        self._headroom -= 1
        if device:
            self.device_step()
        return {"write_start": plan.write_start, "plan": plan}

    def _reserve(self) -> None:
        """Room for the next steps on every layer (if none is left), then the plan over it."""
        room = self.headroom()
        if room < 1:
            # ahead when every layer can take it; else what this step needs
            fits = all(c.can_reserve(self.reserve_tokens) for c in self.caches)
            n = self.reserve_tokens if fits else 1
            for c in self.caches:  # a refusal comes from the first layer, before any changed
                c.reserve(n)
            room = self.headroom()
        assert room >= 1, f"reserve() left no room (headroom {room})"
        self._headroom = room
        self._bind()

    def _bind(self) -> None:
        """(Re)build the plan on the current storage; its device tensors start at the lengths.

        A plan that exists keeps its tensors and lists (the caches' books point at them).
        """
        first = self.caches[0]
        dev = first.storage_device
        with torch.inference_mode(False):  # plain tensors: updated in place inside and outside it
            ends = torch.tensor(self._lengths, dtype=torch.long).to(dev)
            if self.plan is None:
                self.plan = StepPlan(ends - 1, ends, list(self._lengths), list(self._lengths), 0)
            else:
                self.plan.new_offsets.copy_(ends)
                self.plan.starts[:], self.plan.ends[:] = self._lengths, self._lengths
                self.plan.memo.clear()
                self.plan.valid = True
            view = first.block_table_view()
            if view is not None:  # the columns rows hold: kernels plan their split on its width
                self.plan.block_tables = view.tables
                if self.plan.slots is None:
                    self.plan.slots = torch.zeros_like(ends)

    def device_step(self) -> None:
        """Move the device tensors on by one token: ``write_start = new_offsets``,
        ``new_offsets += 1``, and the paged slots from the shared block table.

        Device work only (no host read, no sync): a CUDA graph captures it.
        """
        plan = self.plan
        plan.write_start.copy_(plan.new_offsets)
        plan.new_offsets.add_(1)
        if plan.slots is not None:
            bs = self.block_size
            ws = plan.write_start
            blk = plan.block_tables.gather(1, (ws // bs)[:, None])[:, 0]  # (B,) int32
            torch.add(blk.long() * bs, ws % bs, out=plan.slots)

    def close(self) -> None:
        """End the plan: later planned writes raise; the caches keep what was written."""
        if self.plan is not None:
            self.plan.valid = False
        self.plan = None
