"""Serving over tensor-parallel ranks: rank 0 schedules, every rank runs each step.

Rank 0 holds the whole engine (:class:`kvtier.serve.engine.LLMEngine`: scheduler,
block manager, sampling, and whatever serves it, such as the HTTP server) over its
shard of the model. Its runner is wrapped in a :class:`BroadcastRunner`, which
sends each step's :class:`~kvtier.serve.scheduler.StepBatch` (plain data) to the
other ranks before running it; each other rank holds a
:class:`~kvtier.serve.runner.ModelRunner` over its own shard and pages (its KV
heads) and runs every batch it receives (:func:`follow`). The runners keep no
books of their own, so the same batch gives every rank the same rows at the same
positions; the logits are gathered inside the model, and only rank 0 samples.
Shutdown is a ``None`` batch.

The batches travel on a gloo group of their own, on the CPU: no device sync to
send them, and a wait without a deadline, since a server may sit idle for hours
(a rank that dies still closes its connections, and the others raise at once).
The model's collectives keep the finite timeout of the main group.

The other ranks ignore SIGINT and SIGTERM once they follow: they stop when rank 0
says so (or dies), so a Ctrl-C that reaches every process of the terminal, or a
launcher that passes a SIGTERM on to every worker, stops rank 0's server first
and the followers after its last step. ``kvtier serve --tensor-parallel N`` is
built on this (:mod:`kvtier.serve.cli`).

Example (two CPU ranks; ``serve_fn`` runs on rank 0 and may block for hours)::

    >>> def run(engine, prompts):
    ...     return [o.token_ids for o in engine.generate(prompts)]
    >>> serve_sharded(run, 2, args=([[1, 2, 3]],), config=EngineConfig(num_blocks=64))  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from kvtier.model.loading import model_args
from kvtier.parallel.group import DEFAULT_TIMEOUT_S, TensorParallel
from kvtier.parallel.launch import run_ranks
from kvtier.parallel.run import load_sharded
from kvtier.parallel.shard import check_shardable

#: how long a follower waits for the next batch (an idle server sends none)
IDLE_WAIT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class RunnerSpec:
    """What every rank's :class:`~kvtier.serve.runner.ModelRunner` is built with: rank 0's
    engine decides (its pool size may come from its free memory), the others follow."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    kv_quant: str | None
    turboquant: Any
    attention_backend: str
    cuda_graph: bool | None
    host_blocks: int = 0  # the host tier's slots: every rank keeps its own shards' copies

    @classmethod
    def of_engine(cls, engine) -> RunnerSpec:
        c = engine.config
        return cls(engine.block_manager.num_blocks, c.block_size, c.max_num_seqs,
                   engine.max_model_len, c.kv_quant, c.turboquant, c.attention_backend, c.cuda_graph,
                   engine.block_manager.host_blocks)

    def build(self, model):
        from kvtier.serve.runner import ModelRunner

        return ModelRunner(model, num_blocks=self.num_blocks, block_size=self.block_size,
                           kv_quant=self.kv_quant, turboquant=self.turboquant,
                           attention_backend=self.attention_backend, cuda_graph=self.cuda_graph,
                           max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                           host_blocks=self.host_blocks)


def control_group() -> dist.ProcessGroup:
    """A gloo group of every rank for the batches, with no practical deadline (a collective call)."""
    return dist.new_group(backend="gloo", timeout=IDLE_WAIT)


