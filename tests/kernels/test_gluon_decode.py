"""The pipelined decode kernel (``LaunchConfig(decode_kernel="gluon")``,
:mod:`kvtier.kernels.gluon_decode`) against SDPA over the decoded pages (q8 pages: with the
queries rounded as the kernel rounds them) and against the MMA kernel's launch of the same step.

Gluon kernels compile for GPUs only (no interpreter): off the GPU the tests check the refusals.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_triton_paged import DEVICE, IN_PROCESS, ON_GPU, TOL, build_cache, gathered_reference

from kvtier.kernels.reference import round_queries_int8
from triton_support import in_this_process_or_a_fresh_one

if IN_PROCESS:
    from kvtier.kernels import gluon_decode, gluon_plan, triton_attention, triton_paged
    from kvtier.kernels.triton_paged import LaunchConfig, paged_attention_triton
    from kvtier.kernels.triton_quant import page_format

_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)


def _case(mode, B, Hq, H_kv, D, lengths, dtype, seed=0):
    c = build_cache(mode, B, H_kv, D, 16, lengths, dtype, seed=seed)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    return c, q, c["kv_len"] - 1


def _attend(c, q, qs, **cfg):
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    return paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], config=LaunchConfig(**cfg), **kw)


def _check_against_references(c, q, qs, mode, tol, *, num_splits, **plan):
    """The Gluon launch against SDPA over the decoded pages (q8: the queries rounded as the
    kernel rounds them) and against the MMA kernel's launch of the same step."""
    out = _attend(c, q, qs, decode_kernel="gluon", num_splits=num_splits, **plan)
    seen = round_queries_int8(q) if mode == "q8" else q
    torch.testing.assert_close(out.float(), gathered_reference(c, seen, qs), atol=tol, rtol=tol)
    mma = _attend(c, q, qs, decode_kernel="mma", num_splits=num_splits)
    torch.testing.assert_close(out.float(), mma.float(), atol=tol, rtol=tol)


def _formats(c):
    return page_format(c["kc"], c["kp"], c["ks"]), page_format(c["vc"], c["vp"], c["vs"])


#: TurboQuant's default pages: 8-bit keys, 3-bit values (the kernel's kind "tq")
TQ = "turboquant:q8_0,q3_0"
#: launches from one kv head to the H200's: (B, Hq, H_kv, D, lengths, splits)
SHAPES = [
    (3, 4, 1, 64, [1, 17, 45], None),
    (2, 8, 2, 128, [70, 33], 3),
    (3, 12, 4, 64, [5, 200, 64], 4),  # three heads a kv head
    (64, 32, 8, 128, [2000 - 29 * b for b in range(64)], None),  # B=64, the H200 shape
]


@pytest.mark.parametrize("mode", ["turboquant:q4_0,q8_0", "turboquant:q4_0,q4_0", "turboquant:q8_0,q4_0",
                                  "turboquant:q5_0,q3_0"])
def test_other_turboquant_pages_are_not_taken(mode):
    c, q, _ = _case(mode, 1, 4, 1, 64, [20], torch.float16)
    why = gluon_decode.supported(*_formats(c), q, 4, c["kp"])
    assert why is not None and ("q8, q4 or fp8" in why or "GPU" in why)
    assert gluon_decode.pages_kind(*_formats(c), q, c["kp"]) is None


def test_turboquant_halves_are_not_taken_beside_other_pages():
    """TurboQuant's keys (or values) beside pages of another kind: not a kind of this kernel."""
    tq, q8 = _case(TQ, 1, 4, 1, 64, [20], torch.float16)[0], _case("q8", 1, 4, 1, 64, [20], torch.float16)[0]
    q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
    (tk, tv), (k8, v8) = _formats(tq), _formats(q8)
    assert gluon_decode.pages_kind(tk, tv, q) == "tq"
    assert gluon_decode.pages_kind(tk, v8, q) is None and gluon_decode.pages_kind(k8, tv, q) is None
    assert gluon_decode.pages_kind(tk, tk, q) is None and gluon_decode.pages_kind(tv, tv, q) is None


@pytest.mark.parametrize("mode, kind", [("q8", "q8"), ("q4", "q4"), ("fp8", "fp8"), ("q4_g32", "q4_g32"), ("fp", "fp"),
                                        (TQ, "tq"), ("turboquant:q8_0r,q3_0", "tq")])
def test_the_kinds_it_reads(mode, kind):
    c, q, _ = _case(mode, 1, 4, 1, 64, [20], torch.float16)
    assert gluon_decode.pages_kind(*_formats(c), q, c["kp"]) == kind
    assert gluon_decode.pages_kind(*_formats(c), q.float(), c["kp"]) == (None if mode == "fp" else kind)


