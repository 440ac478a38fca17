"""One row as integer digits for the one-row Q4_1 and Q8_0 products (kvtier.model.packed_digits).

The digits against the values they stand for (float32's resolution at each block's largest
value, the carries of a digit that rounds up past its range), the products against float64 (as
close as the float32 product of the same weights), every tail of a group of four blocks (Q4_1)
and of a pair (Q8_0), and which builds take them: AVX512-VNNI ones both formats, AVX2 ones (without
AVX-512) Q4_1, and no other.
"""

from __future__ import annotations

import os
import platform

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_packed import _cpu_has, assert_near_exact_product, q4_1_weight, q8_0_weight
from torch import nn

from kvtier.model.packed import PackedLinear

VNNI = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def digits_of(kernels, fmt: str):
    """``kernels``, or a skip where this build's one-row ``fmt`` products stay float32."""
    if fmt not in kernels.digits:
        pytest.skip(f"this build takes no {fmt} digits (Q4_1: AVX512-VNNI or AVX2; Q8_0: AVX512-VNNI)")
    return kernels


def awkward_row(K: int, seed: int = 0) -> torch.Tensor:
    """Random blocks, and blocks of zeros, one value, a single huge value among tiny ones, and
    (block scale exactly 1: max |x| = 127) values whose second digit rounds to 128 and carries,
    and whose third digit carries through the second."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(K, generator=g) * torch.logspace(-4, 3, K // 32).repeat_interleave(32)
    if K >= 128:
        x[:32] = 0.0
        x[32:64] = -2.5
        x[64:96] = torch.randn(32, generator=g) * 1e-6
        x[70] = 3e4
    if K >= 160:
        b = x[128:160]
        b[:] = torch.arange(32) - 16.0
        b[0] = 127.0  # the block's scale: 1
        b[1] = 3 + 127.75 / 256  # second digit 127.75 -> 128: carry
        b[2] = -(3 + 127.75 / 256)
        b[3] = 126.5  # a tie of the first digit, then the second 128: carry
        b[4] = 3 + (127 + 127.5 / 256) / 256  # third digit 127.5 -> 128, carried through the second
    return x


def q8_awkward_row(K: int, seed: int = 0) -> torch.Tensor:
    """awkward_row with Q8_0's carries in the block of scale 1: a third digit that rounds to 256
    and carries through the second into the first, and values whose digits are exact (a
    negative one: the first digit floor(v), the others what lies above it)."""
    x = awkward_row(K, seed)
    if K >= 160:
        b = x[128:160]
        b[1] = 3 + 255 / 256 + 255.75 / 65536  # U2 255.75 -> 256, U1 256: X0 becomes 4
        b[2] = -(3 + 127.75 / 256)  # X0 -4, U1 128, U2 64
        b[3] = 126.5  # X0 126, U1 128
        b[4] = -127.0
    return x


@pytest.mark.parametrize("K", [32, 64, 96, 160, 544, 576, 608, 1536])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_digits_hold_each_value_to_float32s_resolution_at_its_blocks_largest(kernels, fmt, K):
    x = (awkward_row if fmt == "q4_1" else q8_awkward_row)(K, seed=K)
    back = digits_of(kernels, fmt).digits_back(x, fmt)
    top = x.abs().reshape(-1, 32).amax(-1).repeat_interleave(32).double()
    err = (back.double() - x.double()).abs()
    # 2^-17 of the first digit's unit (2^-24 of the block's largest), v's rounding, the cast back
    assert (err <= 2.0 ** -22 * top).all(), (err / top.clamp_min(1e-30)).max()
    if K >= 128:
        assert torch.equal(back[:32], torch.zeros(32)) and torch.equal(back[32:64], x[32:64])
    if K >= 160 and fmt == "q4_1":
        assert torch.equal(back[128:132], x[128:132])  # a carry: each of these exactly
        # two carries: 3 + 127/256 + 128/65536, the third digit's rounding (half its unit) away
        assert back[132] - x[132] == 2.0 ** -17
    if K >= 160 and fmt == "q8_0":
        assert torch.equal(back[128:129], x[128:129]) and torch.equal(back[130:133], x[130:133])
        assert back[129] == 4.0 and back[129] - x[129] == 2.0 ** -18  # both carries, U2's rounding


@pytest.mark.parametrize("N", [1, 2, 7, 64])
@pytest.mark.parametrize("K", [32, 64, 96, 128, 160, 544, 576, 608, 1536])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_one_row_products_are_the_exact_product_to_float32_rounding(kernels, fmt, N, K):
    """Every tail of a group of four blocks (Q4_1: K / 32 = 4 q + 0..3) and of a pair (Q8_0: K / 32
    odd) and an odd last output; within the float32 product's own bound and, over 64 outputs of a
    model's widths (K >= 512), no further from float64 than 1.5 times the float32 product of the
    same weights. Q4_1: 0.3-0.8x its error here; at K = 96 the digits' resolution, relative to
    each block's largest value, dominates: 3.6x. Q8_0: 1.0-1.5x, as its blocks do not cancel as
    Q4_1's centred ones do."""
    w = (q4_1_weight if fmt == "q4_1" else q8_0_weight)(N, K, seed=N + K)[0]
    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    packed = PackedLinear.from_linear(lin, fmt, kernels)
    row = awkward_row if fmt == "q4_1" else q8_awkward_row
    x = row(K, seed=K + 1).view(1, K) if K >= 160 else torch.randn(1, K)
    y = packed(x)
    assert_near_exact_product(y, x, w)
    exact = x.double() @ w.double().T
    f32 = (x @ w.T).double()
    if N == 64 and K >= 512:
        assert (y.double() - exact).norm() <= 1.5 * (f32 - exact).norm()


