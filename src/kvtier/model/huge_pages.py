"""The packed weights in one block of memory backed by 2 MB pages (Linux transparent huge pages).

A decode step on the CPU streams every packed weight once: about 97 MB for the default model,
in 121 tensors of 0.2-28 MB. With 4 KB pages that is some 24,000 pages a step, far more than
the TLB holds, and the hardware prefetchers stop at each page's end. :func:`place_on_huge_pages`
moves the codes, scales and minima of every :class:`~kvtier.model.packed.PackedLinear` of a
model into one anonymous mapping, 2 MB aligned, that it asks the kernel to back with huge pages
(``madvise(MADV_HUGEPAGE)``: it works where ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``). The values do not change, only where they live. On the 2-core Zen 4
box a decode step took 10-14% less time than with the tensors in 4 KB anonymous memory (as after
a first load, which finds the codes) and 2-3% less than in the private mapping of the codes'
cache file, where later loads leave them (two copies of the model in one process, steps
alternated; benchmarks/RESULTS.md, 2026-12-04).

:func:`~kvtier.model.packed.pack_model` calls it (``huge_pages=False`` to leave the tensors where
they are). Elsewhere than Linux, or where the kernel refuses huge pages, nothing moves.

Example::

    >>> lm = load_model()                       # packed, and placed  # doctest: +SKIP
    >>> lm.packing["huge_pages"]                # bytes on huge pages  # doctest: +SKIP
    96436224
"""

from __future__ import annotations

import ctypes
import mmap
import platform
from pathlib import Path

import torch
from torch import nn

__all__ = ["HUGE_PAGE", "place_on_huge_pages", "thp_mode"]

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN = 64  # each tensor starts on a cache line


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``); ``None``
    where it does not say (not Linux)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def place_on_huge_pages(model: nn.Module) -> int:
    """Move every packed linear's codes, scales and minima (CPU parameters) of ``model`` into one
    mapping backed by huge pages; returns the bytes moved (0: nothing moved, because there was
    nothing to move, the system is not Linux, its kernel refused huge pages or the mapping could
    not be made)."""
    from kvtier.model.packed import PackedLinear

    params = [(mod, name, p) for mod in model.modules() if isinstance(mod, PackedLinear)
              for name in ("codes", "d", "m") if (p := getattr(mod, name)) is not None and p.device.type == "cpu"]
    sizes = [-(-p.numel() * p.element_size() // _ALIGN) * _ALIGN for _, _, p in params]
    total = sum(sizes)
    if not total or platform.system() != "Linux" or thp_mode() not in ("always", "madvise"):
        return 0
    length = -(-total // HUGE_PAGE) * HUGE_PAGE
    try:
        buf = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # (no memory for a second copy now: the tensors stay where they are)
        return 0
    arena = torch.frombuffer(buf, dtype=torch.uint8)  # (keeps buf alive)
    start = -arena.data_ptr() % HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(arena.data_ptr() + start), ctypes.c_size_t(length), _MADV_HUGEPAGE):
        return 0
    at = start
    with torch.no_grad():
        for (mod, name, p), size in zip(params, sizes):
            nbytes = p.numel() * p.element_size()
            view = arena[at:at + nbytes].view(p.dtype).view(p.shape)
            view.copy_(p)  # (the first touch: the kernel backs the pages now)
            # (a new parameter by assignment: the decode step's plan of pointers sees the move)
            setattr(mod, name, nn.Parameter(view, requires_grad=False))
            at += size
    return total