@pytest.mark.parametrize(
    "kind, G, D, pairs, block_n, warps, expected",
    [
        ("q4_g32", 4, 128, 512, 32, None, (8, None, True, True, False)),  # B=64 x 8 kv heads: raw codes
        ("q4_g32", 4, 128, 2048, 32, None, (8, None, True, True, False)),  # a serving step
        ("q4_g32", 8, 64, 64, 32, None, (8, None, True, True, False)),  # two groups of eight heads stack too
        ("q4_g32", 4, 128, 8, 32, None, (16, 128, False, True, True)),  # B=1: a small grid, swapped roles
        ("q4_g32", 4, 128, 8, 32, 1, (8, 128, False, True, True)),  # TILING's warps asked for
        ("q4_g32", 8, 128, 8, 32, None, (8, None, False, False, False)),  # eight heads a kv head: the decode kernel
        ("q4_g32", 4, 128, 8, 16, None, (8, None, False, False, False)),  # another tile: the decode kernel
        ("q4_g32", 3, 64, 64, 32, None, (8, None, False, False, False)),  # six rows: the values' scales on the operands
        ("q4_g32", 4, 128, 512, 16, None, (8, None, True, False, False)),  # another tile
        ("q4_g32", 4, 128, 512, 32, 1, (8, None, True, False, False)),  # warps asked for
        ("q4_g32", 4, 128, 512, 32, 4, (4, None, False, False, False)),
        ("q4", 4, 128, 512, 32, None, (8, None, False, True, False)),  # raw nibbles
        ("q4", 4, 128, 2048, 32, None, (8, None, False, True, False)),
        ("q4", 4, 128, 8, 32, None, (8, None, False, False, False)),  # B=1: a small grid
        ("q4", 4, 128, 512, 64, 4, (4, None, False, False, False)),  # another tile and warps
        ("tq", 4, 128, 512, 16, None, (16, 128, False, False, True)),  # the kernel of swapped roles
        ("tq", 4, 128, 2048, 16, None, (16, 128, False, False, True)),
        ("tq", 4, 128, 512, 16, 1, (8, 128, False, False, True)),  # TILING's warps asked for: their programs a wave
        ("tq", 16, 128, 512, 16, None, (12, 168, False, False, False)),  # 16 heads a kv head: the decode kernel
        ("tq", 4, 128, 512, 32, None, (12, None, False, False, False)),  # another tile: the decode kernel
        ("q8", 4, 128, 512, 64, 2, (6, None, False, False, False)),
        ("fp8", 4, 128, 512, 32, None, (8, None, False, False, False)),  # one-warp programs
        ("fp8", 4, 128, 8, 64, None, (4, None, False, False, False)),  # a small grid: four warps
    ],
)
def test_programs_plan_a_launch(kind, G, D, pairs, block_n, warps, expected):
    """Programs a multiprocessor, register cap, stacked rows, raw codes and the kernel of
    swapped roles."""
    assert gluon_plan.programs(kind, G, D, pairs, block_n, warps) == expected


def test_programs_plan_the_swapped_kernel_where_asked():
    """``swap`` True: wherever the kernel of swapped roles takes the launch (q4's raw one-warp
    ones too, and q4_g32's of any grid); False: nowhere, TurboQuant's default launch back on the
    decode kernel's cap and programs, q4_g32's small grids on the decode kernel."""
    assert gluon_plan.programs("q4", 4, 128, 512, 32, None, True).swap
    assert not gluon_plan.programs("q4", 4, 128, 8, 32, None, True).swap  # B=1: not raw
    assert not gluon_plan.programs("q8", 4, 128, 512, 64, None, True).swap
    assert gluon_plan.programs("tq", 4, 128, 512, 16, None, False) == (12, 168, False, False, False)
    assert gluon_plan.programs("tq", 4, 128, 512, 16, None, True) == (16, 128, False, False, True)
    assert gluon_plan.programs("q4_g32", 4, 128, 512, 32, None, True) == (16, 128, False, True, True)
    assert gluon_plan.programs("q4_g32", 4, 128, 8, 32, None, False) == (8, None, False, False, False)


def test_asking_for_it_where_it_cannot_run_names_the_reason():
    c, q, qs = _case("q8", 2, 4, 1, 64, [20, 7], torch.float16 if ON_GPU else torch.float32)
    if ON_GPU:  # 32 query heads a kv head: more than the tile's 16 rows
        c, q, qs = _case("q8", 1, 32, 1, 64, [20], torch.bfloat16)
    with pytest.raises(ValueError, match="decode_kernel='gluon' cannot take this step: .*leave decode_kernel unset"):
        _attend(c, q, qs, decode_kernel="gluon")


