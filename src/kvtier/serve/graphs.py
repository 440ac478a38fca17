"""Decode steps of the serving engine replayed from CUDA graphs, one per batch-size bucket.

A server's decode batch changes every step (rows join and leave), but a CUDA graph
replays fixed shapes. So the runner captures one graph per bucket of rows (1, 2,
4, ..., 32, 64, 96, ... up to ``max_num_seqs``) at start-up, and a step of ``B`` rows
replays the smallest bucket that holds them, with the rows past ``B`` as padding.

What a replay reads lives in static device buffers, refilled with one host-to-device
copy each per step: the tokens, each row's write position, length after the step and
write slot, and the block table (``W`` columns: the most blocks a request can hold).
Every layer's cache reads them through one :class:`~kvtier.caches.step_plan.StepPlan`.
Padding rows write their key and value into slot 0 of a scratch block the block
manager never hands out, and attend to that one slot; their logits are dropped.

It needs what :mod:`kvtier.cuda_graph` needs: a CUDA device and the Triton paged
kernels (the PyTorch reference reads lengths on the host). Graphs share one memory
pool and one logits buffer per bucket; the logits of a step must be read before the
next (the engine samples them at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtier.caches.paged_shared import RowBinding, SharedBlockPagedKVCache
from kvtier.caches.step_plan import StepPlan
from kvtier.cuda_graph import device_unavailable
from kvtier.kernels.dispatch import resolve_backend
from kvtier.serve.runner import PendingTokens, fill_pending, smallest_bucket
from kvtier.serve.scheduler import ScheduledRow

__all__ = ["DRAFT_GRAPH_ROWS", "DecodeGraphs", "HostInputs", "graph_buckets", "graph_rows", "graphs_unavailable",
           "reference_inputs"]


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: powers of two up to 32, then every multiple of 32 up to
    ``max_num_seqs`` (and it): a step pads at most 31 rows or doubles a small batch.

    >>> graph_buckets(100)
    [1, 2, 4, 8, 16, 32, 64, 96, 100]
    """
    sizes = {b for b in (1, 2, 4, 8, 16) if b <= max_num_seqs} | set(range(32, max_num_seqs + 1, 32))
    return sorted(sizes | {max_num_seqs})


#: most rows decode graphs hold for drafted steps (a row a token; more: the eager packed forward)
DRAFT_GRAPH_ROWS = 256


def graph_rows(max_num_seqs: int, draft: int | None = None) -> int:
    """Rows an engine's decode graphs hold: ``max_num_seqs``; with ``draft`` tokens a step, enough
    for every running request's ``1 + draft`` tokens as decode rows of their own, up to
    :data:`DRAFT_GRAPH_ROWS` (a drafted step of more tokens runs eagerly).

    >>> graph_rows(64), graph_rows(8, 4), graph_rows(100, 4)
    (64, 40, 256)
    """
    return max_num_seqs if not draft else max(max_num_seqs, min(max_num_seqs * (1 + draft), DRAFT_GRAPH_ROWS))


def graphs_unavailable(model, caches: Sequence[SharedBlockPagedKVCache]) -> str | None:
    """Why decode graphs cannot serve this model and these caches (``None``: they can)."""
    device = next(model.parameters()).device
    if (why := device_unavailable(device)) is not None:
        return why
    for c in caches:
        if resolve_backend(c.attention_backend, device) != "triton" or c.dispatch.fallback_reasons:
            why = c.dispatch.fallback_reason or f"attention_backend={c.attention_backend!r}"
            return f"paged attention is served by the PyTorch reference ({why})"
    return None


