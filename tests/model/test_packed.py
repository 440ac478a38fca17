"""Packed Q4_1/Q8_0 linears: lossless recovery of block codes, the C kernel against
F.linear on the float32 weight, and the default model packed against the float32 one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kvtier.model import load_model
from kvtier.model.linear import linear
from kvtier.model.packed import (
    GROUPED_MAX_ROWS,
    MAX_KERNEL_ROWS,
    PackedLinear,
    pack_model,
    packed_state,
    recover_q4_1,
    recover_q8_0,
)


def q4_1_weight(N: int, K: int, seed: int = 0):
    """A float32 weight built the way gguf dequantises Q4_1: ``code * d + m`` per block of 32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantiser puts a block's min at 0 and max at 15
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.01).half().float()
    m = (-torch.rand(N, K // 32, 1, generator=g) * 0.05).half().float()
    return (q * d + m).reshape(N, K), q, d, m


def q8_0_weight(N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (N, K // 32, 32), generator=g).float()
    q[..., 0] = 127
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.01).half().float()
    return (q * d).reshape(N, K), q


def test_q4_1_codes_are_recovered_exactly():
    w, q, d, m = q4_1_weight(64, 96)
    codes, d2, m2 = recover_q4_1(w)
    assert codes.shape == (64, 3, 16) and codes.dtype == torch.uint8
    assert torch.equal(d2.float(), d[..., 0]) and torch.equal(m2.float(), m[..., 0])
    assert torch.equal(torch.cat([codes & 15, codes >> 4], -1).float(), q)


def test_q8_0_codes_are_recovered_exactly():
    w, q = q8_0_weight(64, 96)
    codes, _ = recover_q8_0(w)
    assert torch.equal(codes.float(), q.reshape(64, 96))


@pytest.mark.parametrize("recover", [recover_q4_1, recover_q8_0])
def test_weights_that_are_not_exactly_codes_are_refused(recover):
    w, *_ = q4_1_weight(8, 64) if recover is recover_q4_1 else q8_0_weight(8, 64)
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))  # one ulp off
    assert recover(w) is None
    assert recover(torch.randn(8, 64)) is None
    assert recover(torch.randn(8, 60)) is None  # not whole blocks


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, MAX_KERNEL_ROWS, 7, 13, GROUPED_MAX_ROWS, GROUPED_MAX_ROWS + 1])  # 13: 8 + 4 + 1
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_out, k_in", [(200, 576), (201, 1536)])  # an odd output count: q4_1 pairs outputs
def test_packed_linear_equals_f_linear_on_the_float32_weight(kernels, fmt, rows, bias, n_out, k_in):
    w = q4_1_weight(n_out, k_in)[0] if fmt == "q4_1" else q8_0_weight(n_out, k_in)[0]
    lin = nn.Linear(k_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(w)
    packed = PackedLinear.from_linear(lin, fmt, kernels)
    assert packed is not None and packed.fmt == fmt
    assert torch.equal(packed.weight, w)
    x = torch.randn(1, rows, k_in)
    b = None if lin.bias is None else lin.bias.detach()
    want = linear(x, w, b)  # the float32 model's product (kvtier.model.linear)
    got = packed(x)
    assert got.shape == (1, rows, n_out)
    if rows > kernels.max_rows:  # prefill: the float32 model's linear() on the dequantised weight, bit for bit
        assert torch.equal(got, want)
    # only the order of the float32 sums differs from the exact product
    for y in (got, want):
        assert_near_exact_product(y, x, w, b)


def assert_near_exact_product(y, x, w, b=None):
    """``y`` is ``x @ w.T + b`` up to the order of float32 sums: within float32 rounding of the sum
    of ``|x| |w|`` (a cancelling sum may lose every relative digit), and among float32's
    subnormals within half of their spacing, 2^-149, for each product and each sum (a float32
    loop on a row of 1e-40s: the digits, where the CPU has them, scale such a row up first)."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    subnormal = x.shape[-1] * 2.0 ** -149  # K products and K sums, 2^-150 each at most
    assert ((y.double() - exact).abs() <= 1e-5 * scale + subnormal).all()


@pytest.mark.parametrize("flags, lanes", [(("-mno-avx512f",), 8), (("-mno-avx2",), 1)], ids=["avx2", "plain"])
def test_each_vector_path_of_the_kernel_equals_the_exact_product(flags, lanes):
    """The kernel's narrower paths, built on purpose (where the CPU has AVX-512 the default
    build never runs them): the AVX2 one and the plain loops, each against the exact product,
    and each one's dequantised weight the original bit for bit."""
    import platform

    from kvtier.kernels.native import build_library
    from kvtier.model.packed import _C_SOURCE, PackedKernels

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 vector flags")
    narrow = PackedKernels(build_library("packed", _C_SOURCE, flags))
    for fmt, (w, *_) in (("q4_1", q4_1_weight(201, 1536)), ("q8_0", q8_0_weight(200, 576))):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        packed = PackedLinear.from_linear(lin, fmt, narrow)
        assert torch.equal(packed.weight, w)  # each path's dequantiser, bit for bit
        for rows in (1, 3, 6):  # one row; on the AVX2 path rows in groups of four and a remainder
            x = torch.randn(rows, w.shape[1])
            assert_near_exact_product(packed(x), x, w)
    assert narrow.lanes == (lanes if _cpu_has("avx2", "fma", "f16c") else 1)
    assert narrow.max_rows == (GROUPED_MAX_ROWS if narrow.lanes > 1 else MAX_KERNEL_ROWS)


