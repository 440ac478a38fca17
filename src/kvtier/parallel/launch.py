"""Starting the ranks: spawned workers on one host, or the processes ``torchrun`` started.

:func:`launch` spawns ``world_size`` workers (``torch.multiprocessing``, spawn
start method), which meet at a ``TCPStore`` this process listens on (127.0.0.1, a port the
system picks and this process holds until the run ends, so nothing can take it while the
workers start), join the group
(:func:`~kvtier.parallel.group.init_tensor_parallel`) and each call
``fn(tp, *args)``; it returns rank 0's result. If a rank raises or dies, the
parent stops the others and raises the first failure: a ``ValueError`` or
``MemoryError`` of the caller's making comes back as the same type (its message
prefixed with the rank), anything else as :class:`TensorParallelError`. The ranks
themselves never wait forever either: every collective has the group's timeout.

:func:`run_ranks` is what the command line calls: under ``torchrun`` this
process is one rank and joins the group through ``env://`` (``torch.distributed``
reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the address); otherwise it spawns. Either way every rank's global
RNG gets the same seed (drawn by rank 0), so seeded or not, sampling draws the
same tokens on every rank from the same (all-gathered) logits.

Example::

    >>> def world(tp):
    ...     return tp.world_size
    >>> launch(world, 2)            # doctest: +SKIP  (fn must be importable by the workers)
    2
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from kvtier.parallel.group import (
    DEFAULT_TIMEOUT_S,
    TensorParallel,
    check_same_device,
    check_timeout,
    check_world,
    destroy_tensor_parallel,
    init_from_torchrun,
    init_tensor_parallel,
    shared_seed,
)

_HOST = "127.0.0.1"  # spawned ranks share this host


class TensorParallelError(RuntimeError):
    """A rank failed, died or ran out of time; the other ranks were stopped."""


@dataclass(frozen=True)
class _Report:
    """What a worker sends home: rank 0's result, or a rank's failure."""

    rank: int
    ok: bool
    value: Any = None
    when: float = 0.0
    kind: str = ""  # "value", "memory" or "other": how the parent re-raises it
    message: str = ""
    trace: str = ""


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    device_type: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline_s: float | None = None,
) -> Any:
    """Spawn ``world_size`` ranks that each run ``fn(tp, *args)``; return rank 0's result.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    ``device_type`` ``"cuda"`` gives rank ``r`` ``cuda:r`` and NCCL, ``"cpu"`` gloo.
    ``timeout_s`` bounds every collective; ``deadline_s`` (``None``: none) bounds
    the whole run, after which the workers are stopped and
    :class:`TensorParallelError` raised. Rank 0's result comes back pickled by value
    through a pipe (tensors too; CUDA tensors as CUDA tensors): keep it small (token
    lists, figures, logits). Ctrl-C here stops the workers.
    """
    check_world(world_size, device_type)
    check_timeout(timeout_s)
    if deadline_s is not None:
        check_timeout(deadline_s)
    ctx = mp.get_context("spawn")
    # a pipe a rank, not a queue: a queue's locks are semaphores, which the resource tracker
    # reports as leaked when this process is killed (SIGKILL) before it could release them
    readers, writers = zip(*(ctx.Pipe(duplex=False) for _ in range(world_size)))
    # the rendezvous: a store listening before any worker starts, on a port no one else can take
    store = dist.TCPStore(_HOST, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    procs = mp.start_processes(
        _worker, args=(world_size, (_HOST, store.port), device_type, timeout_s, fn, args, writers),
        nprocs=world_size, join=False, start_method="spawn",
    )
    for w in writers:  # the ranks hold theirs: a rank's end closes with it, and its pipe reads EOF
        w.close()
    reports = list(readers)
    end = None if deadline_s is None else time.monotonic() + deadline_s
    got: list[_Report] = []
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # its "Terminating process ..." lines: the error below says it
    try:
        while not procs.join(timeout=0.5):
            got += _drain(reports)  # read as they come: a full pipe would block a worker
            if end is not None and time.monotonic() > end:
                _stop(procs)
                raise TensorParallelError(
                    f"the {world_size} ranks did not finish within {deadline_s:g} s; they were "
                    "stopped (a rank hung, or the deadline is too short for the work)")
        got += _drain(reports)
    except ProcessException as e:
        raise _failure(got + _drain(reports), e, world_size, procs.processes) from None
    except BaseException:  # Ctrl-C (or any error) in this process: the workers stop with it
        _stop(procs)
        raise
    finally:
        spawn_log.setLevel(level)
        for r in reports:
            r.close()
        _remove_error_files(procs)
    done = [r for r in got if r.ok]
    if not done:
        raise TensorParallelError("the ranks exited without rank 0 reporting a result")
    return pickle.loads(done[0].value)


def _worker(rank, world_size, rendezvous, device_type, timeout_s, fn, args, writers) -> None:
    for i, w in enumerate(writers):  # this rank's pipe only
        if i != rank:
            w.close()
    reports = writers[rank]
    if device_type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        host, port = rendezvous
        store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
        tp = init_tensor_parallel(world_size, rank, device_type=device_type, timeout_s=timeout_s,
                                  store=store)
        value = run_rank(fn, tp, args)
        destroy_tensor_parallel(tp)
        # by value: the pipe's own pickler would share a tensor's storage through a handle
        # that is gone once this process exits
        value = pickle.dumps(value) if rank == 0 else None
    except BaseException as e:  # reported home, then re-raised: the process exits non-zero
        kind = "value" if isinstance(e, ValueError) else "memory" if isinstance(e, MemoryError) \
            else "other"
        _report(reports, _Report(rank, False, when=time.time(), kind=kind,
                                 message=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-8000:]))
        raise
    if rank == 0:
        _report(reports, _Report(0, True, value))


def _report(pipe, report: _Report) -> None:
    """``report`` sent home, unless home is gone: a launcher killed (SIGKILL) left the pipe
    without a reader, and the rank then ends as it would have, without a broken pipe's error."""
    with contextlib.suppress(OSError):
        pipe.send(report)


