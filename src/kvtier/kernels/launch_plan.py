"""The attention kernel's launch plan, on the host: tile sizes and the split-KV plan.

:class:`LaunchConfig` overrides what :func:`plan_launch` picks (benchmarks, tests). The
plan depends on the batch, the heads, the queries and the block table's capacity, never
on the lengths, so a launch needs no device-to-host sync and a CUDA graph keeps its shape.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

DECODE_KERNELS = ("cuda_core", "mma", "gluon")
#: launches of fewer (row, kv head) programs than this split short: B=1 with 8 kv heads
#: leaves most multiprocessors idle at 512-key splits
SMALL_GRID, SHORT_SPLITS = 32, 64
#: programs of the bf16 kernel resident on one multiprocessor (64-key tiles, 4 warps: 111
#: registers a thread, 25% occupancy); the split plan fills whole waves of these
RESIDENT_PROGRAMS = 4
#: query rows (token x GQA head) a tile of packed prompt chunks over full-precision pages
PACKED_BLOCK_M = 128

__all__ = ["DECODE_KERNELS", "PACKED_BLOCK_M", "RESIDENT_PROGRAMS", "SHORT_SPLITS", "SMALL_GRID", "LaunchConfig",
           "capability", "multiprocessors", "plan_launch"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and split plan of one attention launch (``None``: chosen by the heuristics).

    ``block_m``: query rows (token x GQA head) a tile, a power of two >= 16 (``None``: the
    rows a launch has, 16-64, and :data:`PACKED_BLOCK_M` for packed prompt chunks over
    full-precision pages on CUDA). ``decode_kernel``: ``"cuda_core"`` or ``"mma"`` for a
    decode step over quantised pages (``None``: the family's entry in
    :data:`QUANT_DECODE_KERNEL`), ``"gluon"`` for the pipelined kernel of
    :mod:`kvtier.kernels.gluon_decode` (16-bit, q8, q4, fp8, q4_g32 and TurboQuant's default
    pages, its ``KINDS``; by default it takes the page
    kinds in ``GLUON_DECODE`` of :mod:`kvtier.kernels.triton_attention`). ``int8_queries``: the MMA kernel scores q8 keys as
    integer dots of int8 queries (one scale a query row) with the stored codes (``None``:
    ``INT8_QUERIES`` of :mod:`kvtier.kernels.triton_attention`).
    """

    block_m: int | None = None
    block_n: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    min_split_tokens: int = 512
    decode_kernel: str | None = None
    int8_queries: bool | None = None

    def __post_init__(self) -> None:
        m = self.block_m
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 16 or m & (m - 1)):
            raise ValueError(f"block_m must be a power of two >= 16 (a tensor-core tile) or None, got {m!r}")
        if self.decode_kernel is not None and self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(
                f"decode_kernel must be one of {DECODE_KERNELS} or None, got {self.decode_kernel!r}"
            )


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _target_programs(device: torch.device) -> int:
    # H200 sweep (benchmarks/results_gpu_attention.md): about 8 programs per multiprocessor
    # (2-3 waves at 3 resident programs each) beat 4 per SM, whose last wave ran part-empty
    if device.type == "cuda":
        return 8 * multiprocessors(device)
    return 4