def _cpu_has(*features: str) -> bool:
    from kvtier.kernels.native import _cpu_flags

    return set(features) <= set(_cpu_flags().split())


def test_the_default_build_takes_the_widest_path_the_cpu_has(kernels):
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    want = 16 if _cpu_has("avx512f") else 8 if _cpu_has("avx2", "fma", "f16c") else 1
    assert kernels.lanes == want


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_c_dequantiser_and_pytorchs_ops_give_the_same_weight(kernels, monkeypatch, fmt):
    """``PackedLinear.weight``: the C pass (fp16 scales on the CPU) and PyTorch's ops (which serve
    elsewhere, e.g. scales converted to float32) both give the original weight bit for bit."""
    w = q4_1_weight(64, 256)[0] if fmt == "q4_1" else q8_0_weight(64, 256)[0]
    lin = nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    packed = PackedLinear.from_linear(lin, fmt, kernels)
    calls = []
    dequant = kernels.dequant
    monkeypatch.setattr(kernels, "dequant", lambda *a: calls.append(a[0]) or dequant(*a))
    assert torch.equal(packed.weight, w) and calls == [fmt]
    with torch.no_grad():
        packed.d.data = packed.d.data.float()  # not the kernel's fp16: PyTorch's ops
    assert torch.equal(packed.weight, w) and calls == [fmt]


def test_random_float32_weights_stay_float32(kernels):
    from kvtier.model import ModelArgs, build_random

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=96)
    model = build_random(args, dtype=torch.float32)
    stats = pack_model(model, kernels)
    assert sum(stats["packed"].values()) == 0 and stats["float32"] > 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.slow
def test_default_model_packs_and_decodes_the_float32_models_tokens(lm, kernels):
    from kvtier.generate import generate_step

    n_layers = lm.args.n_layers
    assert lm.packing["packed"] == {"q4_1": 4 * n_layers, "q8_0": 1}
    assert lm.packing["bytes_after"] < lm.packing["bytes_before"] / 5
    fp32 = load_model(device="cpu", dtype=torch.float32, progress=False, pack=False)
    assert fp32.packing is None
    # every packed weight dequantises to the float32 model's weight, bit for bit
    for name, mod in lm.model.named_modules():
        if isinstance(mod, PackedLinear):
            assert torch.equal(mod.weight, fp32.model.get_submodule(name).weight), name
    assert set(packed_state(lm.model)) >= {"output.codes", "layers.0.attention.wqkv.m"}
    prompt = lm.tokenizer.encode("Write a short story about a lighthouse keeper and a storm.")

    def tokens(model, n=48):
        steps = generate_step(model, [prompt], model.make_caches())
        out = [int(next(steps)) for _ in range(n)]
        steps.close()
        return out

    assert tokens(lm.model) == tokens(fp32.model)
