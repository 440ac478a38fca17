"""The decoder's fused elementwise kernels against the PyTorch ops they replace.

Without CUDA they run under Triton's interpreter in float32 (small shapes), and the model's
fused forward is compared with its PyTorch forward; with CUDA the ``gpu`` tests check the
half-precision results to one or two units in the last place (the residual sum exactly) and
the model's logits.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from numerics_support import assert_within_ulps
from triton_support import needs_interpreter_mark

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # must precede the first import of triton's jit decorators
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvtier.kernels.triton_fused import add_rms_norm, rope, silu_mul  # noqa: E402
from kvtier.model import llama  # noqa: E402
from kvtier.model.llama import ModelArgs, Transformer, apply_rope  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
needs_interpreter = needs_interpreter_mark()
gpu = pytest.mark.gpu


def reference_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(h, w.shape, w, eps)


@needs_interpreter
@pytest.mark.parametrize("B,T,H,D", [(1, 1, 5, 16), (2, 3, 6, 32)])
def test_rope_matches_pytorch(B, T, H, D):
    g = torch.Generator().manual_seed(B * 10 + T)
    qkv = torch.randn(B, T, H + 2, D, generator=g).to(DEVICE)
    x = qkv[:, :, :H]  # a view with the projection's strides, as the model passes it
    cos, sin = torch.randn(2, B, T, 1, D, generator=g).to(DEVICE)
    torch.testing.assert_close(rope(x, cos, sin), apply_rope(x, cos, sin), rtol=0, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("shape", [(1, 1, 48), (2, 5, 100)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_pytorch(shape, with_residual):
    g = torch.Generator().manual_seed(shape[-1])
    x, r = torch.randn(2, *shape, generator=g).to(DEVICE)
    w = torch.rand(shape[-1], generator=g).to(DEVICE)
    h, n = add_rms_norm(x, r if with_residual else None, w, 1e-5)
    want = x + r if with_residual else x
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    torch.testing.assert_close(n, reference_norm(want, w, 1e-5), rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 2, 2 * 1500)])
def test_silu_mul_matches_pytorch(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])).to(DEVICE)
    gate, up = x.split(shape[-1] // 2, dim=-1)
    torch.testing.assert_close(silu_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_bad_shapes_raise_before_launch():
    x = torch.zeros(1, 1, 2, 6)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        rope(x, torch.zeros(1, 1, 1, 6), torch.zeros(1, 1, 1, 6))
    with pytest.raises(ValueError, match="cos/sin must be"):
        rope(torch.zeros(1, 1, 2, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(torch.zeros(2, 8), None, torch.zeros(4), 1e-5)
    with pytest.raises(ValueError, match="even last dim"):
        silu_mul(torch.zeros(2, 7))


def test_cpu_tensors_take_pytorch_ops():
    assert not llama.fused_kernels(torch.zeros(1, 1, 8, dtype=torch.bfloat16))


@needs_interpreter
@pytest.mark.parametrize("batch", [2, 1])
def test_fused_forward_matches_pytorch_forward(monkeypatch, batch):
    """The model's fused forward (residual sums carried into the next norm; at batch 1 the
    decode step's ``wo`` and ``w2`` through the matrix-vector kernel, the SiLU product in its
    prologue) gives the logits of the PyTorch forward, prefill and decode, through a cache tier."""
    from kvtier.kernels import triton_gemv

    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=50)
    torch.manual_seed(0)
    model = Transformer(args).to(DEVICE)
    for m in model.modules():  # non-trivial norm weights
        if isinstance(m, llama.RMSNorm):
            m.weight.data.uniform_(0.5, 1.5)
    tokens = torch.randint(0, 50, (batch, 7), device=DEVICE)
    calls = []
    gemv = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda x, w, *a, **k: calls.append(k) or gemv(x, w, *a, **k))

    def run(fused: bool):
        monkeypatch.setattr(llama, "fused_kernels", lambda x: fused)
        monkeypatch.setattr(llama, "cpu_kernels", lambda x: False)  # PyTorch's ops against Triton's
        caches = model.make_caches(batch_size=batch)
        with torch.inference_mode():
            prefill = model(tokens, caches)
            step = model(tokens[:, -1:], caches)
            last = model(tokens, model.make_caches(batch_size=batch), last_only=True)
        return prefill, step, last

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # batch 1: the decode step's wo and w2 (with the SiLU) in each of 3 layers; batch 2: none
    assert calls == ([{"silu_mul": False}, {"silu_mul": True}] * 3 if batch == 1 else [])


# -- on the GPU: half precision ---------------------------------------------------------------
@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_results_equal_pytorch_ops(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(3, 5, 48, 128, device="cuda", generator=g).to(dtype)
    x = qkv[:, :, :40]
    pos = torch.arange(5, device="cuda")[None].expand(3, 5) + torch.tensor([[0], [7], [300]], device="cuda")
    args = ModelArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, hidden_dim=64, vocab_size=8)
    cos, sin = llama.RotaryEmbedding(args, device="cuda")(pos, dtype)  # (3, 5, 1, 128) each
    # a sum of two rounded products: within two units of the larger product (where the two
    # nearly cancel, the sum's own last place is far finer than their rounding)
    terms = (x.float() * cos.float()).abs() + (llama.rotate_half(x).float() * sin.float()).abs()
    assert_within_ulps(rope(x, cos, sin), apply_rope(x, cos, sin), 2, scale=terms)
    y = torch.randn(4, 2 * 14336, device="cuda", generator=g).to(dtype)
    gate, up = y.split(14336, dim=-1)
    assert_within_ulps(silu_mul(y), F.silu(gate) * up, 2)
    a, r = torch.randn(2, 4, 4096, device="cuda", generator=g).to(dtype)
    w = torch.rand(4096, device="cuda", generator=g).to(dtype)
    h, n = add_rms_norm(a, r, w, 1e-5)
    assert torch.equal(h, a + r)  # one rounding of one sum: nothing to reorder
    assert_within_ulps(n, reference_norm(a + r, w, 1e-5), 2)


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [2, 1])
def test_fused_model_logits_on_gpu(monkeypatch, batch):
    """bf16, SmolLM2's shape: the fused forward's logits, prefill and 8 decode steps on the
    PyTorch forward's tokens, stay within bf16 rounding of the PyTorch forward's (at batch 1
    the decode steps' wo and w2 go through the matrix-vector kernel)."""
    from kvtier.model import build_random

    model = build_random("smollm2-135m", dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, model.args.vocab_size, (batch, 41), device="cuda", generator=g)

    def logits(fused: bool):
        monkeypatch.setattr(llama, "fused_kernels", lambda x: fused)
        caches = model.make_caches(batch_size=batch)
        with torch.inference_mode():
            out = [model(tokens[:, :33], caches, last_only=True)]
            out += [model(tokens[:, t : t + 1], caches) for t in range(33, 41)]
        return torch.cat(out, 1)  # (2, 9, V)

    fused, plain = logits(True), logits(False)
    assert fused.shape == (batch, 9, model.args.vocab_size)
    scale = plain.abs().amax(-1, keepdim=True)
    assert ((fused - plain).abs() <= 0.02 * scale).all()
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.8
