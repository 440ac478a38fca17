"""Bfloat16 prefills (``--prefill-dtype``, ``KVTIER_PREFILL_DTYPE``, :mod:`kvtier.kernels.precision`):
what multiplies in bfloat16 and what stays float32, the C kernels' bfloat16 weights, and the
default model's prefill against its float32 one."""

from __future__ import annotations

import platform

import pytest
import torch
from test_packed import q4_1_weight, q8_0_weight
from torch import nn
from torch.nn import functional as F

from kvtier.kernels import precision
from kvtier.kernels.precision import PREFILL_MIN_TOKENS, narrow_dtype, prefill_matmuls
from kvtier.model.linear import (
    Linear,
    parse_prefill_dtype,
    prefill_dtype_in_effect,
    prefill_dtype_of,
    prefill_dtype_warning,
)
from kvtier.model.packed import PackedLinear

BF16 = torch.bfloat16


def test_only_float32_calls_of_more_rows_than_the_bound_narrow_within_the_block():
    x = torch.zeros(2, 40, 16)  # 80 rows
    assert narrow_dtype(x) is None  # outside the block
    with prefill_matmuls(BF16):
        assert narrow_dtype(x) == BF16
        assert narrow_dtype(x[:, :32]) is None  # 64 rows: the bound itself stays float32
        assert narrow_dtype(torch.zeros(PREFILL_MIN_TOKENS + 1, 16)) == BF16
        assert narrow_dtype(x.double()) is None and narrow_dtype(x.half()) is None
        assert narrow_dtype(x.to(BF16)) == BF16  # (an input already in it: the MLP's SiLU product)
        with prefill_matmuls(torch.float32):  # a nested float32 block turns it off
            assert narrow_dtype(x) is None
        assert narrow_dtype(x) == BF16
    assert narrow_dtype(x) is None
    with pytest.raises(RuntimeError), prefill_matmuls(BF16):
        raise RuntimeError("the block is left on an exception")
    assert narrow_dtype(x) is None