@pytest.mark.skipif(IN_PROCESS and not gluon_decode.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("cc, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_pages_need_compute_capability_8_9(monkeypatch, cc, refused):
    """The kernel's e4m3 pairs' conversion does not assemble for sm_80 (``benchmarks/tools/
    gluon_offline.py --arch 80``): below 8.9 fp8 pages are refused by name, and go to the MMA
    kernel without a failed compile; q8 pages are taken on every one of these GPUs."""
    monkeypatch.setattr(gluon_decode, "capability", lambda device: cc)
    c, q, _ = _case("fp8", 1, 4, 1, 64, [20], torch.bfloat16)
    why = gluon_decode.supported(*_formats(c), q, 4, c["kp"])
    assert (why == f"fp8 pages need compute capability 8.9+ (this GPU: {cc[0]}.{cc[1]})") if refused else why is None
    c, q, _ = _case("q8", 1, 4, 1, 64, [20], torch.bfloat16)
    assert gluon_decode.supported(*_formats(c), q, 4, c["kp"]) is None


@pytest.mark.parametrize("plan", [dict(num_stages=1), dict(block_n=8), dict(block_n=256), dict(num_warps=8)])
def test_a_plan_it_cannot_run_is_refused_by_name(plan):
    c, q, qs = _case("q8", 2, 4, 1, 64, [20, 7], torch.bfloat16 if ON_GPU else torch.float32)
    with pytest.raises(ValueError, match=r"takes block_n 16, 32, 64 or 128, num_stages >= 2 .* and num_warps 1, 2 "
                                         r"or 4, got .*leave them unset"):
        _attend(c, q, qs, decode_kernel="gluon", **plan)


def test_a_default_launch_that_fails_hands_its_pages_to_the_mma_kernel(monkeypatch):
    """Where the kernel compiles or launches badly (another GPU, another Triton), q8 decode steps
    go on on the MMA kernel: one warning, the same result as asking for that kernel, never tried again."""
    c, q, qs = _case("q8", 2, 8, 2, 64, [40, 17], torch.bfloat16 if ON_GPU else torch.float32)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(triton_attention, "GLUON_DECODE", {"q8": None})
    monkeypatch.setattr(gluon_decode, "FAILED", {})
    monkeypatch.setattr(gluon_decode, "supported", lambda *a, **k: None)  # as on a GPU it can run on
    monkeypatch.setattr(gluon_decode, "_step", broken)
    with pytest.warns(RuntimeWarning, match="Gluon decode kernel failed on q8 pages .*out of resources"):
        out = _attend(c, q, qs)
    torch.testing.assert_close(out, _attend(c, q, qs, decode_kernel="mma"), atol=0, rtol=0)
    assert calls == [1] and "RuntimeError" in gluon_decode.FAILED["q8"]
    _attend(c, q, qs)  # no second attempt, no second warning
    assert calls == [1]
    with pytest.raises(RuntimeError, match="out of resources"):  # asked for by name: the error itself
        _attend(c, q, qs, decode_kernel="gluon")


@pytest.mark.parametrize("plan", [dict(block_n=128), dict(num_stages=3), dict(num_warps=8), dict(block_m=32),
                                  dict(int8_queries=False), dict(decode_kernel="mma")])
def test_a_config_with_the_mma_kernels_settings_stays_on_it(monkeypatch, plan):
    """Tiles, stages, warps or fp16 operands set in a LaunchConfig are the MMA kernel's: such a
    launch is not sent here by default; one that sets only splits is."""
    c, q, qs = _case("q8", 2, 4, 1, 64, [20, 7], torch.bfloat16 if ON_GPU else torch.float32)
    calls = []
    monkeypatch.setattr(triton_attention, "GLUON_DECODE", {"q8": None})
    monkeypatch.setattr(gluon_decode, "supported", lambda *a, **k: None)
    monkeypatch.setattr(gluon_decode, "_step", lambda *a, **k: calls.append(1) or torch.zeros_like(q))
    _attend(c, q, qs, **plan)
    assert calls == []
    assert (_attend(c, q, qs, num_splits=2) == 0).all() and calls == [1]


@pytest.mark.parametrize("mode", ["q8", "q4", "fp8", "q4_g32", "fp", TQ])
def test_the_default_kinds_and_limited_ones_only_in_small_launches(monkeypatch, mode):
    """q8, q4, fp8, q4_g32 and TurboQuant decode steps go here by default, whatever the launch's
    size; 16-bit ones only while the launch has at most GLUON_DECODE["fp"] (row, kv head) pairs
    (they lost to the MMA kernel at B=64 / 8k)."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    calls = []
    monkeypatch.setattr(gluon_decode, "supported", lambda *a, **k: None)
    def step(q, *a, out_dtype, **k):  # TurboQuant's output is float32 until it leaves the rotated domain
        return calls.append(q.shape[0]) or torch.zeros(q.shape, dtype=out_dtype, device=q.device)

    monkeypatch.setattr(gluon_decode, "_step", step)
    assert triton_attention.GLUON_DECODE["tq" if mode == TQ else mode] is None or mode == "fp"
    monkeypatch.setitem(triton_attention.GLUON_DECODE, "fp", 4)
    for B in (2, 3):  # 4 and 6 pairs
        c, q, qs = _case(mode, B, 4, 2, 64, [20] * B, dtype)
        _attend(c, q, qs)
    assert calls == ([2] if mode == "fp" else [2, 3])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize(
    "B, Hq, H_kv, D, lengths, splits",
    [
        (3, 4, 1, 64, [1, 17, 45], None),  # one key, a page edge + 1, a few pages
        (2, 8, 2, 128, [70, 33], 3),  # GQA 4, three splits merged
        (2, 16, 1, 128, [300, 129], 2),  # 16 query heads a kv head (the tile's rows)
        (3, 12, 4, 64, [5, 200, 64], 4),  # GQA 3 (rows padded), a split past a row's end
    ],
)
@pytest.mark.parametrize("block_n, stages, warps", [(64, 4, 4), (32, 2, 4), (128, 3, 4), (16, 3, 1), (32, 2, 1),
                                                     (32, 2, 2), (64, 2, 2)])
@pytest.mark.parametrize(
    "mode, dtype",
    [("q8", torch.bfloat16), ("q4", torch.bfloat16), ("fp8", torch.bfloat16), ("q4_g32", torch.bfloat16),
     ("fp", torch.bfloat16), ("fp", torch.float16), ("q4", torch.float16), ("q4_g32", torch.float16)],
)  # fmt: skip
def test_gpu_matches_the_reference(B, Hq, H_kv, D, lengths, splits, block_n, stages, warps, mode, dtype):
    c, q, qs = _case(mode, B, Hq, H_kv, D, lengths, dtype)
    if mode == "fp" and block_n == 128:
        stages = 2  # 16-bit tiles of 128 keys: three stages would not fit a multiprocessor's shared memory
    _check_against_references(c, q, qs, mode, TOL[dtype], num_splits=splits, block_n=block_n, num_stages=stages,
                              num_warps=warps)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize(
    "B, Hq, H_kv, D, lengths, splits",
    [(3, 4, 1, 64, [1, 17, 45], None), (2, 8, 2, 128, [70, 33], 3), (2, 16, 1, 128, [300, 129], 2),
     (3, 12, 4, 64, [5, 200, 64], 4)],
)
@pytest.mark.parametrize("block_n, stages, warps, dtype", [(16, 2, 1, torch.bfloat16), (64, 3, 4, torch.bfloat16),
                                                            (32, 2, 1, torch.float16)])
def test_gpu_turboquant_matches_the_reference(B, Hq, H_kv, D, lengths, splits, block_n, stages, warps, dtype):
    """TurboQuant's default pages (8-bit keys; 3-bit values, whose groups of 32 codes straddle
    int32 words) on the shapes above, at its default tile and others."""
    c, q, qs = _case(TQ, B, Hq, H_kv, D, lengths, dtype)
    _check_against_references(c, q, qs, TQ, TOL[dtype], num_splits=splits, block_n=block_n, num_stages=stages,
                              num_warps=warps)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize(
    "B, Hq, H_kv, D, lengths, splits",
    [
        (8, 16, 4, 128, [1, 17, 45, 300, 129, 64, 33, 250], 3),  # GQA 4: four groups of four heads
        (16, 16, 2, 64, [90, 257, 5, 16] * 4, None),  # GQA 8 at head_dim 64: two groups of eight heads
    ],
)
@pytest.mark.parametrize("plan", [{}, dict(block_n=16, num_stages=3, num_warps=1), dict(block_n=32, num_warps=1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_q4_g32_stacked_rows_match_the_reference(B, Hq, H_kv, D, lengths, splits, plan, dtype):
    """q4_g32 launches whose groups of channels stack the heads in the rows (32 pairs or more),
    at the default plan and at one-warp plans asked for."""
    assert gluon_plan.programs("q4_g32", Hq // H_kv, D, B * H_kv, plan.get("block_n", 32),
                                 plan.get("num_warps"))[2]  # fmt: skip
    c, q, qs = _case("q4_g32", B, Hq, H_kv, D, lengths, dtype)
    _check_against_references(c, q, qs, "q4_g32", TOL[dtype], num_splits=splits, **plan)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize(
    "B, Hq, H_kv, D, lengths, splits",
    [
        (3, 4, 1, 64, [1, 17, 45], None),  # one key (one tile: only the scores before the loop), a few pages
        (2, 8, 2, 128, [70, 33], 3),  # three splits merged
        (3, 12, 4, 64, [5, 200, 64], 4),  # GQA 3, a split past a row's end (no tile)
        (8, 16, 4, 128, [1, 17, 45, 300, 129, 64, 33, 250], 3),  # q4_g32 stacked (32 pairs)
    ],
)
@pytest.mark.parametrize("plan", [{}, dict(num_stages=4), dict(block_n=16, num_stages=3, num_warps=1),
                                  dict(block_n=64, num_stages=3, num_warps=4)])
@pytest.mark.parametrize("mode", ["q8", "q4", "fp8", "q4_g32", "fp", TQ])
def test_gpu_tiles_scored_ahead_match_the_reference(monkeypatch, B, Hq, H_kv, D, lengths, splits, plan, mode):
    """Each tile's scores computed an iteration ahead (``AHEAD``: the ring's third stage), every
    page kind, at the default tiles and others."""
    monkeypatch.setattr(gluon_decode, "AHEAD", True)
    c, q, qs = _case(mode, B, Hq, H_kv, D, lengths, torch.bfloat16)
    _check_against_references(c, q, qs, mode, TOL[torch.bfloat16], num_splits=splits, **plan)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize(
    "B, Hq, H_kv, D, lengths, splits",
    SHAPES + [(8, 16, 4, 128, [1, 17, 45, 300, 129, 64, 33, 250], 3)],  # q4_g32 stacked (32 pairs)
)
@pytest.mark.parametrize("plan", [{}, dict(block_n=16, num_stages=3, num_warps=1), dict(block_n=64, num_warps=4)])
@pytest.mark.parametrize("mode, dtype", [("q4", torch.bfloat16), ("q4", torch.float16), ("q4_g32", torch.bfloat16),
                                         ("q4_g32", torch.float16)])
def test_gpu_raw_nibbles_match_the_reference(monkeypatch, B, Hq, H_kv, D, lengths, splits, plan, mode, dtype):
    """Codes as operands as they lie (fp16 subnormals), the dots scaled back (``RAW``): q4's
    keys and values, stacked q4_g32's keys and values."""
    monkeypatch.setattr(gluon_decode, "RAW", True)
    c, q, qs = _case(mode, B, Hq, H_kv, D, lengths, dtype)
    _check_against_references(c, q, qs, mode, TOL[dtype], num_splits=splits, **plan)


