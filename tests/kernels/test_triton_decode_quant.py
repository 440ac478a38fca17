"""The CUDA-core decode kernel for quantised pages against the references.

``kvtier.kernels.triton_decode_quant`` serves one decode step (one query token
per row) over quantised pages when ``LaunchConfig(decode_kernel="cuda_core")``
(or ``QUANT_DECODE_KERNEL``) picks it. Each test forces it and compares with SDPA
over the decoded K/V gathered row by row and with ``paged_attention_reference``,
as ``tests/kernels/test_triton_paged.py`` does for the MMA kernel. Without CUDA the
kernels run under Triton's interpreter on small shapes; with CUDA the
``gpu``-marked grid adds long rows and every mode.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_paged import (  # the same cache builder and references as the MMA kernel's tests
    DEVICE,
    IN_PROCESS,
    ON_GPU,
    QUANT_MODES,
    build_cache,
    gathered_reference,
)

from triton_support import in_this_process_or_a_fresh_one

if IN_PROCESS:
    import triton
    import triton.language as tl

    from kvtier.kernels import triton_attention
    from kvtier.kernels.paged import paged_attention_reference
    from kvtier.kernels.triton_attention import LaunchConfig, uses_cuda_core_decode
    from kvtier.kernels.triton_decode_quant import decode_supported, key_lanes
    from kvtier.kernels.triton_paged import paged_attention_triton
    from kvtier.kernels.triton_quant import (
        _asm_e4m3_to_f16,
        _asm_int8_to_f16,
        _asm_nibbles_to_f16,
        codes_to_float,
        page_format,
    )

TOL = 2e-2  # bf16 queries and output


_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)


def run_decode(mode, B, Hq, H_kv, D, page, lengths, *, q_start=None, kernel="cuda_core", **cfg):
    """One decode step through ``kernel``; checked against both references; returns (out, cache, q, q_start)."""
    c = build_cache(mode, B, H_kv, D, page, lengths, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, 1, D, generator=gen).to(torch.bfloat16).to(DEVICE)
    if q_start is None:
        q_start = [max(0, n - 1) for n in lengths]
    qs = torch.tensor(q_start, dtype=torch.int64, device=DEVICE)
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    config = LaunchConfig(decode_kernel=kernel, **cfg)
    out = paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], config=config, **kw)
    assert out.shape == (B, Hq, 1, D) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), gathered_reference(c, q, qs), atol=TOL, rtol=TOL)
    ref = paged_attention_reference(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL, rtol=TOL)
    return out, c, q, qs


def _served_by_cuda_core(c, kernel="cuda_core") -> bool:
    kf = page_format(c["kc"], c["kp"], c["ks"])
    vf = page_format(c["vc"], c["vp"], c["vs"])
    return uses_cuda_core_decode(kf, vf, c["kp"], c["vp"], LaunchConfig(decode_kernel=kernel))


@pytest.mark.parametrize("mode", QUANT_MODES)
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_every_mode(mode, splits):
    # rows of 1 key, a page edge + 1 and a few pages; GQA 4; one split or three
    _, c, _, _ = run_decode(mode, 3, 4, 1, 64, 16, [1, 17, 45], num_splits=splits)
    bits_ok = "q5_0" not in mode and mode != "fp8"  # 5-bit codes and e4m3: the MMA kernel serves them
    assert _served_by_cuda_core(c) == bits_ok


@pytest.mark.parametrize(
    "mode, Hq, H_kv, D, page, lengths, cfg",
    [
        ("q8", 2, 2, 128, 128, [130, 5], {}),  # MHA, head_dim 128, pages of 128
        ("q4_g32", 8, 1, 128, 16, [40, 64], dict(block_n=64, num_warps=2)),  # GQA 8, two warps
        ("turboquant:q8_0,q3_0", 4, 2, 128, 16, [70, 33], dict(block_n=32)),  # the default TurboQuant mode
        ("q4", 3, 1, 32, 16, [29, 2], {}),  # 3 query heads: padded to 4 in registers
        ("turboquant:int2r,q3_0", 4, 1, 256, 16, [20, 9], dict(num_splits=2)),  # head_dim 256
    ],
)
def test_decode_shapes(mode, Hq, H_kv, D, page, lengths, cfg):
    _, c, _, _ = run_decode(mode, len(lengths), Hq, H_kv, D, page, lengths, **cfg)
    assert _served_by_cuda_core(c)


def test_decode_causal_limit_and_empty_row():
    # row 0 sees keys 0..9 of its 30 (a causal limit inside the cache); row 1 has no key
    out, *_ = run_decode("q8", 2, 4, 1, 64, 16, [30, 0], q_start=[9, 0], num_splits=2)
    assert torch.count_nonzero(out[1]) == 0


def test_decode_kernels_agree():
    """The CUDA-core and MMA kernels read the same pages into the same output."""
    mine, c, q, qs = run_decode("turboquant:q4_0,q8_0", 2, 4, 2, 64, 16, [50, 23])
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    mma = paged_attention_triton(
        q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], config=LaunchConfig(decode_kernel="mma"), **kw
    )
    torch.testing.assert_close(mine.float(), mma.float(), atol=TOL, rtol=TOL)


def test_choice_of_decode_kernel(monkeypatch):
    c = build_cache("q8", 1, 1, 64, 16, [5], torch.bfloat16)
    assert _served_by_cuda_core(c, "cuda_core") and not _served_by_cuda_core(c, "mma")
    # the default comes from QUANT_DECODE_KERNEL, per family
    monkeypatch.setitem(triton_attention.QUANT_DECODE_KERNEL, "kv_quant", "cuda_core")
    assert _served_by_cuda_core(c, None)
    monkeypatch.setitem(triton_attention.QUANT_DECODE_KERNEL, "kv_quant", "mma")
    assert not _served_by_cuda_core(c, None)
    # by default only for groups of up to 4 query heads (8 spill); asked for, at any group
    monkeypatch.setitem(triton_attention.QUANT_DECODE_KERNEL, "kv_quant", "cuda_core")
    kf, vf = page_format(c["kc"], c["kp"], c["ks"]), page_format(c["vc"], c["vp"], c["vs"])
    assert not uses_cuda_core_decode(kf, vf, c["kp"], c["vp"], LaunchConfig(), 8)
    assert uses_cuda_core_decode(kf, vf, c["kp"], c["vp"], LaunchConfig(decode_kernel="cuda_core"), 8)
    # full-precision pages never go to it
    fp = build_cache("fp", 1, 1, 64, 16, [5], torch.bfloat16)
    kf, vf = page_format(fp["kc"], fp["kp"], fp["ks"]), page_format(fp["vc"], fp["vp"], fp["vs"])
    assert not decode_supported(kf, vf, 64)
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        LaunchConfig(decode_kernel="tensor")


def test_key_lanes_fill_the_warps():
    """Keys side by side in a tile: the threads over the threads of one row (16 channels each)."""
    assert key_lanes(128, 1) == 4 and key_lanes(128, 4) == 16
    assert key_lanes(256, 1) == 2 and key_lanes(16, 1) == 32 and key_lanes(64, 2) == 16


@triton.jit if IN_PROCESS else (lambda f: f)
def _codes_kernel(U, X, N: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, OFFSET: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(X + i, codes_to_float(tl.load(U + i), BITS, SIGNED, OFFSET))


@pytest.mark.parametrize("bits, signed, offset", [(8, True, 0), (8, False, 0), (4, False, -8), (3, False, 0), (2, False, 0)])
def test_codes_to_float_is_exact(bits, signed, offset):
    """Every code becomes exactly ``code + offset`` (signed codes from any sign extension)."""
    n = 1 << bits
    u = torch.arange(n, dtype=torch.int32)
    if signed:
        u = torch.where(u >= n // 2, u - n, u)  # sign-extended two's complement, as a load gives them
    x = torch.empty(n, dtype=torch.float32, device=DEVICE)
    _codes_kernel[(1,)](u.to(DEVICE), x, N=n, BITS=bits, SIGNED=signed, OFFSET=offset)
    assert torch.equal(x.cpu(), u.to(torch.float32) + offset)


@triton.jit if IN_PROCESS else (lambda f: f)
def _fast_kernel(U, X, Y, N: tl.constexpr, HOW: tl.constexpr):
    i = tl.arange(0, N)
    u = tl.load(U + i)  # uint8
    if HOW == 0:
        x = _asm_int8_to_f16(u.to(tl.int8, bitcast=True), False)
        y = x
    elif HOW == 1:
        x, y = _asm_nibbles_to_f16(u, -8, False)
    elif HOW == 2:
        x, y = _asm_nibbles_to_f16(u, 0, False)
    else:
        x = _asm_e4m3_to_f16(u, False)
        y = x
    tl.store(X + i, x)
    tl.store(Y + i, y)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_fast_conversions_are_exact():
    """The MMA kernel's inline-assembly conversions give every byte's exact value in fp16."""
    u = torch.arange(256, dtype=torch.int32)
    want = {
        0: (torch.where(u >= 128, u - 256, u),) * 2,  # int8 codes (q8)
        1: ((u & 15) - 8, (u >> 4) - 8),  # q4 nibbles, offset -8
        2: (u & 15, u >> 4),  # unsigned nibbles (q4_g32, 4-bit keys)
        3: (u.to(torch.uint8).view(torch.float8_e4m3fn).float(),) * 2,  # e4m3 (NaN at 0x7F, 0xFF)
    }
    for how, (wx, wy) in want.items():
        x = torch.empty(256, dtype=torch.float16, device=DEVICE)
        y = torch.empty_like(x)
        _fast_kernel[(1,)](u.to(torch.uint8).to(DEVICE), x, y, N=256, HOW=how)
        for got, ref in ((x, wx), (y, wy)):
            torch.testing.assert_close(got.cpu().float(), ref.float(), atol=0, rtol=0, equal_nan=True)


# -- the grid on CUDA (each shape is a compile: kept small) -----------------------------------
GPU_DECODE = [
    (mode, page, D, group, lengths)
    for mode in QUANT_MODES
    if mode != "fp8"  # the MMA kernel serves e4m3 pages
    for page, D, group, lengths in [(16, 128, 4, [1, 16, 129, 1000, 4097]), (128, 64, 8, [4097, 33])]
]


@pytest.mark.parametrize("mode, page, D, group, lengths", GPU_DECODE)
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_decode_grid(mode, page, D, group, lengths):
    run_decode(mode, len(lengths), 2 * group, 2, D, page, lengths)
