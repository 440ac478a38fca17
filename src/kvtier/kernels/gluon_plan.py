"""The Gluon decode kernel's launch by page kind, on the host (:mod:`kvtier.kernels.gluon_decode`):
the default tile and warps, the programs a multiprocessor holds, register caps, and which of the
kernel's variants a launch takes (:func:`programs`)."""

from __future__ import annotations

from typing import NamedTuple

from kvtier.kernels.launch_plan import SMALL_GRID

__all__ = ["MAXNREG_BY_KIND", "RESIDENT_BY_WARPS", "TILING", "Launch", "programs"]

#: a default launch by page kind: (keys a tile, warps a program, programs resident a
#: multiprocessor, whose whole waves the split plan fills). Four warps at 96-128 registers a
#: thread: four programs. One warp (q4, q4_g32; no barrier across warps in the loop) at 205-242
#: registers: eight (H200 sweeps, benchmarks/RESULTS.md 2026-12-03; q4_g32's 32-key tiles 3-10%
#: faster than 16-key ones in waves of twelve, 2026-12-04; at 168 registers with its values'
#: scales on the probabilities, waves of twelve were 4-7% faster at B >= 8 and contexts >= 4k
#: but 25% slower on a serving step, 2026-12-04). TurboQuant's 16-key tiles on one warp:
#: twelve, at the cap below (32-key tiles on one warp and on four were slower, 2026-12-04)
TILING = {"fp": (32, 4, 4), "q8": (64, 4, 4), "fp8": (64, 4, 4), "q4": (32, 1, 8), "q4_g32": (32, 1, 8),
          "tq": (16, 1, 12)}
#: a register cap by page kind, for launches of its :data:`TILING` tile and warps. TurboQuant's
#: 16-key one-warp programs took 191 registers a thread uncapped (eight programs), at 168 (no
#: spills, sm_90, Triton 3.6) twelve: B=64 / 8k 458.2 against 501.4 us; its keys since in
#: registers, 378-382 us, 168 and no spills (benchmarks/RESULTS.md, 2026-12-04)
MAXNREG_BY_KIND = {"tq": 168}
#: programs a wave by warps a program, for launches whose warps are not :data:`TILING`'s
RESIDENT_BY_WARPS = {4: 4, 2: 6, 1: 8}
class Launch(NamedTuple):
    """What :func:`programs` plans for a launch of the kernel (:mod:`kvtier.kernels.gluon_decode`)."""

    resident: int  # programs resident a multiprocessor: the split plan fills whole waves of them
    maxnreg: int | None  # a cap on the registers a thread (None: the compiler's choice)
    stack: bool  # q4_g32's groups of channels stack the heads in the rows
    raw: bool  # codes as operands as they lie, the dots scaled back


def programs(kind: str, G: int, D: int, pairs: int, block_n: int, warps: int | None = None) -> Launch:
    """``(programs resident a multiprocessor, register cap, stack, raw)`` of a launch of ``pairs``
    (row, kv head) programs a split, ``G`` query heads a kv head of ``D`` channels, tiles of
    ``block_n`` keys and ``warps`` warps a program (``None``: :data:`TILING`'s): :data:`TILING`'s
    programs (:data:`RESIDENT_BY_WARPS`' for warps asked for), with :data:`MAXNREG_BY_KIND`'s cap
    at :data:`TILING`'s tile and warps.

    ``stack``: q4_g32's groups of channels stack the heads in the rows (``G x D / 32 = 16``, one
    warp), in launches of :data:`~kvtier.kernels.launch_plan.SMALL_GRID` pairs or more (B=1 / 4k
    and 16k, stacked: 7-9% slower, 2026-12-04).

    ``raw``: codes go to the tensor cores as they lie, fp16 subnormals (``c 2^-24``), and their
    dots are scaled back in float32: no conversion a nibble. q4's keys and values, in launches of
    ``SMALL_GRID`` pairs or more at :data:`TILING`'s tile and warps (H200, 2026-12-04: B=64 / 8k
    187.2 -> 172.3 us, a serving step 69.6 -> 63.8; B=1 / 4k, a small grid, 8.4 -> 9.0). Stacked
    q4_g32's values, and its keys with each row's query cut to its group's channels and the keys'
    scales and zeros on the scores (:func:`~kvtier.kernels.gluon_codes.stacked_key_scores`), at
    :data:`TILING`'s tile and warps (B=64 / 8k 239.4 -> 220.1 us at eight uncapped programs
    against twelve at 168 registers, a serving step 88.6 -> 80.6)."""
    tile, tile_warps, resident = TILING[kind]
    if warps is not None:
        resident = RESIDENT_BY_WARPS[warps]
    default = (block_n, warps or tile_warps) == (tile, tile_warps)
    cap = MAXNREG_BY_KIND.get(kind) if default else None
    stack = kind == "q4_g32" and G * (D // 32) == 16 and (warps or tile_warps) == 1 and pairs >= SMALL_GRID
    raw = default and pairs >= SMALL_GRID and (kind == "q4" or (stack and warps is None))
    return Launch(resident, cap, stack, raw)