class _Launches:
    """Stands in for a Gluon kernel: counts its launches and passes them on."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize(
    "B, Hq, H_kv, D, lengths, splits",
    SHAPES + [(4, 32, 4, 128, [300, 1, 129, 64], 3)],  # eight heads a kv head
)
@pytest.mark.parametrize("plan", [{}, dict(block_n=16, num_stages=3, num_warps=1), dict(block_n=64, num_warps=1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["q4", "q4_g32"])
def test_gpu_swapped_roles_match_the_reference(monkeypatch, B, Hq, H_kv, D, lengths, splits, plan, dtype, mode):
    """q4 and q4_g32 on the kernels of swapped roles (``SWAP``, :mod:`kvtier.kernels.gluon_swap`:
    keys and channels down the dots' rows, query rows across), raw codes, one warp: against SDPA
    over the decoded pages and the MMA kernel, and it is that kernel that ran (q4_g32: up to four
    heads a kv head; eight go to the decode kernel)."""
    from kvtier.kernels import gluon_swap

    monkeypatch.setattr(gluon_decode, "SWAP", True)
    monkeypatch.setattr(gluon_decode, "RAW", True)
    name = {"q4": "swap_q4_kernel", "q4_g32": "swap_q4g32_kernel"}[mode]
    launches = _Launches(getattr(gluon_swap, name))
    monkeypatch.setattr(gluon_swap, name, launches)
    c, q, qs = _case(mode, B, Hq, H_kv, D, lengths, dtype)
    _check_against_references(c, q, qs, mode, TOL[dtype], num_splits=splits, **plan)
    assert (launches.count > 0) == (mode == "q4" or Hq // H_kv <= 4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["q4", "q4_g32"])
def test_gpu_swapped_roles_see_only_the_keys_up_to_the_query(monkeypatch, mode):
    """``q_start`` below ``kv_len - 1`` on the kernels of swapped roles."""
    monkeypatch.setattr(gluon_decode, "SWAP", True)
    monkeypatch.setattr(gluon_decode, "RAW", True)
    c, q, _ = _case(mode, 3, 8, 2, 128, [300, 64, 200], torch.bfloat16)
    qs = torch.tensor([9, 63, 150], dtype=torch.int64, device=DEVICE)
    _check_against_references(c, q, qs, mode, TOL[torch.bfloat16], num_splits=3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("swap", [None, False])
@pytest.mark.parametrize(
    "B, Hq, H_kv, D, lengths, splits",
    SHAPES + [(4, 32, 4, 128, [300, 1, 129, 64], 3)],  # eight heads a kv head
)
def test_gpu_turboquant_runs_on_the_swapped_kernel_by_default(monkeypatch, B, Hq, H_kv, D, lengths, splits, swap):
    """TurboQuant's default launch runs on the kernel of swapped roles (``SWAP`` ``None``), and
    on the decode kernel when it is turned off (``False``); both against SDPA over the decoded
    pages and the MMA kernel."""
    from kvtier.kernels import gluon_swap

    monkeypatch.setattr(gluon_decode, "SWAP", swap)
    launches = _Launches(gluon_swap.swap_tq_kernel)
    monkeypatch.setattr(gluon_swap, "swap_tq_kernel", launches)
    c, q, qs = _case(TQ, B, Hq, H_kv, D, lengths, torch.bfloat16)
    _check_against_references(c, q, qs, TQ, TOL[torch.bfloat16], num_splits=splits)
    assert (launches.count > 0) == (swap is None)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("swap", [None, False])
@pytest.mark.parametrize(
    "B, Hq, H_kv, D, lengths, splits",
    SHAPES[:3] + [(1, 32, 8, 128, [4000], None), (2, 16, 2, 128, [300, 1], 3)],  # (fewer than 32 pairs)
)
def test_gpu_q4_g32_small_grids_run_on_the_swapped_kernel_by_default(monkeypatch, B, Hq, H_kv, D, lengths, splits,
                                                                     swap):  # fmt: skip
    """q4_g32's default launches of fewer than ``SMALL_GRID`` pairs run on the kernel of swapped
    roles (``SWAP`` ``None``; eight heads a kv head on the decode kernel), and on the decode
    kernel when it is turned off (``False``); both against SDPA over the decoded pages and the
    MMA kernel."""
    from kvtier.kernels import gluon_swap

    monkeypatch.setattr(gluon_decode, "SWAP", swap)
    launches = _Launches(gluon_swap.swap_q4g32_kernel)
    monkeypatch.setattr(gluon_swap, "swap_q4g32_kernel", launches)
    c, q, qs = _case("q4_g32", B, Hq, H_kv, D, lengths, torch.bfloat16)
    _check_against_references(c, q, qs, "q4_g32", TOL[torch.bfloat16], num_splits=splits)
    assert (launches.count > 0) == (swap is None and Hq // H_kv <= 4)


def test_the_swapped_kernel_refuses_what_it_does_not_take():
    """Only q4's raw and TurboQuant's one-warp launches of up to 8 heads a kv head, and q4_g32's
    of up to 4 at head_dim 64 or 128: anything else asked of it is refused before a launch,
    naming it."""
    from kvtier.kernels import gluon_swap

    assert gluon_swap.takes("q4", True, 1, False, 4) and gluon_swap.takes("q4", True, 1, False, 8)
    assert gluon_swap.takes("tq", False, 1, False, 4)
    assert gluon_swap.takes("q4_g32", False, 1, False, 4) and gluon_swap.takes("q4_g32", True, 1, False, 3, 64)
    for args in [("q8", True, 1, False, 4), ("q4", False, 1, False, 4), ("q4", True, 4, False, 4),
                 ("q4", True, 1, True, 4), ("q4", True, 1, False, 16), ("q4_g32", True, 1, False, 8),
                 ("q4_g32", True, 1, False, 4, 32), ("q4_g32", True, 1, False, 4, 256), ("q4_g32", True, 2, False, 4),
                 ("q4_g32", True, 1, True, 4),
                 ("tq", False, 4, False, 4), ("tq", False, 1, True, 4), ("tq", False, 1, False, 16)]:
        assert not gluon_swap.takes(*args), args
    q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    pages, scales = torch.zeros(2, 16, 1, 64, dtype=torch.uint8), torch.zeros(2, 16, 1, 1)
    with pytest.raises(ValueError, match="swapped kernel takes q4's raw and TurboQuant's one-warp launches.*q8 pages"):
        gluon_decode.launch_decode(q, pages, pages, scales, scales, torch.zeros(1, 2, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), None, 32, q, q, q, kind="q8", qk_scale=1.0,
                                   splits=1, split_len=32, block_n=32, warps=1, raw=True, swap=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("B, L, splits", [(64, 8192, None), (8, 16384, None), (1, 4096, None), (4, 3000, 5)])
@pytest.mark.parametrize("mode", ["q8", "q4", "fp8", "q4_g32", "fp", TQ])
def test_gpu_long_rows(B, L, splits, mode):
    """The H200's shapes (32/8 heads, head_dim 128), rows of unequal lengths."""
    lengths = [L - 37 * b for b in range(B)]
    c, q, qs = _case(mode, B, 32, 8, 128, lengths, torch.bfloat16)
    _check_against_references(c, q, qs, mode, TOL[torch.bfloat16], num_splits=splits)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["q8", "q4", "fp8", "q4_g32", "fp", TQ, "turboquant:q8_0r,q3_0"])
