"""Small C kernels for the CPU: compiled once per machine with the system compiler, loaded by ctypes.

The packed linears (:mod:`kvtier.model.packed`) and the CPU decode attention
(:mod:`kvtier.kernels.cpu_attention`) each hold a C source; :func:`build_library`
compiles it with ``-O3 -march=native -fopenmp`` (the compiler is ``$CC``, else ``cc``)
into :func:`kernel_dir`, under a name keyed by the source, the flags, the CPU's
feature flags and the torch version, and loads it. Like PyTorch's compiled-kernel
cache (``/tmp/torchinductor_<user>``), the folder is private to the user in the
system's temporary directory: a machine compiles each kernel once per boot, in about a
second. Where no compiler works it raises ``OSError``; callers then keep their PyTorch path.

Example::

    >>> lib = build_library("demo", "int twice(int x) { return 2 * x; }")
    >>> lib.twice(21)
    42
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

T = TypeVar("T")


def kernel_dir() -> Path:
    """``<temp dir>/kvtier-kernels-<uid>``, created private (mode 700); ``OSError`` if it exists
    and belongs to someone else (a library loaded from there could run their code)."""
    path = Path(tempfile.gettempdir()) / f"kvtier-kernels-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{path} belongs to uid {st.st_uid} or is writable by others; remove it")
    return path


def build_library(name: str, source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile ``source`` (once: the file is kept in :func:`kernel_dir`) and load it.
    ``extra_flags`` follow :data:`CFLAGS` (tests build the narrower vector paths with
    ``-mno-avx512f`` or ``-mno-avx2``).

    Raises ``OSError`` (or ``subprocess.SubprocessError``) when the compiler fails or is absent.
    """
    flags = (*CFLAGS, *extra_flags)
    key = hashlib.sha256("|".join([source, *flags, platform.machine(), _cpu_flags(),
                                   torch.__version__]).encode()).hexdigest()[:16]
    path = kernel_dir() / f"{name}-{key}.so"
    if not path.is_file():
        _compile(source, path, flags)
    return ctypes.CDLL(str(path))


def load_or_warn(name: str, source: str, wrap: Callable[[ctypes.CDLL], T], otherwise: str) -> T | None:
    """``wrap(build_library(name, source))``, or ``None`` with a warning that says why and
    ``otherwise`` (what the caller does instead) where no compiler builds it."""
    try:
        return wrap(build_library(name, source))
    except (OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"{name} CPU kernels unavailable ({e}); {otherwise}", stacklevel=3)
        return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _compile(source: str, path: Path, flags: tuple[str, ...]) -> None:
    compiler = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, out = Path(tmp) / "kernel.c", Path(tmp) / "kernel.so"
        src.write_text(source, encoding="utf-8")
        done = subprocess.run([compiler, *flags, str(src), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(out, path)  # atomic: a concurrent build of the same key is harmless


__all__ = ["build_library", "load_or_warn", "kernel_dir", "CFLAGS"]
