"""The C elementwise kernels of the CPU decoder (kvtier.kernels.cpu_fused) against PyTorch's ops,
alone and inside the model's forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.kernels import cpu_fused
from kvtier.model import llama
from kvtier.model.llama import ModelArgs, Transformer, apply_rope
from numerics_support import assert_within_ulps

pytestmark = pytest.mark.skipif(cpu_fused.load_kernels() is None, reason="no C compiler builds the kernels here")


@pytest.mark.parametrize("B, T", [(1, 1), (2, 5), (3, 300)])  # 3 x 300: the threaded branch
def test_rope_equals_pytorch_bit_for_bit(B, T):
    g = torch.Generator().manual_seed(B * T)
    qkv = torch.randn(B, T, 15, 64, generator=g)
    x = qkv[:, :, :12]  # q and k heads of a packed projection: strided rows
    args = ModelArgs(dim=576, n_layers=1, n_heads=9, n_kv_heads=3, hidden_dim=8, vocab_size=8)
    pos = torch.arange(T)[None] + torch.tensor([[0], [17], [4000]])[:B]
    cos, sin = llama.RotaryEmbedding(args)(pos, torch.float32)  # (B, T, 1, 64)
    got = cpu_fused.rope(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, apply_rope(x, cos, sin))


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_add_rms_norm_matches_pytorch(rows):
    g = torch.Generator().manual_seed(rows)
    x, r = torch.randn(2, rows, 576, generator=g) * 3
    w = torch.rand(576, generator=g) + 0.5
    h, n = cpu_fused.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, x + r)  # one rounding of one sum
    assert_within_ulps(n, F.rms_norm(x + r, (576,), w, 1e-5), 4)
    h0, n0 = cpu_fused.add_rms_norm(x, None, w, 1e-5)
    assert h0.data_ptr() == x.data_ptr()
    assert_within_ulps(n0, F.rms_norm(x, (576,), w, 1e-5), 4)


def test_silu_mul_matches_pytorch():
    y = torch.randn(3, 1, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = y.split(1536, dim=-1)
    assert_within_ulps(cpu_fused.silu_mul(y), F.silu(gate) * up, 4)


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",), ("-mno-avx2",)], ids=["native", "avx2", "plain"])
def test_silu_mul_over_the_whole_float_range(flags):
    """Each build's SiLU product (the vector paths' own exponential, the plain loop's expf) over
    [-100, 100], the edges of the exponential's range, infinities, NaN, signed zeros and
    subnormals, in rows whose length leaves a tail after the vectors: within 4 units in the last
    place of PyTorch's, NaN and infinity where PyTorch has them."""
    import platform

    from kvtier.kernels.native import build_library

    if flags and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 vector flags")
    kernels = cpu_fused.CpuFusedKernels(build_library("cpu_fused", cpu_fused._C_SOURCE, flags))
    edges = [88.72, 88.7229, 88.73, 89.0, 87.0, 87.5, 103.0, 1e-40, 0.0, -0.0, float("inf"), float("nan")]
    gate = torch.cat([torch.linspace(-100, 100, 200_001), torch.tensor(edges), -torch.tensor(edges)])
    gate = gate[: gate.numel() // 45 * 45].view(-1, 45)  # rows of 45: two vectors and a tail of 13 or 5
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(1)) * 3
    H = gate.shape[1]
    x = torch.cat([gate, up], dim=1).contiguous()
    got = torch.empty_like(gate)
    kernels.silu_mul(x.data_ptr(), got.data_ptr(), gate.shape[0], H, 2)
    want = F.silu(gate) * up
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = want.isfinite()
    assert_within_ulps(got[fin], want[fin], 4)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        cpu_fused.silu_mul(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even last dim"):
        cpu_fused.silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="weight"):
        cpu_fused.add_rms_norm(torch.zeros(2, 8), None, torch.zeros(4), 1e-5)
    with pytest.raises(ValueError, match="residual like x"):
        cpu_fused.add_rms_norm(torch.zeros(2, 8), torch.zeros(1, 8), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="cos/sin must be"):
        cpu_fused.rope(torch.zeros(1, 1, 2, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match="even head_dim"):
        cpu_fused.rope(torch.zeros(1, 1, 2, 7), torch.zeros(1, 1, 1, 7), torch.zeros(1, 1, 1, 7))


@pytest.mark.parametrize("tier", ["tail", "paged"])
def test_model_forward_matches_pytorch_ops(monkeypatch, tier):
    """float32 on the CPU: the forward through the C kernels (residual sums carried into the next
    norm) gives the PyTorch forward's logits, prefill and decode, and the same greedy tokens."""
    from kvtier.config import KVCacheConfig

    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=50)
    torch.manual_seed(0)
    model = Transformer(args)
    for m in model.modules():
        if isinstance(m, llama.RMSNorm):
            m.weight.data.uniform_(0.5, 1.5)
    tokens = torch.randint(0, 50, (2, 9))
    calls = []
    rope = cpu_fused.rope
    monkeypatch.setattr(cpu_fused, "rope", lambda *a: calls.append(1) or rope(*a))

    def run(c_kernels: bool):
        monkeypatch.setattr(llama, "cpu_kernels", lambda x: c_kernels and x.dtype == torch.float32)
        caches = model.make_caches(KVCacheConfig(tier=tier, paged_num_blocks=8), batch_size=2)
        with torch.inference_mode():
            out = [model(tokens, caches)]
            for _ in range(4):
                out.append(model(out[-1][:, -1:].argmax(-1), caches))
        return out

    got, want = run(True), run(False)
    assert len(calls) == 5 * args.n_layers  # every layer of every forward took the C rotation
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))


def test_a_forward_that_records_gradients_keeps_pytorch_ops():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=50)
    model = Transformer(args)
    x = model.tok_embeddings(torch.tensor([[1, 2]]))
    assert x.requires_grad and llama.elementwise_ops(x) is None
    with torch.inference_mode():
        assert llama.elementwise_ops(model.tok_embeddings(torch.tensor([[1, 2]]))) is cpu_fused
    loss = model(torch.tensor([[1, 2, 3]]), model.make_caches()).sum()
    loss.backward()  # no C kernel in the graph: gradients flow
    assert model.tok_embeddings.weight.grad is not None