def test_gpu_a_query_inside_the_cache_sees_only_the_keys_up_to_its_place(mode):
    """``q_start`` below ``kv_len - 1``: the query at position q_start sees keys 0 .. q_start."""
    c, q, _ = _case(mode, 3, 8, 2, 128, [300, 64, 200], torch.bfloat16)
    qs = torch.tensor([9, 63, 150], dtype=torch.int64, device=DEVICE)
    _check_against_references(c, q, qs, mode, TOL[torch.bfloat16], num_splits=3)
    whole = _attend(c, q, c["kv_len"] - 1, decode_kernel="gluon", num_splits=3)
    limited = _attend(c, q, qs, decode_kernel="gluon", num_splits=3)
    assert (whole[0] - limited[0]).abs().max() > 1e-2  # the limit is there, and this test can see it
    torch.testing.assert_close(whole[1], limited[1], atol=0, rtol=0)  # row 1's query is at its end


def _grown_keys(mode, factor, *, jump=7, pages=20):
    """One row of ``pages`` pages whose keys from page ``jump`` on are ``factor`` times larger (their
    scales and zeros; 16-bit pages themselves), and how far each query head's highest score (log2
    units, as the kernel's) rises past its highest before the jump."""
    c, q, qs = _case(mode, 1, 8, 2, 128, [16 * pages], torch.bfloat16)
    ids = c["table"][0, jump:pages].long()
    if mode == "fp":
        c["kp"][ids] *= factor
    for t in c["ks"].values():  # scales and zeros
        t[ids] *= factor
    K = torch.cat([c["kc"].decode(c["kp"][i], {n: t[i] for n, t in c["ks"].items()}) for i in c["table"][0].long()])
    s = torch.einsum("hgd,lhd->hgl", q[0, :, 0].float().view(2, 4, 128), K.float()) / (math.log(2) * 128**0.5)
    return c, q, qs, (s.amax(-1) - s[..., : 16 * jump].amax(-1)).flatten()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["q8", "q4", "fp8", "q4_g32", "fp", TQ])
