"""The rotation back from the values' domain (:mod:`kvtier.kernels.triton_rotate`): TurboQuant's
attention returns ``out @ R`` in fp32, and :func:`rotate_back` gives ``out @ R.T`` in the
queries' dtype, laid out as its input, against the same product in float64 by PyTorch."""

from __future__ import annotations

import pytest
import torch
from test_triton_paged import DEVICE, IN_PROCESS, ON_GPU, run_attention

from triton_support import in_this_process_or_a_fresh_one

if IN_PROCESS:
    from kvtier.kernels.triton_rotate import rotate_back

_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)


def _rotation(D, seed=0):
    """An orthogonal matrix, column-major as QR gives it (the kernel takes its strides)."""
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


@pytest.mark.parametrize("B, Hq, T, D", [(2, 20, 1, 64), (1, 4, 3, 128), (1, 16, 1, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotate_back_is_the_product_with_the_transpose(B, Hq, T, D, dtype):
    """20 heads: a second block of 16 heads, 4 of them past the end; D 256: eight channel blocks."""
    R = _rotation(D)
    x = torch.randn(B, Hq, T, D, generator=torch.Generator().manual_seed(1))
    out = rotate_back(x.to(DEVICE), R.float().to(DEVICE), dtype)
    assert out.dtype == dtype and out.shape == x.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.cpu().double(), x.double() @ R.T, atol=tol, rtol=tol)


def test_tf32_products_only_where_the_gpu_has_them(monkeypatch):
    from kvtier.kernels import triton_rotate

    assert triton_rotate.precision(torch.device("cpu")) == "ieee"
    for cc, want in (((7, 5), "ieee"), ((8, 0), "tf32x3"), ((9, 0), "tf32x3")):
        monkeypatch.setattr(triton_rotate, "capability", lambda device, cc=cc: cc)
        assert triton_rotate.precision(torch.device("cuda")) == want


def test_a_token_major_input_gives_a_token_major_result():
    """The packed launches' ``(1, N, Hq, D)`` seen as ``(1, Hq, N, D)``: the model's view of the
    result needs no copy."""
    D, Hq, N = 64, 4, 7
    R = _rotation(D, seed=3)
    x = torch.randn(1, N, Hq, D, generator=torch.Generator().manual_seed(4)).to(DEVICE).transpose(1, 2)
    out = rotate_back(x, R.float().to(DEVICE), torch.bfloat16)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.cpu().double(), x.cpu().double() @ R.T, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("B, Hq, T", [(1, 32, 1), (64, 32, 1), (256, 32, 1), (1, 28, 37)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rotate_back_matches_float64(B, Hq, T, dtype):
    """On the tensor cores (three TF32 products a dot): a float32 result within float32's
    error of the float64 product, not TF32's (about 1e-3)."""
    R = _rotation(128)
    x = torch.randn(B, Hq, T, 128, generator=torch.Generator().manual_seed(B))
    out = rotate_back(x.to(DEVICE), R.float().to(DEVICE), dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().double(), x.double() @ R.T, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_turboquant_decode_comes_back_rotated_at_every_split_count(splits):
    """TurboQuant's rotated values through the attention launch and :func:`rotate_back`: unsplit,
    split (merged first), and five splits of one tile each (a small grid's fixed merge tile),
    all against the reference over the decoded pages."""
    run_attention("turboquant:q8_0,q3_0", 5, 4, 1, 1, 64, 16, [40 + 23 * b for b in range(5)], torch.bfloat16,
                  splits=splits)  # fmt: skip
