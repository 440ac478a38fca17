"""What this machine offers a command: the devices kvtier runs on and the CPU threads worth
asking for. Both are checked before a model loads, so a bad flag costs nothing.

Example::

    >>> parse_device("cpu")
    device(type='cpu')
    >>> check_threads(2, cpus=4)
    2
"""

from __future__ import annotations

import os

import torch

__all__ = ["MAX_THREADS_A_CPU", "check_threads", "parse_device", "usable_cpus"]

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