def test_gpu_a_maximum_that_grows_mid_row_rescales_what_came_before(mode):
    """Keys three times larger from page 7 of 20 on: some query heads' highest scores rise by 2^9 or
    more mid-row, others by less than 2^8 (the tile's rows rescale together), and the keys before
    the rise still weigh in. One split: the rise lands inside a program's loop."""
    c, q, qs, rise = _grown_keys(mode, 3.0)
    assert rise.max() > 9 and rise.min() < 8
    _check_against_references(c, q, qs, mode, TOL[torch.bfloat16], num_splits=1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["q8", "q4", "q4_g32", TQ])
def test_gpu_replays_in_a_cuda_graph(mode):
    c, q, qs = _case(mode, 4, 32, 8, 128, [4000, 3000, 17, 1], torch.bfloat16)
    eager = _attend(c, q, qs, decode_kernel="gluon")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _attend(c, q, qs, decode_kernel="gluon")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _attend(c, q, qs, decode_kernel="gluon")
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


@pytest.mark.parametrize("plan, swap, cap, swapped", [
    ({}, None, 128, True), (dict(num_splits=2), None, 128, True),
    ({}, False, 168, False),  # the decode kernel's programs
    (dict(block_n=32), None, None, False), (dict(num_warps=4), None, None, False)])