def multiprocessors(device: torch.device) -> int:
    """The multiprocessors of a CUDA ``device`` (0 off CUDA), asked of the driver once."""
    if device.type != "cuda":
        return 0
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA ``device`` (``(0, 0)`` off CUDA), asked of the driver once."""
    if device.type != "cuda":
        return (0, 0)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def plan_launch(
    B: int, H_kv: int, G: int, T: int, capacity: int, device: torch.device, cfg: LaunchConfig,
    quantised: bool = False, resident: int | None = None, *, block_n: int | None = None,
    min_split_tokens: int | None = None,
) -> tuple[int, int, int, int, int, int]:
    """``(block_m, m_tiles, block_n, num_splits, split_len, programs_per_split)`` of one launch
    (``block_n``, ``min_split_tokens``: in place of ``cfg``'s, without a new config a step).

    Splits: enough programs for ``8 x`` the multiprocessors, each split at least
    ``min_split_tokens`` long (one tile, and at most :data:`SHORT_SPLITS` splits, when
    fewer than :data:`SMALL_GRID` (row, kv head) pairs share the launch) and a whole
    number of ``block_n`` tiles. On CUDA, full-precision launches of at least
    :data:`SMALL_GRID` pairs then take the split count near that whose last wave of programs
    is full (:func:`_whole_waves`), waves of :data:`RESIDENT_PROGRAMS` a multiprocessor, or of
    ``resident`` where given (any launch: the Gluon decode kernel's). The plan depends on the
    capacity (table width x page), never on the lengths.
    """
    rows = G * T
    block_m = cfg.block_m or max(16, min(64, _next_pow2(rows)))
    m_tiles = _cdiv(rows, block_m)
    if device.type != "cuda":
        block_n = block_n or cfg.block_n or 32
    else:
        # H200 sweep: bf16 pages 64 keys a tile; quantised pages 128 (twice the bytes in flight)
        block_n = block_n or cfg.block_n or (128 if quantised else 64)
    base = B * H_kv * m_tiles
    if cfg.num_splits is not None:
        splits = max(1, cfg.num_splits)
    else:
        want = _cdiv(_target_programs(device), base)
        # a small grid (B=1: 8 kv heads) splits down to one tile per split, at most SHORT_SPLITS
        # splits (H200, B=1: 4k context 21.8 -> 13.8 us, 16k 30.4 -> 26.2 us; B=8 keeps 512 keys)
        min_split = (min_split_tokens or cfg.min_split_tokens) if base >= SMALL_GRID else block_n
        if base < SMALL_GRID:
            want = min(want, SHORT_SPLITS)
        most = max(1, _cdiv(capacity, max(min_split, block_n)))
        splits = max(1, min(want, most))
        if device.type == "cuda" and (resident or not quantised) and base >= SMALL_GRID:
            slots = (resident or RESIDENT_PROGRAMS) * multiprocessors(device)
            # the Gluon kernel's launches (resident given) may halve their splits twice: one
            # full wave of long splits beat more waves of short ones (H200, B=32 / 4k q8: 2
            # splits 73.5 us, 4 splits 78.5; B=8 / 16k: 8 splits 72.1, 16 splits 76.4), down to
            # one split where that fills its wave as well as more (no merge: a serving step's
            # 2,048 pairs, q8 96.8 us against 128.3 at two; B=64 / 8k on four programs a
            # multiprocessor, 512 programs in 528 slots, q8 251.3 against 261.3 at two,
            # 2026-12-05)
            low = _cdiv(splits, 4) if resident else _cdiv(splits, 2)
            splits = _whole_waves(base, splits, most, capacity, block_n, slots, low)
    split_len = _cdiv(_cdiv(capacity, splits), block_n) * block_n
    splits = max(1, _cdiv(capacity, split_len))
    return block_m, m_tiles, block_n, splits, split_len, base


@functools.lru_cache(maxsize=1024)
def _whole_waves(base: int, want: int, most: int, capacity: int, block_n: int, slots: int, low: int) -> int:
    """The fewest splits in ``[low, min(2 want, most)]`` whose programs fill their last wave of
    ``slots`` (resident programs x multiprocessors) within 3% of the best such count, else
    ``want``. Cached: an eager decode step plans every layer's launch alike.

    H200, bf16, 32/8 heads (``benchmarks/tools/split_sweep.py``): at B=32 (256 programs a split)
    5 splits fill 2.4 waves of 528 and reach 85-90% of SDPA, 2, 4, 6 or 8 splits 91-97%; B=64
    keeps 2-3 splits and B=8 8 or 16, which fill their waves already."""

    def fill(s: int) -> float:  # the share of the last wave's slots in use, after rounding to tiles
        s = _cdiv(capacity, _cdiv(_cdiv(capacity, s), block_n) * block_n)
        waves = base * s / slots
        return waves / math.ceil(waves)

    fills = {s: fill(s) for s in range(max(1, low), min(2 * want, most) + 1)}
    if not fills:
        return want
    best = max(fills.values())
    return next(s for s, f in fills.items() if f >= best - 0.03)
