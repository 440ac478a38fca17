"""What this machine offers a command: the devices kvtier runs on and the CPU threads worth
asking for. Both are checked before a model loads, so a bad flag costs nothing.

Example::

    >>> parse_device("cpu")
    device(type='cpu')
    >>> check_threads(2, cpus=4)
    2
    >>> print(oversubscribed(3, cpus=2))
    --threads 3 is more than the 2 CPUs this process may run on: OpenMP's threads then wait for one another at every product, and a step takes many times as long; use at most 2
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["MAX_THREADS_A_CPU", "check_threads", "oversubscribed", "parse_device", "set_threads", "usable_cpus",
           "warn_oversubscribed"]

#: threads a CPU at most (more only makes OpenMP's threads wait on each other; past some
#: thousands the process cannot start them at all)
MAX_THREADS_A_CPU = 8


def parse_device(text: str, flag: str = "--device") -> torch.device:
    """``torch.device(text)``, refused with the fix where kvtier cannot run on it."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{flag} {text!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} {text!r}: kvtier runs on cpu or cuda; use one of them")
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"{flag} {text}: this PyTorch ({torch.__version__}) sees no CUDA "
                             f"device; use {flag} cpu, or leave {flag} out")
        if device.index is not None and device.index >= n:
            raise ValueError(f"{flag} {text}: there are {n} CUDA devices (cuda:0 to "
                             f"cuda:{n - 1}); pick one of them")
    return device


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads, flag: str = "--threads", cpus: int | None = None) -> int:
    """``threads`` if it is an int from 1 to :data:`MAX_THREADS_A_CPU` times the usable CPUs
    (``cpus``, default :func:`usable_cpus`), else a ``ValueError`` naming the range."""
    cpus = usable_cpus() if cpus is None else cpus
    most = MAX_THREADS_A_CPU * cpus
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= most:
        raise ValueError(f"{flag} must be an int from 1 to {most} ({MAX_THREADS_A_CPU} for each of this "
                         f"process's {cpus} CPUs), got {threads!r}")
    return threads


def oversubscribed(threads: int, ranks: int = 1, flag: str = "--threads", cpus: int | None = None) -> str | None:
    """A warning where ``threads`` threads in each of ``ranks`` processes outnumber the usable CPUs
    (``cpus``, default :func:`usable_cpus`), else ``None``. It is allowed (up to
    :func:`check_threads`' bound) but never pays: the products' OpenMP threads meet at a barrier
    after each product, and one that has no CPU holds the others there (a CPU decode benchmark
    that took 33 s at 2 threads had not finished after 300 s at 3, on a 2-core box)."""
    cpus = usable_cpus() if cpus is None else cpus
    if threads * ranks <= cpus:
        return None
    each = f" on each of {ranks} ranks" if ranks > 1 else ""
    fix = (f"use at most {cpus // ranks}" if cpus >= ranks else
           f"use at most {cpus} ranks (--tensor-parallel) of one thread each")  # (one thread a rank is too many)
    return (f"{flag} {threads}{each} is more than the {cpus} CPUs this process may run on: OpenMP's threads "
            f"then wait for one another at every product, and a step takes many times as long; {fix}")


def warn_oversubscribed(threads: int, ranks: int = 1, flag: str = "--threads") -> None:
    """:func:`oversubscribed`'s warning, where it applies, for the caller's caller."""
    if (note := oversubscribed(threads, ranks, flag)) is not None:
        warnings.warn(note, stacklevel=3)


def set_threads(threads: int, flag: str = "--threads") -> None:
    """``torch.set_num_threads(threads)``, once :func:`check_threads` accepts ``threads``, with
    :func:`oversubscribed`'s warning where it applies."""
    check_threads(threads, flag)
    warn_oversubscribed(threads, flag=flag)
    torch.set_num_threads(threads)