def test_turboquant_default_tiles_are_launched_under_their_register_cap(monkeypatch, plan, swap, cap, swapped):
    """TurboQuant's 16-key one-warp programs run on the kernel of swapped roles, compiled at most
    128 registers a thread (sixteen programs a multiprocessor, as its plan assumes), or on the
    decode kernel at 168 (twelve) when that is turned off; another tile or other warps asked by
    name are not capped and not swapped."""
    monkeypatch.setattr(gluon_decode, "SWAP", swap)
    c, q, qs = _case(TQ, 2, 8, 2, 64, [40, 17], torch.bfloat16)
    seen = []
    monkeypatch.setattr(gluon_decode, "launch_decode", lambda *a, **k: seen.append(k))
    monkeypatch.setattr(triton_attention, "merge_splits", lambda *a, **k: None)  # no partials were written
    monkeypatch.setattr(triton_paged, "rotate_back", lambda x, rotation, dtype: x.to(dtype))  # nor an output
    monkeypatch.setattr(gluon_decode, "supported", lambda *a, **k: None)
    _attend(c, q, qs, decode_kernel="gluon", **plan)
    assert [(k["maxnreg"], k["swap"]) for k in seen] == [(cap, swapped)]


def test_turboquant_pages_left_out_of_gluon_decode_go_to_their_family_kernel(monkeypatch):
    """GLUON_DECODE comes before QUANT_DECODE_KERNEL: without "tq" in it, TurboQuant's steps go
    to the family's kernel (the CUDA-core one), with its exact result."""
    c, q, qs = _case(TQ, 2, 8, 2, 64, [40, 17], torch.bfloat16 if ON_GPU else torch.float32)
    calls = []
    monkeypatch.setattr(gluon_decode, "supported", lambda *a, **k: None)
    monkeypatch.setattr(gluon_decode, "_step", lambda *a, **k: calls.append(1))
    monkeypatch.delitem(triton_attention.GLUON_DECODE, "tq")
    out = _attend(c, q, qs)
    assert calls == []
    torch.testing.assert_close(out, _attend(c, q, qs, decode_kernel="cuda_core"), atol=0, rtol=0)


