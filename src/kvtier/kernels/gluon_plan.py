"""The Gluon decode kernel's launch by page kind, on the host (:mod:`kvtier.kernels.gluon_decode`):
the default tile and warps, the programs a multiprocessor holds, register caps, and which of the
kernel's variants a launch takes (:func:`programs`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvtier.kernels import gluon_swap
from kvtier.kernels.launch_plan import SMALL_GRID, LaunchConfig, plan_launch

__all__ = ["MAXNREG_BY_KIND", "RESIDENT_BY_WARPS", "SMALL_GRID_TILING", "SWAPPED", "TILING", "Launch", "Plan",
           "plan", "programs", "tiling"]

#: a default launch by page kind on the decode kernel: (keys a tile, warps a program, programs
#: resident a multiprocessor, whose whole waves the split plan fills). Four warps at 96-128
#: registers a thread: four programs. One warp (q4, q4_g32; no barrier across warps in the loop)
#: at 205-242 registers: eight (H200 sweeps, benchmarks/RESULTS.md 2026-12-03; q4_g32's 32-key
#: tiles 3-10% faster than 16-key ones in waves of twelve, 2026-12-04; at 168 registers with its
#: values' scales on the probabilities, waves of twelve were 4-7% faster at B >= 8 and contexts
#: >= 4k but 25% slower on a serving step, 2026-12-04). TurboQuant's 16-key tiles on one warp at
#: the cap below: twelve (32-key tiles on one warp and on four were slower, 2026-12-04); on the
#: kernel of swapped roles, :data:`SWAPPED`'s. fp8 on one warp (204 registers, eight programs;
#: 2026-12-05 against 64 keys on four warps at their best split plans: a serving step 89.2 against
#: 95.6 us, B=128 / 8k 512.3 against 555.2, B=64 / 16k 516.4 against 567.4; within 1% at B <= 32,
#: 1.6% slower at B=64 / 8k)
TILING = {"fp": (32, 4, 4), "q8": (64, 4, 4), "fp8": (32, 1, 8), "q4": (32, 1, 8), "q4_g32": (32, 1, 8),
          "tq": (16, 1, 12)}
#: a register cap by page kind, for the decode kernel's launches of its :data:`TILING` tile and
#: warps: TurboQuant's take 191 registers a thread uncapped, eight programs (B=64 / 8k 458.2 us at
#: 168 in waves of twelve against 501.4, 2026-12-04)
MAXNREG_BY_KIND = {"tq": 168}
#: launches of :data:`TILING`'s tile and warps on the kernel of swapped roles
#: (:mod:`kvtier.kernels.gluon_swap`), by page kind: (register cap, programs a multiprocessor).
#: TurboQuant's take 164 registers a thread uncapped, 128 capped (no spills, sm_90): B=64 / 8k
#: 332.7 us against 351.3 at 168 in waves of twelve (2026-12-04; 32-key tiles and eight
#: uncapped programs were slower too). q4_g32's take 129 uncapped, 128 capped: B=1 / 16k 14.58 us
#: against 16.21 uncapped in waves of eight (2026-12-04)
SWAPPED = {"tq": (128, 16), "q4_g32": (128, 16)}
#: programs a wave by warps a program, for launches whose warps are not :data:`TILING`'s
RESIDENT_BY_WARPS = {4: 4, 2: 6, 1: 8}
#: :data:`TILING` in place of its own for launches of fewer than ``SMALL_GRID`` pairs (B=1 to 3 at
#: 8 kv heads), by page kind: fp8 keeps 64 keys on four warps there (B=1 / 16k 15.6 us against
#: 16.7 on one warp, 2026-12-05)
SMALL_GRID_TILING = {"fp8": (64, 4, 4)}


def tiling(kind: str, pairs: int) -> tuple[int, int, int]:
    """The default ``(keys a tile, warps a program, programs a multiprocessor)`` of a launch of
    ``pairs`` (row, kv head) pairs a split over pages of ``kind``: :data:`TILING`'s, or
    :data:`SMALL_GRID_TILING`'s in a small grid."""
    return SMALL_GRID_TILING.get(kind, TILING[kind]) if pairs < SMALL_GRID else TILING[kind]


class Launch(NamedTuple):
    """What :func:`programs` plans for a launch of the kernel (:mod:`kvtier.kernels.gluon_decode`)."""

    resident: int  # programs resident a multiprocessor: the split plan fills whole waves of them
    maxnreg: int | None  # a cap on the registers a thread (None: the compiler's choice)
    stack: bool  # q4_g32's groups of channels stack the heads in the rows
    raw: bool  # codes as operands as they lie, the dots scaled back
    swap: bool  # the kernel of swapped roles (gluon_swap) runs it


