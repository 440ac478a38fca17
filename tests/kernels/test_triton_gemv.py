"""The batch-1 matrix-vector kernel against a float64 product, and its SiLU prologue against
the two launches it replaces.

Without CUDA it runs under Triton's interpreter in float32 on small shapes; with CUDA the
``gpu`` tests take Llama-3-8B's ``wo`` and ``w2`` in bf16.
"""

from __future__ import annotations

import pytest
import torch

from triton_support import interpret_without_cuda, needs_interpreter_mark

DEVICE = interpret_without_cuda()
ON_GPU = DEVICE.type == "cuda"
pytest.importorskip("triton")

from kvtier.kernels.triton_fused import silu_mul  # noqa: E402
from kvtier.kernels.triton_gemv import GemvConfig, gemv, gemv_reference  # noqa: E402

needs_interpreter = needs_interpreter_mark()


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@needs_interpreter
@pytest.mark.parametrize(
    "N, K, cfg, lead",
    [
        (10, 70, GemvConfig(4, 32, 4, 1), (1,)),  # N and K not multiples of the tile
        (33, 128, GemvConfig(8, 64, 2, 3), (1, 1)),
        (16, 3000, None, ()),  # the default tile, K past one 1024-wide tile
        (1, 5, GemvConfig(1, 1, 1, 1), (1, 1, 1)),
    ],
)
def test_gemv_matches_float64_product(N, K, cfg, lead):
    x, w = rand(*lead, K, seed=1), rand(N, K, seed=2)
    y = gemv(x, w, cfg)
    assert y.shape == (*lead, N) and y.dtype == x.dtype
    torch.testing.assert_close(y.cpu(), gemv_reference(x, w).reshape(*lead, N), rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("N, K", [(8, 48), (20, 1100)])
def test_silu_prologue_equals_silu_mul_then_gemv(N, K):
    x, w = rand(1, 1, 2 * K, seed=3), rand(N, K, seed=4)
    fused = gemv(x, w, silu_mul=True)
    assert torch.equal(fused, gemv(silu_mul(x), w))
    gate, up = x.split(K, dim=-1)
    torch.testing.assert_close(fused.cpu(), gemv_reference(torch.nn.functional.silu(gate) * up, w), rtol=1e-5,
                               atol=1e-5)


def test_bad_input_raises_before_launch():
    w = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"x must hold one row, got \(2, 8\)"):
        gemv(torch.zeros(2, 8), w)
    with pytest.raises(ValueError, match=r"weight must be \(N, 6\) for x \(1, 6\), got \(4, 8\)"):
        gemv(torch.zeros(1, 6), w)
    with pytest.raises(ValueError, match="one row of gate and up"):
        gemv(torch.zeros(1, 7), w, silu_mul=True)
    with pytest.raises(ValueError, match=r"one row of gate and up, got \(\)"):
        gemv(torch.tensor(1.0), w, silu_mul=True)
    with pytest.raises(ValueError, match="share one floating dtype"):
        gemv(torch.zeros(1, 8, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        gemv(torch.zeros(1, 4), w.T)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        GemvConfig(8, 1000)
    with pytest.raises(ValueError, match="num_stages must be an int >= 1"):
        GemvConfig(num_stages=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("N, K", [(4096, 4096), (4096, 14336), (576, 1536)])
def test_gpu_bf16_projections(N, K):
    w = rand(N, K, seed=5, dtype=torch.bfloat16) / K**0.5
    x = rand(1, 1, 2 * K, seed=6, dtype=torch.bfloat16)
    h = silu_mul(x)
    y = gemv(h, w)
    ref = torch.nn.functional.linear(h.float(), w.float())
    assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert torch.equal(gemv(x, w, silu_mul=True), y)  # the prologue rounds as silu_mul does
    assert torch.equal(gemv(h, w), y)  # a fixed summation order: the same bits every call