def reference_inputs(rows: Sequence[ScheduledRow], bucket: int, block_size: int,
                     scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What :class:`HostInputs` builds, from plain Python lists (slow; for tests and benchmarks):
    ``(host [4, bucket] int64, table [bucket, w] int32)``. Rows of ``host``: token ids,
    write starts, new lengths, write slots; padding rows write slot 0 of ``scratch`` and
    see that one key; columns past a row's blocks are 0."""
    pad = bucket - len(rows)
    starts = [r.start for r in rows]
    host = torch.tensor([
        [r.token_ids[0] for r in rows] + [0] * pad,
        starts + [0] * pad,
        [p + 1 for p in starts] + [1] * pad,
        [r.blocks[p // block_size] * block_size + p % block_size for r, p in zip(rows, starts)]
        + [scratch * block_size] * pad,
    ], dtype=torch.long)
    w = max(len(r.blocks) for r in rows)
    table = torch.tensor([list(r.blocks) + [0] * (w - len(r.blocks)) for r in rows]
                         + [[scratch] + [0] * (w - 1)] * pad, dtype=torch.int32)
    return host, table


class HostInputs:
    """The host side of one graph decode step, built without CUDA: per row the token, write
    position, length after the step and write slot ``(4, bucket)`` (int64), and the block
    table ``(bucket, w)`` (int32; ``w``: the most blocks a row holds, 0 past a row's blocks).
    Padding rows past the batch feed token 0 at position 0 into slot 0 of the ``scratch``
    block and see that one key.

    The table is kept between steps, one row per batch position: a decode row's block list
    is mostly the one it had the step before, or that list and one block more, so only rows
    whose list changed are written. :meth:`fill` returns views of buffers it reuses (pinned
    with ``pin``): copy them before the next call.

    >>> from kvtier.serve.scheduler import ScheduledRow
    >>> h = HostInputs(4, 8, block_size=16, scratch=99)
    >>> host, table = h.fill([ScheduledRow("a", (7,), 17, (3, 5), True)], bucket=2)
    >>> host.tolist()
    [[7, 0], [17, 0], [18, 1], [81, 1584]]
    >>> table.tolist()
    [[3, 5], [99, 0]]
    """

    def __init__(self, max_rows: int, width: int, *, block_size: int, scratch: int, pin: bool = False):
        self.max_rows, self.width, self.block_size, self.scratch = max_rows, width, block_size, scratch
        self._table = np.zeros((max_rows, width), dtype=np.int32)
        self._placed: list[tuple[int, ...]] = [()] * max_rows  # the block list each row of _table holds
        self._inputs = torch.empty(4 * max_rows, dtype=torch.long, pin_memory=pin)
        self._staged = torch.empty(max_rows * width, dtype=torch.int32, pin_memory=pin)

    def fill(self, rows: Sequence[ScheduledRow], bucket: int,
             tokens: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs ``(4, bucket)`` and block table ``(bucket, w)`` of the decode ``rows`` (one
        token each) padded to ``bucket`` rows; ``tokens``: the rows' token ids, when not
        their own (tokens still on the device, coded as :meth:`PendingTokens.codes` does)."""
        B, bs = len(rows), self.block_size
        assert 0 < B <= bucket <= self.max_rows
        tab, placed, pad, w = self._table, self._placed, (self.scratch,), 1
        for i in range(bucket):
            blocks = rows[i].blocks if i < B else pad
            n = len(blocks)
            w = max(w, n)
            old = placed[i]
            if blocks == old:
                continue
            assert n <= self.width, f"a row of {n} blocks exceeds the table's {self.width} columns"
            k = len(old)
            if n > k and blocks[:k] == old:  # the list grew: write the new blocks only
                tab[i, k:n] = blocks[k:]
            else:
                tab[i, :n] = blocks
                tab[i, n:k] = 0
            placed[i] = blocks
        host = self._inputs[: 4 * bucket].view(4, bucket)
        h = host.numpy()
        starts = np.fromiter((r.start for r in rows), dtype=np.int64, count=B)
        h[0, :B] = tokens if tokens is not None else [r.token_ids[0] for r in rows]
        h[1, :B] = starts
        h[2, :B] = starts + 1
        h[3, :B] = tab[np.arange(B), starts // bs].astype(np.int64) * bs + starts % bs
        h[:2, B:], h[2, B:], h[3, B:] = 0, 1, self.scratch * bs
        table = self._staged[: bucket * w].view(bucket, w)
        table.numpy()[:] = tab[:bucket, :w]
        return host, table


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``caches`` (see the module docstring).

    ``width``: block-table columns (blocks one request may hold); ``scratch``: the
    physical block padding rows write to (outside the block manager's ids).
    """

    def __init__(self, model, caches: Sequence[SharedBlockPagedKVCache], max_num_seqs: int,
                 width: int, *, scratch: int):
        self.model, self.caches = model, list(caches)
        self.device = next(model.parameters()).device
        self.block_size, self.width, self.scratch = caches[0].block_size, width, scratch
        self.num_blocks = caches[0].pool.num_blocks
        self.buckets = graph_buckets(max_num_seqs)
        n = self.buckets[-1]
        with torch.inference_mode():
            self.inputs = torch.zeros(4, n, dtype=torch.long, device=self.device)  # tokens, ws, no, slots
            self.tables = torch.zeros(n, width, dtype=torch.int32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.host = HostInputs(n, width, block_size=self.block_size, scratch=scratch, pin=True)
        self._copied: torch.cuda.Event | None = None  # recorded after a step's host-to-device copies
        self._capture_all()

    def fits(self, rows: Sequence[ScheduledRow]) -> bool:
        """Whether a captured graph can run these decode rows."""
        return len(rows) <= self.buckets[-1] and all(len(r.blocks) <= self.width for r in rows)

    def host_inputs(self, rows: Sequence[ScheduledRow], bucket: int,
                    tokens: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's inputs ``(4, bucket)`` and block table ``(bucket, w)`` on the host
        (see :meth:`HostInputs.fill`); waits for the previous step's copies first."""
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are about to be rewritten
        return self.host.fill(rows, bucket, tokens)

    def run(self, rows: Sequence[ScheduledRow], codes: Sequence[int] | None = None,
            pending: PendingTokens | None = None) -> torch.Tensor:
        """Logits ``[B, V]`` (float32, a view of the graph's buffer) of one decode step of ``rows``.

        ``codes``/``pending``: the rows' token ids with tokens still on the device coded as
        :meth:`~kvtier.serve.runner.PendingTokens.codes` does, and those tokens."""
        B = len(rows)
        bucket = smallest_bucket(self.buckets, B)  # fits(): B is at most the largest
        host, table = self.host_inputs(rows, bucket, codes)
        w = table.shape[1]
        with torch.inference_mode():
            self.inputs[:, :bucket].copy_(host, non_blocking=True)
            # columns past w keep earlier (valid) ids: the kernels never read them unmasked
            self.tables[:bucket, :w].copy_(table, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.inputs.device))
            fill_pending(self.inputs[0, :B], pending)
            self.graphs[bucket].replay()
        return self.logits[bucket][:B]

    # -- capture -----------------------------------------------------------------------------
    def _plan(self, bucket: int) -> StepPlan:
        ws, no = self.inputs[1, :bucket], self.inputs[2, :bucket]
        return StepPlan(write_start=ws, new_offsets=no, starts=[0] * bucket, ends=[1] * bucket, bound=1,
                        slots=self.inputs[3, :bucket], block_tables=self.tables[:bucket])

    def _forward(self, bucket: int, plan: StepPlan) -> torch.Tensor:
        tokens = self.inputs[0, :bucket, None]  # (B, 1)
        out = self.model(tokens, self.caches, positions=plan.write_start[:, None],
                         cache_kwargs={"plan": plan, "write_start": plan.write_start}, last_only=True)
        return out[:, -1]  # (B, V)

    def _capture_all(self) -> None:
        """Warm each bucket up eagerly on a side stream, then capture it; largest first, so the
        smaller graphs reuse the shared pool."""
        bs = self.block_size
        stream = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                self.inputs[1:3, :bucket] = torch.tensor([[0], [1]], device=self.device)
                self.inputs[3, :bucket] = self.scratch * bs
                self.tables[:bucket] = 0
                self.tables[:bucket, 0] = self.scratch
                binding = RowBinding.build([[self.scratch]] * bucket, [0] * bucket, block_size=bs,
                                           num_blocks=self.num_blocks, device=self.device)
                for c in self.caches:  # the batch size and block books the plan is checked against
                    c.bind(binding)
                plan = self._plan(bucket)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._forward(bucket, plan)  # compiles the kernels, sets the libraries up
                torch.cuda.current_stream(self.device).wait_stream(stream)
                for c in self.caches:
                    c.bind(binding)
                plan = self._plan(bucket)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.logits[bucket] = self._forward(bucket, plan)
                self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