@pytest.mark.parametrize("scale", [1e-20, 1e-31, 1e-36, 1e-40, 1e30])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_rows_of_tiny_or_huge_values_keep_float32s_precision(kernels, fmt, scale):
    """A row whose values are all tiny: its blocks' scales would fall among float32's subnormals
    (and 127 / max past its largest float), so the digits take the row at 2^64 times and the
    products at 2^-64 (before, a row of 1e-36s came out 34% wrong, of 1e-37s 100%). Huge rows
    as they are. Against float64, within the float32 product's own bound."""
    w = (q4_1_weight if fmt == "q4_1" else q8_0_weight)(16, 576)[0]
    lin = nn.Linear(576, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(7)) * scale
    y = PackedLinear.from_linear(lin, fmt, kernels)(x)
    assert_near_exact_product(y, x, w)
    if fmt in kernels.digits and scale >= 1e-37:  # (1e-40s are subnormal: the digits hold them as they are)
        back = kernels.digits_back(x[0], fmt)
        top = x[0].abs().reshape(-1, 32).amax(-1).repeat_interleave(32).double()
        assert ((back.double() - x[0].double()).abs() <= 2.0 ** -22 * top).all()


def test_the_default_build_takes_the_digits_where_the_cpu_has_vnni_or_avx2(kernels):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 flags")
    if _cpu_has(*VNNI):
        assert kernels.digits == ("q4_1", "q8_0")
    elif _cpu_has("avx2", "fma", "f16c") and not _cpu_has("avx512f"):
        assert kernels.digits == ("q4_1",) and kernels.lanes == 8
    else:
        assert kernels.digits == ()
    for fmt in ("q4_1", "q8_0"):  # digits_back answers for exactly the formats named
        assert (kernels.digits_back(torch.randn(64), fmt) is None) == (fmt not in kernels.digits)


def one_row_product(w: torch.Tensor, fmt: str, kernels, x: torch.Tensor) -> torch.Tensor:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return PackedLinear.from_linear(lin, fmt, kernels)(x)