def programs(kind: str, G: int, D: int, pairs: int, block_n: int, warps: int | None = None,
             swap: bool | None = None, raw: bool | None = None) -> Launch:
    """``(programs resident a multiprocessor, register cap, stack, raw, swap)`` of a launch of ``pairs``
    (row, kv head) programs a split, ``G`` query heads a kv head of ``D`` channels, tiles of
    ``block_n`` keys and ``warps`` warps a program (``None``: :data:`TILING`'s): :data:`TILING`'s
    programs (:data:`RESIDENT_BY_WARPS`' for warps asked for), with :data:`MAXNREG_BY_KIND`'s cap
    at :data:`TILING`'s tile and warps, or :data:`SWAPPED`'s cap and programs on the kernel of
    swapped roles.

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
    against twelve at 168 registers, a serving step 88.6 -> 80.6).

    ``swap``: the kernel of swapped roles (:mod:`kvtier.kernels.gluon_swap`) runs the launch,
    where it can (:func:`~kvtier.kernels.gluon_swap.takes`): TurboQuant's at :data:`TILING`'s
    tile and warps (H200, 2026-12-04: B=64 / 8k 356.3 -> 332.7 us, B=8 / 16k 101.1 ->
    94.8, B=32 / 4k 100.4 -> 94.6, a serving step 149.4 -> 148.5; B=1 within 2.5%); q4_g32's at
    that tile and warps in launches of fewer than ``SMALL_GRID`` pairs (2026-12-04:
    B=1 / 4k 9.32 -> 8.87 us, B=1 / 16k 16.71 -> 14.58; at B >= 8 and on a serving step 5-20%
    slower than the stacked rows); q4's only when asked (``swap`` True: 4-7% faster on whole
    batches, 4% slower on a serving step). ``swap`` False: never.
    ``raw`` True or False (a sweep's) in place of the choice above; the swapped kernel takes q4
    only with raw codes, and its q4_g32 codes are always raw."""
    tile, tile_warps, resident = tiling(kind, pairs)
    if warps is not None:
        resident = RESIDENT_BY_WARPS[warps]
    default = (block_n, warps or tile_warps) == (tile, tile_warps)
    cap = MAXNREG_BY_KIND.get(kind) if default else None
    stack = kind == "q4_g32" and G * (D // 32) == 16 and (warps or tile_warps) == 1 and pairs >= SMALL_GRID
    if raw is None:
        raw = default and pairs >= SMALL_GRID and (kind == "q4" or (stack and warps is None))
    can = gluon_swap.takes(kind, raw, warps or tile_warps, False, G, D)
    by_default = default and (kind == "tq" or (kind == "q4_g32" and pairs < SMALL_GRID))
    swap = can and (by_default if swap is None else swap)
    if swap and default and kind in SWAPPED:
        cap, resident = SWAPPED[kind][0], SWAPPED[kind][1] if warps is None else resident
    if kind == "q4_g32" and swap:  # (its codes raw, its rows its own way)
        stack, raw = False, True
    return Launch(resident, cap, stack, raw, swap)


class Plan(NamedTuple):
    """A whole launch of the decode kernel, as :func:`plan` makes it."""

    block_n: int  # keys a tile
    warps: int  # warps a program
    stages: int  # tiles in the ring of shared memory
    ahead: bool  # each tile scored an iteration ahead (a third stage)
    launch: Launch  # programs resident, register cap and variant (:func:`programs`)
    splits: int  # splits of each row's keys
    split_len: int  # keys a split
    base: int  # programs a split: (row, kv head) pairs


def plan(kind: str, B: int, Hq: int, H_kv: int, D: int, capacity: int, device: torch.device, cfg: LaunchConfig, *,
         warps: int | None = None, resident: int | None = None, ahead: bool | None = None, swap: bool | None = None,
         raw: bool | None = None) -> Plan:
    """The launch of a decode step over ``B`` rows of ``Hq`` query heads on ``H_kv`` kv heads of
    ``D`` channels, pages of ``kind``, ``capacity`` keys a row at most: ``cfg``'s tile, ring and
    warps where set (else :data:`TILING`'s and two stages), :func:`programs`' variant, and the
    split plan (:func:`~kvtier.kernels.launch_plan.plan_launch`, whole waves of the programs a
    multiprocessor holds; one-warp programs split down to 256 keys: B=8 / 4k q4, 16 splits 20.4
    us, 8 splits 23.3). ``warps``, ``resident``, ``ahead``, ``swap`` and ``raw``: a sweep's
    settings in place of the defaults (``None``: the defaults; ``ahead`` needs three stages)."""
    tile, tile_warps, _ = tiling(kind, B * H_kv)
    block_n = cfg.block_n or tile
    asked = cfg.num_warps or warps
    w = asked or tile_warps
    ahead = bool(ahead) and (cfg.num_stages or 3) >= 3
    launch = programs(kind, Hq // H_kv, D, B * H_kv, block_n, asked, False if ahead else swap, raw)
    short = w == 1 and cfg.min_split_tokens == LaunchConfig.min_split_tokens
    *_, splits, split_len, base = plan_launch(B, H_kv, Hq // H_kv, 1, capacity, device, cfg, kind != "fp",
                                              resident or launch.resident, block_n=block_n,
                                              min_split_tokens=256 if short else None)
    return Plan(block_n, w, cfg.num_stages or (3 if ahead else 2), ahead, launch, splits, split_len, base)