@pytest.mark.parametrize("ahead, plan, launched", [
    (True, {}, (True, 3)), (True, dict(num_stages=4), (True, 4)), (True, dict(num_stages=2), (False, 2)),
    (False, {}, (False, 2)), (False, dict(num_stages=3), (False, 3)),
    (None, {}, (False, 2)),  # not ahead by default
])  # fmt: skip
def test_tiles_scored_ahead_take_a_third_stage(monkeypatch, ahead, plan, launched):
    """A launch that scores its tiles ahead runs a ring of three stages unless more are asked
    for; asked for two, it scores each tile in its own iteration."""
    c, q, qs = _case("q4", 2, 8, 2, 64, [40, 17], torch.bfloat16)
    seen = []
    monkeypatch.setattr(gluon_decode, "AHEAD", ahead)
    monkeypatch.setattr(gluon_decode, "launch_decode", lambda *a, **k: seen.append((k["ahead"], k["stages"])))
    monkeypatch.setattr(triton_attention, "merge_splits", lambda *a, **k: None)  # no partials were written
    monkeypatch.setattr(gluon_decode, "supported", lambda *a, **k: None)
    _attend(c, q, qs, decode_kernel="gluon", **plan)
    assert seen == [launched]


@pytest.mark.parametrize("mode, plan", [("q4", {}), ("q8", dict(num_splits=3)), ("q4_g32", dict(block_n=16)),
                                        (TQ, {})])
def test_a_step_launches_and_merges_its_plan(monkeypatch, mode, plan):
    """A step's launch and split merge take :func:`gluon_plan.plan`'s tile, warps, ring, splits and
    variant for its shape."""
    c, q, qs = _case(mode, 2, 8, 2, 64, [40, 17], torch.bfloat16)
    seen = {}
    monkeypatch.setattr(gluon_decode, "launch_decode", lambda *a, **k: seen.update(launch=(a[8], k)))
    monkeypatch.setattr(triton_attention, "merge_splits", lambda *a: seen.update(merge=a[3:]))
    monkeypatch.setattr(triton_paged, "rotate_back", lambda x, rotation, dtype: x.to(dtype))
    monkeypatch.setattr(gluon_decode, "supported", lambda *a, **k: None)
    _attend(c, q, qs, decode_kernel="gluon", **plan)
    capacity, k = seen["launch"]
    kind = "tq" if mode == TQ else mode
    p = gluon_plan.plan(kind, 2, 8, 2, 64, capacity, q.device, LaunchConfig(decode_kernel="gluon", **plan))
    assert (k["splits"], k["split_len"], k["block_n"], k["stages"], k["warps"], k["ahead"]) == (
        p.splits, p.split_len, p.block_n, p.stages, p.warps, p.ahead)
    assert (k["maxnreg"], k["stack"], k["raw"], k["swap"]) == (p.launch.maxnreg, p.launch.stack, p.launch.raw,
                                                               p.launch.swap)
    assert seen["merge"] == (p.splits, p.base, p.split_len, p.block_n)