def assert_no_digits_in_a_build(flags: tuple[str, ...], lanes: int):
    """The kernels built with ``flags``: ``lanes`` wide, no digits (digits_back says so), and each
    format's one-row product within the float32 product's bound; returns the kernels."""
    from kvtier.kernels.native import build_library
    from kvtier.model.packed import _C_SOURCE, PackedKernels

    plain = PackedKernels(build_library("packed", _C_SOURCE, flags))
    assert plain.digits == () and plain.lanes == lanes
    assert plain.digits_back(torch.randn(64)) is None and plain.digits_back(torch.randn(64), "q8_0") is None
    x = torch.randn(1, 576)
    for fmt, w in (("q4_1", q4_1_weight(33, 576)[0]), ("q8_0", q8_0_weight(33, 576)[0])):
        assert_near_exact_product(one_row_product(w, fmt, plain, x), x, w)
    return plain


def test_a_build_without_vnni_keeps_the_float32_products():
    """``-mno-avx512vnni``: the AVX-512 float32 loop, no digits, the same products to float32
    rounding."""
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has("avx512f"):
        pytest.skip("an AVX-512 build")
    assert_no_digits_in_a_build(("-mno-avx512vnni",), 16)


def test_an_avx2_build_without_digits_keeps_the_float32_products(kernels):
    """``-DKV_NO_DIGITS`` (the switch the benchmarks compare with): the AVX2 float32 loop, and the
    digits' Q4_1 products within float32 rounding of it and of float64."""
    if platform.machine() not in ("x86_64", "AMD64") or kernels.lanes != 8:
        pytest.skip("an AVX2 build")
    plain = assert_no_digits_in_a_build(("-DKV_NO_DIGITS",), 8)
    w, x = q4_1_weight(33, 576)[0], torch.randn(1, 576)
    y_digits = one_row_product(w, "q4_1", kernels, x)
    assert_near_exact_product(y_digits, x, w)
    torch.testing.assert_close(y_digits, one_row_product(w, "q4_1", plain, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_value_that_is_not_finite_is_not_lost(kernels, bad, fmt):
    """A NaN or an infinity in the row makes every output non-finite, as in float32 (an infinity
    comes out as NaN through the digits: its block's scale is infinite, its digits 0). The NaN
    sits beside the block's largest value, which the block's maximum then keeps."""
    w = (q4_1_weight if fmt == "q4_1" else q8_0_weight)(8, 576)[0]
    lin = nn.Linear(576, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(1, 576)
    x[0, 101] = 50.0
    x[0, 100] = bad
    y = PackedLinear.from_linear(lin, fmt, kernels)(x)
    assert not torch.isfinite(y).any()


@settings(max_examples=int(os.environ.get("KVTIER_DIGITS_EXAMPLES", "40")), deadline=None)
@given(fmt=st.sampled_from(["q4_1", "q8_0"]), groups=st.integers(1, 20), n=st.integers(1, 9),
       exponents=st.lists(st.floats(-45, 35), min_size=20, max_size=20), zeros=st.lists(st.booleans(), min_size=20, max_size=20),
       seed=st.integers(0, 2**16))
def test_one_row_products_hold_float32s_bound_at_any_magnitude(kernels, fmt, groups, n, exponents, zeros, seed):
    """Property: any widths, any mix of block magnitudes from subnormal to 1e35, blocks of zeros:
    the one-row product within the float32 product's own bound of float64's (where float64's
    terms stay inside float32's range)."""
    K = 32 * groups
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.0 if z else 10.0 ** e for e, z in zip(exponents[:groups], zeros[:groups])])
    x = (torch.randn(K, generator=g) * scale.repeat_interleave(32)).view(1, K)
    w = (q4_1_weight if fmt == "q4_1" else q8_0_weight)(n, K, seed=seed)[0]
    exact = x.double() @ w.double().T
    assume(bool(torch.isfinite(x).all()) and float((x.double().abs() @ w.double().abs().T).max()) < 1e37)
    lin = nn.Linear(K, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    y = PackedLinear.from_linear(lin, fmt, kernels)(x)
    scale = x.double().abs() @ w.double().abs().T
    # float32's bound, and its smallest subnormal's worth of rounding per term where terms are tiny
    assert ((y.double() - exact).abs() <= 1e-5 * scale + K * 2.0 ** -149).all()