def run_rank(fn: Callable[..., Any], tp: TensorParallel, args: tuple) -> Any:
    """One rank's work once the group exists: check devices, share a seed, silence ranks > 0,
    run ``fn(tp, *args)``."""
    check_same_device(tp)
    torch.manual_seed(shared_seed(tp))  # same sampling draws on every rank
    if tp.is_first:
        return fn(tp, *args)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), \
            contextlib.redirect_stderr(null):
        return fn(tp, *args)


def _drain(reports: list) -> list[_Report]:
    """What the ranks' pipes hold now; a pipe at its end (the rank exited) is closed and left
    out of ``reports``."""
    got = []
    for r in list(reports):
        try:
            while r.poll():
                got.append(r.recv())
        except (EOFError, OSError):
            r.close()
            reports.remove(r)
    return got


def _remove_error_files(procs) -> None:
    """Delete the files in which torch's spawn wrapper left each raising rank's traceback
    (``pytorch-errorfile-*.pickle`` in the temporary folder, which torch never removes): the
    failure has come home through the rank's pipe, and a server that restarts its ranks would
    otherwise leave one file a failure."""
    for path in procs.error_files:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _stop(procs) -> None:
    for p in procs.processes:
        if p.is_alive():
            p.terminate()
    for p in procs.processes:
        p.join(5)
        if p.is_alive():
            p.kill()


def _failure(reports: list[_Report], e: ProcessException, world_size: int, processes=()) -> Exception:
    """The first failure (in time) as the exception the caller sees. A rank killed by a signal
    other than the parent's SIGTERM (the kernel's SIGKILL, a crash) reports nothing; the ranks
    that lost it then report broken connections, so it is named first."""
    failed = sorted((r for r in reports if not r.ok), key=lambda r: r.when)
    reported = {r.rank for r in failed}
    killed = [(i, p.exitcode) for i, p in enumerate(processes)
              if i not in reported and p.exitcode is not None and p.exitcode < 0
              and p.exitcode != -signal.SIGTERM]
    if killed:
        rank, code = killed[0]
        then = ""
        if failed:  # the survivor's broken connection (gloo's message runs long)
            lost = failed[0].message.splitlines()[0]
            then = f" (then rank {failed[0].rank}: {lost[:200]}{'...' * (len(lost) > 200)})"
        return TensorParallelError(f"rank {rank} of {world_size} died (signal {_signal_name(-code)}); "
                                   f"the other ranks were stopped{then}")
    if not failed:  # killed by a signal or os._exit: nothing was reported
        return TensorParallelError(f"rank {e.error_index} of {world_size} died ({e}); the other "
                                   "ranks were stopped")
    first = failed[0]
    message = f"rank {first.rank} of {world_size}: {first.message}"
    if first.kind == "value":
        return ValueError(message)
    if first.kind == "memory":
        return MemoryError(message)
    return TensorParallelError(f"{message}; the other ranks were stopped\n{first.trace}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    device_type: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Run ``fn(tp, *args)`` on ``world_size`` ranks: in this process as one rank when
    ``torchrun`` started it, else by spawning them (:func:`launch`). Returns this rank's
    result under ``torchrun``, rank 0's when spawning."""
    if not dist.is_torchelastic_launched():
        return launch(fn, world_size, args=args, device_type=device_type, timeout_s=timeout_s)
    tp = init_from_torchrun(world_size, device_type=device_type, timeout_s=timeout_s)
    value = run_rank(fn, tp, args)
    destroy_tensor_parallel(tp)
    return value
