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

import torch

from kvtier.caches.paged_shared import RowBinding, SharedBlockPagedKVCache
from kvtier.caches.step_plan import StepPlan
from kvtier.kernels.dispatch import resolve_backend
from kvtier.serve.scheduler import ScheduledRow

__all__ = ["DecodeGraphs", "graph_buckets", "graphs_unavailable"]


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: powers of two up to 32, then every multiple of 32 up to
    ``max_num_seqs`` (and it): a step pads at most 31 rows or doubles a small batch.

    >>> graph_buckets(100)
    [1, 2, 4, 8, 16, 32, 64, 96, 100]
    """
    sizes = {b for b in (1, 2, 4, 8, 16) if b <= max_num_seqs} | set(range(32, max_num_seqs + 1, 32))
    return sorted(sizes | {max_num_seqs})


def graphs_unavailable(model, caches: Sequence[SharedBlockPagedKVCache]) -> str | None:
    """Why decode graphs cannot serve this model and these caches (``None``: they can)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"the model is on {device}; CUDA graphs need a CUDA device"
    for c in caches:
        if resolve_backend(c.attention_backend, device) != "triton" or c.dispatch.fallback_reasons:
            why = c.dispatch.fallback_reason or f"attention_backend={c.attention_backend!r}"
            return f"paged attention is served by the PyTorch reference ({why})"
    return None


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
        self._capture_all()

    def fits(self, rows: Sequence[ScheduledRow]) -> bool:
        """Whether a captured graph can run these decode rows."""
        return len(rows) <= self.buckets[-1] and all(len(r.blocks) <= self.width for r in rows)

    def run(self, rows: Sequence[ScheduledRow]) -> torch.Tensor:
        """Logits ``[B, V]`` (float32, a view of the graph's buffer) of one decode step of ``rows``."""
        B = len(rows)
        bucket = next(b for b in self.buckets if b >= B)
        bs, pad = self.block_size, bucket - B
        starts = [r.start for r in rows]
        host = torch.tensor([  # padding rows write slot 0 of the scratch block and see that one key
            [r.token_ids[0] for r in rows] + [0] * pad,
            starts + [0] * pad,
            [p + 1 for p in starts] + [1] * pad,
            [r.blocks[p // bs] * bs + p % bs for r, p in zip(rows, starts)] + [self.scratch * bs] * pad,
        ], dtype=torch.long)  # (4, bucket)
        # columns past a row's blocks keep earlier (valid) ids: the kernels never read them unmasked
        w = max(len(r.blocks) for r in rows)
        table = torch.tensor([list(r.blocks) + [0] * (w - len(r.blocks)) for r in rows]
                             + [[self.scratch] + [0] * (w - 1)] * pad, dtype=torch.int32)  # (bucket, w)
        with torch.inference_mode():
            self.inputs[:, :bucket].copy_(host, non_blocking=True)
            self.tables[:bucket, :w].copy_(table, non_blocking=True)
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
