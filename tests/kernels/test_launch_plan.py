"""The attention kernel's split plan on a GPU of 132 multiprocessors (an H200), computed on the
host: full-precision launches fill whole waves, quantised and small launches keep their plans."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of triton's jit decorators
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvtier.kernels import launch_plan as ta  # noqa: E402

SMS = 132
CUDA = torch.device("cuda", 0)


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(ta, "_multiprocessors", lambda index: SMS)


def splits(B, capacity, quantised=False, device=CUDA, H_kv=8, G=4):
    return ta.plan_launch(B, H_kv, G, 1, capacity, device, ta.LaunchConfig(), quantised)[3]


def last_wave(B, s, H_kv=8):
    waves = B * H_kv * s / (ta.RESIDENT_PROGRAMS * SMS)
    return waves / math.ceil(waves)


@pytest.mark.parametrize("capacity", [4096, 16384, 32768])
def test_full_precision_plans_fill_their_last_wave(h200, capacity):
    # the sweep's figures: B=32 at 5 splits reached 85-90% of SDPA, at 2/4/6/8 splits 91-97%
    assert splits(32, capacity) in (2, 4, 6, 8)
    assert splits(64, capacity) in (2, 3)
    for B in (8, 16, 32, 48, 64, 128):
        s = splits(B, capacity)
        assert last_wave(B, s) >= 0.9 or s == capacity // 512, (B, s)


def test_short_and_quantised_plans_unchanged(h200):
    assert splits(1, 4096) == ta.SHORT_SPLITS  # one 64-key tile a split
    assert splits(1, 16384) == ta.SHORT_SPLITS
    assert splits(8, 4096) == 8  # 512-key splits at most: 8 of them fill 97% of a wave
    # quantised pages keep the program-count plan (their kernel holds 3 programs an SM)
    assert splits(32, 4096, quantised=True) == math.ceil(8 * SMS / (32 * 8))
    assert splits(64, 8192, quantised=True) == math.ceil(8 * SMS / (64 * 8))


def test_a_given_residency_fills_whole_waves_of_it(h200):
    """The Gluon decode kernel's quantised launches (four programs an SM): whole waves of 4 x 132."""

    def plan(B, capacity):
        return ta.plan_launch(B, 8, 4, 1, capacity, CUDA, ta.LaunchConfig(block_n=64), True, 4)[3]

    # one wave of 512 programs (the H200: B=32 / 4k 73.5 us, against 78.5 at 4 splits and 87.5
    # at the program-count plan's 5, whose 1,280 programs fill 2.42 waves); B=8 / 16k alike
    assert plan(32, 4096) == 2
    assert plan(8, 16384) == 8
    assert plan(64, 8192) == 1  # 512 programs in 528 slots: one wave, no merge (q8 251.3 us against 261.3 at 2)
    for B in (8, 16, 32, 48, 64, 128):
        for capacity in (4096, 16384):
            s = plan(B, capacity)
            assert last_wave(B, s) >= 0.9 or s == capacity // 512, (B, capacity, s)
    assert plan(1, 4096) == ta.SHORT_SPLITS  # small grids keep one tile a split
    # a serving step (256 rows: 2,048 programs want one split) keeps one, with no merge (q8 96.8 us
    # against 128.3 at the two a floor of 2 gave)
    assert plan(256, 1280) == 1


def test_one_warp_programs_plan_in_waves_of_eight(h200):
    """The Gluon kernel's one-warp launches (q4: eight programs an SM, splits down to 256 keys):
    the split counts the H200 sweep found fastest."""

    def plan(B, capacity):
        cfg = ta.LaunchConfig(block_n=32, min_split_tokens=256)
        return ta.plan_launch(B, 8, 4, 1, capacity, CUDA, cfg, True, 8)[3]

    assert plan(8, 16384) == 16  # 53.0 us against 72-73 at 18 splits (a second wave)
    assert plan(8, 4096) == 16  # 20.4 against 23.3 at 8
    assert plan(32, 4096) == 4
    assert plan(64, 8192) == 2
    assert plan(256, 1280) == 1


def test_given_split_count_wins(h200):
    cfg = ta.LaunchConfig(num_splits=5)
    assert ta.plan_launch(32, 8, 4, 1, 4096, CUDA, cfg)[3] == 5


def test_cpu_plans_unchanged():
    assert splits(32, 4096, device=torch.device("cpu")) == 1  # 4 programs wanted: no split


@pytest.mark.parametrize(
    "kind, B, capacity, expected",
    [  # (keys a tile, warps, stages, programs a multiprocessor, splits, keys a split)
        ("fp", 64, 8192, (32, 4, 2, 4, 1, 8192)),  # one split fills the wave
        ("q8", 8, 16384, (64, 4, 2, 4, 8, 2048)),
        ("fp8", 8, 4096, (32, 1, 2, 8, 16, 256)),  # one-warp programs, as q4
        ("fp8", 64, 8192, (32, 1, 2, 8, 2, 4096)),
        ("fp8", 1, 16384, (64, 4, 2, 4, ta.SHORT_SPLITS, 16384 // ta.SHORT_SPLITS)),  # a small grid: four warps
        ("q8", 64, 8192, (64, 4, 2, 4, 1, 8192)),  # one split fills the wave of four programs
        ("q4", 8, 4096, (32, 1, 2, 8, 16, 256)),  # one-warp programs split down to 256 keys
        ("q4_g32", 32, 4096, (32, 1, 2, 8, 4, 1024)),
        ("tq", 64, 8192, (16, 1, 2, 16, 4, 2048)),  # the kernel of swapped roles: sixteen programs
    ],
)
def test_the_decode_kernels_whole_launch(h200, kind, B, capacity, expected):
    """``gluon_plan.plan``: the tile, warps, ring, programs a multiprocessor and split plan of a
    default launch (Llama-3-8B's 32 query heads on 8 kv heads), as the H200 runs them."""
    from kvtier.kernels import gluon_plan

    p = gluon_plan.plan(kind, B, 32, 8, 128, capacity, CUDA, ta.LaunchConfig())
    assert (p.block_n, p.warps, p.stages, p.launch.resident, p.splits, p.split_len) == expected
    assert p.base == B * 8 and p.splits * p.split_len >= capacity > (p.splits - 1) * p.split_len


def test_the_decode_kernels_launch_takes_a_sweeps_settings(h200):
    """A sweep's warps and programs a multiprocessor, and a configuration's tile, ring and splits,
    in place of the defaults; scoring ahead takes a third stage."""
    from kvtier.kernels import gluon_plan

    cfg = ta.LaunchConfig(block_n=32, num_splits=3)
    p = gluon_plan.plan("q8", 64, 32, 8, 128, 8192, CUDA, cfg, warps=1, resident=8)
    assert (p.block_n, p.warps, p.launch.resident, p.splits) == (32, 1, 8, 3)
    assert gluon_plan.plan("q8", 64, 32, 8, 128, 8192, CUDA, ta.LaunchConfig(), ahead=True).stages == 3
    assert gluon_plan.plan("q8", 64, 32, 8, 128, 8192, CUDA, ta.LaunchConfig(num_stages=2), ahead=True).ahead is False