@pytest.mark.parametrize("rows", [1, PREFILL_MIN_TOKENS, PREFILL_MIN_TOKENS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_multiplies_in_bfloat16_past_the_bound_and_exactly_below_it(rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = Linear(64, 48, bias=bias)
    x = torch.randn(1, rows, 64, generator=g)
    with torch.inference_mode():
        exact = lin(x)
        with prefill_matmuls(BF16):
            got = lin(x)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    if rows <= PREFILL_MIN_TOKENS:
        assert torch.equal(got, exact)
        return
    want = F.linear(x.to(BF16), lin.weight.to(BF16)).float()
    if bias:
        want = want + lin.bias
    assert torch.equal(got, want)
    assert not torch.equal(got, exact)  # (it did round: a float32 product of random data differs)
    assert (got - exact).abs().max() <= 0.02 * F.linear(x.abs(), lin.weight.abs()).max()


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_c_kernel_dequantises_straight_to_bfloat16_as_pytorch_rounds(kernels, fmt):
    w = q4_1_weight(96, 256, seed=3)[0] if fmt == "q4_1" else q8_0_weight(96, 256, seed=3)[0]
    packed = _packed(w, fmt, kernels)
    got = packed.weight_as(BF16)
    assert got.dtype == BF16 and torch.equal(got, w.to(BF16))  # rounding to nearest even, every weight
    assert torch.equal(packed.weight_as(torch.float32), w)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_bfloat16_rounding_ties_go_to_even(kernels, fmt):
    """Weights exactly half way between two bfloat16 numbers (their low 16 bits 0x8000), of odd and
    even bfloat16 neighbours below: the C rounding and PyTorch's agree on each."""
    w = q4_1_weight(256, 1024, seed=7)[0] if fmt == "q4_1" else q8_0_weight(256, 1024, seed=7)[0]
    bits = w.view(torch.int32)
    ties = (bits & 0xFFFF) == 0x8000
    odd = ((bits >> 16) & 1) == 1
    assert (ties & odd).sum() > 0 and (ties & ~odd).sum() > 0  # both ways of a tie are there
    got = _packed(w, fmt, kernels).weight_as(BF16)
    assert torch.equal(got, w.to(BF16))
    assert torch.equal(got.float()[ties & ~odd], (bits[ties & ~odd] & -65536).view(torch.float32))  # down to even


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx2",)], ids=["avx2", "plain"])
def test_each_vector_path_dequantises_to_the_same_bfloat16(flags):
    from kvtier.kernels.native import build_library
    from kvtier.model.packed import _C_SOURCE, PackedKernels

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 vector flags")
    narrow = PackedKernels(build_library("packed", _C_SOURCE, flags))
    for fmt, (w, *_) in (("q4_1", q4_1_weight(33, 1536)), ("q8_0", q8_0_weight(40, 576))):
        assert torch.equal(_packed(w, fmt, narrow).weight_as(BF16), w.to(BF16))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_packed_linear_in_a_bfloat16_prefill_is_the_bfloat16_product(kernels, fmt):
    w = q4_1_weight(200, 576)[0] if fmt == "q4_1" else q8_0_weight(200, 576)[0]
    packed = _packed(w, fmt, kernels)
    x = torch.randn(1, 100, 576)
    with torch.inference_mode(), prefill_matmuls(BF16):
        got = packed(x)
        small = packed(x[:, :PREFILL_MIN_TOKENS])
    assert torch.equal(got, F.linear(x.to(BF16), w.to(BF16)).float())
    with torch.inference_mode():
        assert torch.equal(small, packed(x[:, :PREFILL_MIN_TOKENS]))  # the C kernel's float32 rows


@pytest.mark.parametrize("T", [PREFILL_MIN_TOKENS, 100])
def test_sdpa_takes_a_prompts_queries_in_bfloat16_and_returns_float32(T):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, h, T, 32, generator=g) for h in (6, 2, 2))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with prefill_matmuls(BF16):
        got = precision.sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert got.dtype == torch.float32
    if T <= PREFILL_MIN_TOKENS:
        assert torch.equal(got, exact)
    else:
        want = F.scaled_dot_product_attention(q.to(BF16), k.to(BF16), v.to(BF16), is_causal=True, enable_gqa=True)
        assert torch.equal(got, want.float()) and (got - exact).abs().max() < 0.05


def test_the_setting_parses_names_and_dtypes_and_refuses_others(monkeypatch):
    assert parse_prefill_dtype(None) == parse_prefill_dtype("") == parse_prefill_dtype(" Float32 ") == torch.float32
    assert parse_prefill_dtype("bfloat16") == parse_prefill_dtype(BF16) == BF16
    for bad in ("fp16", "float16", torch.float16, "bf16"):
        with pytest.raises(ValueError, match=r"is unknown; accepted: float32, bfloat16"):
            parse_prefill_dtype(bad)
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(4, 4)
    monkeypatch.delenv("KVTIER_PREFILL_DTYPE", raising=False)
    assert prefill_dtype_of(model) == torch.float32 and prefill_dtype_warning(model) is None
    monkeypatch.setenv("KVTIER_PREFILL_DTYPE", "bfloat16")
    assert prefill_dtype_of(model) == prefill_dtype_in_effect(model) == BF16
    model.prefill_dtype = "float32"  # the model's own setting wins over the environment
    assert prefill_dtype_of(model) == torch.float32
    model.prefill_dtype = None
    monkeypatch.setenv("KVTIER_PREFILL_DTYPE", "half")
    with pytest.raises(ValueError, match=r"KVTIER_PREFILL_DTYPE='half' is unknown"):
        prefill_dtype_of(model)
    model.prefill_dtype = "bfloat16"
    model.tok_embeddings.to(BF16)  # a bfloat16 model: nothing to narrow
    assert prefill_dtype_in_effect(model) == BF16
    assert "has no effect on a bfloat16 model" in prefill_dtype_warning(model)
    model.tok_embeddings.float()
    monkeypatch.setattr(precision.torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(precision.torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert "neither AMX nor AVX512-BF16" in prefill_dtype_warning(model)


def _packed(w: torch.Tensor, fmt: str, kernels) -> PackedLinear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    packed = PackedLinear.from_linear(lin, fmt, kernels)
    assert packed is not None
    return packed


# -- the default model ------------------------------------------------------------------------------


@pytest.fixture
def bf16_prefill(lm, monkeypatch):
    monkeypatch.delenv("KVTIER_PREFILL_DTYPE", raising=False)
    monkeypatch.setattr(lm.model, "prefill_dtype", None, raising=False)
    return lm


@pytest.mark.parametrize("tier", ["tail", "paged"])
def test_the_default_models_bfloat16_prefill_is_near_its_float32_one(bf16_prefill, tier):
    from kvtier.config import KVCacheConfig
    from kvtier.evaluate import default_text, encode_text

    lm = bf16_prefill
    model, config = lm.model, KVCacheConfig(tier=tier)
    ids = torch.tensor([encode_text(lm.tokenizer, default_text(), 160)])
    outs, caches = {}, {}
    head_dtypes = []  # what the LM head multiplies in: float32 always (logits are what callers read)
    head = model.output.forward
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(model.output, "forward", lambda x: head_dtypes.append(narrow_dtype(x)) or head(x))
        for name in ("float32", "bfloat16"):
            model.prefill_dtype = name
            caches[name] = model.make_caches(config)
            outs[name] = model(ids, caches[name])[0]  # (T, V): every position's logits
    assert head_dtypes == [None, None]
    exact, narrow = outs["float32"], outs["bfloat16"]
    assert not torch.equal(exact, narrow)
    # the rounding of bfloat16 moves the distributions a little (measured: KL 3e-4 on average, 7e-3
    # at most, 159 of 160 next tokens kept, the perplexity of the text 16.39 -> 16.43)
    lp32, lp16 = exact.log_softmax(-1), narrow.log_softmax(-1)
    kl = (lp32.exp() * (lp32 - lp16)).sum(-1)
    assert kl.mean() < 2e-3 and kl.max() < 0.05
    assert (narrow.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.95
    nll = [-lp[:-1].gather(1, ids[0, 1:, None]).mean() for lp in (lp32, lp16)]
    assert abs(float(nll[1] - nll[0])) < 0.01  # the text's perplexity within 1%
    # the stored keys and values came from bfloat16 products, near the float32 ones
    for layer in (0, 5, 29):
        (k32, v32), (k16, v16) = caches["float32"][layer].fetch(), caches["bfloat16"][layer].fetch()
        assert k16.dtype == torch.float32 and k16.shape == k32.shape
        assert (k16 - k32).abs().max() < 0.05 * k32.abs().max() and (v16 - v32).abs().max() < 0.05 * v32.abs().max()
    # a decode step after it is float32 whatever the setting: the same logits either way
    with torch.inference_mode():
        step = []
        for name in ("bfloat16", "float32"):
            model.prefill_dtype = name
            cs = model.make_caches(config)
            model.prefill_dtype = "bfloat16"
            model(ids, cs)
            model.prefill_dtype = name
            step.append(model(torch.tensor([[42]]), cs))
    assert torch.equal(step[0], step[1])


@pytest.mark.parametrize("rows, tokens", [(1, PREFILL_MIN_TOKENS), (4, 20)])
def test_a_short_prompt_and_a_batch_of_short_rows_are_float32_bit_for_bit(bf16_prefill, rows, tokens):
    """64 tokens a row, and four rows of 20 (80 in all, as a verification of drafts over a batch
    feeds): float32, whatever the setting, so speculative decoding verifies as it decodes."""
    from kvtier.config import KVCacheConfig

    model = bf16_prefill.model
    ids = torch.randint(0, 4000, (rows, tokens), generator=torch.Generator().manual_seed(0))
    outs = []
    with torch.inference_mode():
        for name in ("float32", "bfloat16"):
            model.prefill_dtype = name
            outs.append(model(ids, model.make_caches(KVCacheConfig(tier="ragged"), batch_size=rows)))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tier", ["tail", "paged"])
def test_a_float32_model_on_cuda_prefills_in_bfloat16_too(tier):
    """On CUDA a float32 model narrows alike (cuBLAS's bfloat16 products, SDPA's bfloat16 kernels):
    near its float32 prefill, and the decode step after it near the float32 one's."""
    from kvtier.config import KVCacheConfig
    from kvtier.model import ModelArgs, build_random

    args = ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=512, vocab_size=512)
    model = build_random(args, dtype=torch.float32, device="cuda")
    ids = torch.randint(0, 512, (2, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    config = KVCacheConfig(tier=tier)
    outs, steps = {}, {}
    with torch.inference_mode():
        for name in ("float32", "bfloat16"):
            model.prefill_dtype = name
            caches = model.make_caches(config, batch_size=2)
            outs[name] = model(ids, caches)
            steps[name] = model(ids[:, -1:], caches)
    lp32, lp16 = outs["float32"].log_softmax(-1), outs["bfloat16"].log_softmax(-1)
    assert not torch.equal(lp32, lp16)
    assert (lp32.exp() * (lp32 - lp16)).sum(-1).mean() < 2e-3
    assert (steps["bfloat16"] - steps["float32"]).abs().max() < 0.1 * steps["float32"].abs().max()