@dataclass(frozen=True)
class RankCall:
    """A function every rank runs on its own runner, ``fn(runner, rank, world_size, *args)``
    (``fn`` a module's function: it travels by name), outside the steps: the prefix cache file's
    reads and writes of each rank's share (:mod:`kvtier.serve.prefix_file`)."""

    fn: Callable[..., Any]
    args: tuple

    def answer(self, runner, group: dist.ProcessGroup) -> list[tuple[bool, Any]] | None:
        """Run here and gather every rank's ``(True, result)`` or ``(False, message)`` to rank 0
        (returned there; ``None`` elsewhere). On a rank > 0 an exception is an answer, never a
        dead rank; rank 0 raises its own unforeseen one (not a ``ValueError``) once every answer
        is in, with its traceback."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        error = None
        try:
            out = (True, self.fn(runner, rank, world, *self.args))
        except Exception as e:  # (the rank stays to follow the next batch)
            error, out = e, (False, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
        answers = [None] * world if rank == 0 else None
        dist.gather_object(out, answers, dst=0, group=group)
        if rank == 0 and error is not None and not isinstance(error, ValueError):
            raise error
        return answers


class BroadcastRunner:
    """Rank 0's runner: each :meth:`execute` sends the batch to the other ranks, then runs it
    here. Otherwise it answers for the runner it wraps (``storage_mode``, ``nbytes`` of
    this rank's pages, the last step's ``prompt_logits`` and ``draft_logits``, its ``graphs``)."""

    def __init__(self, runner, group: dist.ProcessGroup):
        self.runner, self.group = runner, group
        self.closed = False

    def execute(self, batch, pending=None) -> torch.Tensor:
        """Logits ``[n_sampled, vocab]`` (float32) of ``batch``, run on every rank. Tokens still
        on rank 0's device (asynchronous scheduling) cannot feed the other ranks: ``pending``
        must be ``None``."""
        if pending is not None:
            raise ValueError("tensor parallel serving runs without asynchronous scheduling; "
                             "build the engine with async_scheduling=False")
        if self.closed:
            raise ValueError("the other ranks were shut down (close() was called); build a new "
                             "engine to serve again")
        dist.broadcast_object_list([batch], src=0, group=self.group)
        return self.runner.execute(batch)

    def on_every_rank(self, fn: Callable[..., Any], *args) -> list[tuple[bool, Any]]:
        """``fn(runner, rank, world_size, *args)`` on every rank's runner, this one's too
        (:class:`RankCall`); each rank's ``(True, result)`` or ``(False, message)``, by rank."""
        if self.closed:
            raise ValueError("the other ranks were shut down (close() was called)")
        call = RankCall(fn, args)
        dist.broadcast_object_list([call], src=0, group=self.group)
        return call.answer(self.runner, self.group)

    def close(self) -> None:
        """Tell the other ranks to stop (the ``None`` batch). Idempotent."""
        if not self.closed:
            dist.broadcast_object_list([None], src=0, group=self.group)
            self.closed = True

    @property
    def storage_mode(self) -> str:
        return self.runner.storage_mode

    @property
    def prompt_logits(self) -> dict:
        return self.runner.prompt_logits

    @property
    def draft_logits(self) -> dict:
        return self.runner.draft_logits

    @property
    def graphs(self):
        return self.runner.graphs

    @property
    def nbytes(self) -> int:
        return self.runner.nbytes


def follow(runner, group: dist.ProcessGroup) -> int:
    """A rank > 0: run every batch rank 0 broadcasts (and answer every :class:`RankCall`) until
    the ``None`` batch; returns the number of steps run."""
    steps = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is None:
            return steps
        if isinstance(box[0], RankCall):
            box[0].answer(runner, group)
            continue
        runner.execute(box[0])
        steps += 1


def serve_sharded(
    serve_fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    config=None,
    model: str | os.PathLike | None = None,
    device_type: str = "cpu",
    dtype: torch.dtype | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads: int | None = None,
) -> Any:
    """Serve ``model`` sharded over ``world_size`` ranks: rank 0 builds an
    :class:`~kvtier.serve.engine.LLMEngine` (``config``, an ``EngineConfig``) over its
    shard and calls ``serve_fn(engine, *args)`` (the server, or any driver of the engine);
    the other ranks follow its steps. A socket among ``args`` (a listening one bound before
    the ranks start) is rank 0's: the other ranks close their copies. When ``serve_fn``
    returns (or raises), the others are told to stop. Returns ``serve_fn``'s result (rank
    0's; ``None`` on the other ranks under ``torchrun``). ``threads``: torch CPU threads of
    each rank (default: the host's cores shared out when spawning, torch's default under
    ``torchrun``).
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
    if getattr(config, "async_scheduling", None):
        raise ValueError("async_scheduling=True cannot serve sharded: the other ranks need each "
                         "step's tokens on the host; leave it unset or False")
    check_shardable(model_args(model), world_size)  # before a rank starts (and loads the weights)
    return run_ranks(_serve_rank, world_size, args=(serve_fn, args, config, model, dtype, threads),
                     device_type=device_type, timeout_s=timeout_s)


def _serve_rank(tp: TensorParallel, serve_fn, args, config, model, dtype, threads) -> Any:
    if threads is not None:
        torch.set_num_threads(threads)
    if not tp.is_first:
        for a in args:
            if isinstance(a, socket.socket):
                a.close()
    lm = load_sharded(model, tp, dtype=dtype)
    group = control_group()
    if not tp.is_first:
        if threading.current_thread() is threading.main_thread():  # rank 0 decides when to stop
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        spec = [None]
        dist.broadcast_object_list(spec, src=0, group=group)
        follow(spec[0].build(lm.model), group)
        return None
    from kvtier.caches.state_checks import free_bytes
    from kvtier.serve.engine import EngineConfig, LLMEngine

    config = replace(config or EngineConfig(), async_scheduling=False)
    if (gib := config.kv_offload_gib) is not None:  # the ranks share the host: GIB in all, a share each
        free = free_bytes(torch.device("cpu"))
        if free is not None and gib * 2**30 > free:
            raise ValueError(f"a host tier of {gib:g} GiB is more than the {free / 2**30:.1f} GiB this host has "
                             "free; lower --kv-offload-memory")
        config = replace(config, kv_offload_gib=gib / tp.world_size)
    engine = LLMEngine(lm.model, lm.tokenizer, config)
    dist.broadcast_object_list([RunnerSpec.of_engine(engine)], src=0, group=group)
    engine.runner = BroadcastRunner(engine.runner, group)
    try:
        return serve_fn(engine, *args)
    finally:
        engine.runner.close()
