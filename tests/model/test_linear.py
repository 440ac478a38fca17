"""kvtier.model.linear: oneDNN's float32 linear on the CPU against F.linear and float64."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kvtier.model import ModelArgs, build_random
from kvtier.model.linear import HAVE_ONEDNN, Linear, linear, onednn_applies


def within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """``y`` is ``x @ w.T + b`` up to float32 rounding of the sum of |x| |w|."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    return bool(((y.double() - exact).abs() <= 1e-5 * scale + 1e-30).all())


@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (2, 5, 64), (300, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_the_product_within_float32_rounding(shape, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(*shape, generator=g)
    with torch.inference_mode():
        y = linear(x, w, b)
    assert y.shape == (*shape[:-1], 96) and y.dtype == torch.float32
    assert within_rounding(y, x, w, b)


def test_non_contiguous_inputs_and_weights():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 9, generator=g).t()  # (9, 64), transposed
    w = torch.randn(64, 40, generator=g).t()  # (40, 64), transposed
    with torch.no_grad():
        assert within_rounding(linear(x, w), x, w, None)
        x3 = torch.randn(3, 64, 4, generator=g).transpose(1, 2)  # (3, 4, 64)
        assert within_rounding(linear(x3, w), x3, w, None)


@pytest.mark.skipif(not HAVE_ONEDNN, reason="this PyTorch has no oneDNN linear")
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # (torch's flags() on a CPU build)
def test_onednn_only_where_it_applies():
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    with torch.inference_mode():
        assert onednn_applies(x, w)
        assert not onednn_applies(x.double(), w.double())
        assert not onednn_applies(x.bfloat16(), w.bfloat16())
        with torch.backends.mkldnn.flags(enabled=False):  # PyTorch's own switch turns it off
            assert not onednn_applies(x, w)
            assert torch.equal(linear(x, w), F.linear(x, w))
    wg = w.clone().requires_grad_()
    assert not onednn_applies(x, wg)  # a gradient is needed: F.linear, which has one
    with torch.no_grad():
        assert onednn_applies(x, wg)


@pytest.mark.skipif(not HAVE_ONEDNN, reason="this PyTorch has no oneDNN linear")
@pytest.mark.parametrize("avx512", [True, False])
def test_prefill_rows_take_the_blas_without_avx512(monkeypatch, avx512):
    """From BLAS_MIN_ROWS rows a CPU without AVX-512 multiplies through F.linear (bit for bit its
    result); fewer rows, or AVX-512, keep oneDNN."""
    from kvtier.model import linear as linear_module

    monkeypatch.setattr(linear_module, "has_avx512", lambda: avx512)
    w = torch.randn(16, 8)
    many, few = torch.randn(linear_module.BLAS_MIN_ROWS, 8), torch.randn(2, linear_module.BLAS_MIN_ROWS // 2 - 1, 8)
    with torch.inference_mode():
        assert onednn_applies(few, w)
        assert onednn_applies(many, w) == avx512
        assert onednn_applies(many.view(2, -1, 8), w) == avx512  # rows of every leading dim count
        if not avx512:
            assert torch.equal(linear(many, w), F.linear(many, w))


def test_gradients_flow_through_linear():
    lin = Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    torch.testing.assert_close(lin.weight.grad, x.detach().sum(0).expand(3, 4))


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # (torch's flags() on a CPU build)
def test_the_model_projections_use_it_and_agree_with_f_linear():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=96)
    model = build_random(args, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Linear) for m in linears)
    tokens = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = model(tokens, model.make_caches(batch_size=2))
        with torch.backends.mkldnn.flags(enabled=False):
            want = model(tokens, model.make_caches(batch_size=2))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
