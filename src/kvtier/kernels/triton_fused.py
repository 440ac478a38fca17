"""Triton kernels for the decoder's elementwise steps on CUDA: each replaces several PyTorch launches.

At batch 1 a decode step of an 8B model is 32 layers of small launches around its
matrix-vector products; in a CUDA graph each costs a few microseconds whatever its size.
Three kernels take 8 of the 19 launches of a layer:

- :func:`rope`: ``x * cos + rotate_half(x) * sin`` over every head of q and k (5 launches);
- :func:`add_rms_norm`: the residual add and the next RMSNorm (2 launches), returning both;
- :func:`silu_mul`: ``silu(gate) * up`` of the MLP (2 launches, and the split).

Each rounds to half precision where PyTorch's ops do (the rotation's two products and their
sum, the SiLU and the product, the residual sum), and the RMSNorm's mean of squares is summed
in float32 in another order: the residual sum equals PyTorch's, the rest is within one or two
units in the last place. :class:`~kvtier.model.llama.Transformer` takes them on CUDA, in its
CUDA graphs and its eager forward alike, so a graph replays the eager step exactly
(``KVTIER_FUSED=0`` turns them off).

Example (CUDA)::

    >>> x = torch.randn(2, 1, 40, 128, device="cuda", dtype=torch.bfloat16)
    >>> cos, sin = torch.randn(2, 2, 1, 1, 128, device="cuda", dtype=torch.bfloat16)
    >>> rope(x, cos, sin).shape
    torch.Size([2, 1, 40, 128])
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm", "rope", "silu_mul", "silu_times"]


@triton.jit(do_not_specialize=["T"])  # a step's token count: one variant for every count
def _rope_kernel(
    X, stride_xb, stride_xt, stride_xh, C, S, stride_cb, stride_ct, O, T, H,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One token ``(b, t)``: every head of ``x`` rotated by its cos/sin (rotate-half layout)."""
    pid = tl.program_id(0)
    b = pid // T
    t = pid % T
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = h < H
    x_row = X + b * stride_xb + t * stride_xt + h * stride_xh
    x1 = tl.load(x_row + d, mask=ok, other=0.0)
    x2 = tl.load(x_row + HALF + d, mask=ok, other=0.0)
    c_row = b * stride_cb + t * stride_ct
    c1 = tl.load(C + c_row + d)
    c2 = tl.load(C + c_row + HALF + d)
    s1 = tl.load(S + c_row + d)
    s2 = tl.load(S + c_row + HALF + d)
    dt = x1.dtype
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded like PyTorch's ops
    lo = (x1.to(tl.float32) * c1.to(tl.float32)).to(dt).to(tl.float32) + (
        -x2.to(tl.float32) * s1.to(tl.float32)).to(dt).to(tl.float32)
    hi = (x2.to(tl.float32) * c2.to(tl.float32)).to(dt).to(tl.float32) + (
        x1.to(tl.float32) * s2.to(tl.float32)).to(dt).to(tl.float32)
    o_row = O + (pid * H + h) * (2 * HALF)
    tl.store(o_row + d, lo.to(dt), mask=ok)
    tl.store(o_row + HALF + d, hi.to(dt), mask=ok)


@triton.jit
def _add_rms_norm_kernel(X, R, W, H_OUT, N_OUT, N, eps, HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    """One row: ``h = x + r`` (rounded to the input dtype), ``n = rms_norm(h) * w``."""
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < N
    x = tl.load(X + row * N + i, mask=ok, other=0.0)
    dt = x.dtype
    if HAS_R:
        r = tl.load(R + row * N + i, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(H_OUT + row * N + i, x, mask=ok)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
    w = tl.load(W + i, mask=ok, other=0.0)
    y = (h * rstd).to(dt).to(tl.float32) * w.to(tl.float32)
    tl.store(N_OUT + row * N + i, y.to(dt), mask=ok)


@triton.jit
def silu_times(g, u):
    """``silu(g) * u`` in ``g``'s dtype, rounded where PyTorch's two ops round (the SiLU, then
    the product). Shared with the matrix-vector kernel's prologue (:mod:`kvtier.kernels.triton_gemv`)."""
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    return (s * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _silu_mul_kernel(X, O, H, BLOCK: tl.constexpr):
    """One row's block of ``silu(x[:H]) * x[H:]``."""
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < H
    g = tl.load(X + row * 2 * H + i, mask=ok, other=0.0)
    u = tl.load(X + row * 2 * H + H + i, mask=ok, other=0.0)
    tl.store(O + row * H + i, silu_times(g, u), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``: ``x`` ``[B, T, H, D]`` (last dim contiguous), cos/sin
    ``[B, T, 1, D]`` of ``x``'s dtype; a new contiguous ``[B, T, H, D]``."""
    B, T, H, D = x.shape
    if D % 2 or D & (D - 1) or x.stride(3) != 1:
        raise ValueError(f"rope needs a power-of-two head_dim with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if cos.shape != (B, T, 1, D) or sin.shape != cos.shape or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(f"cos/sin must be [{B}, {T}, 1, {D}] in {x.dtype}, got {tuple(cos.shape)} {cos.dtype}")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    if out.numel():
        _rope_kernel[(B * T,)](x, x.stride(0), x.stride(1), x.stride(2), cos, sin, cos.stride(0), cos.stride(1),
                               out, T, H, HALF=D // 2, BLOCK_H=triton.next_power_of_2(H), num_warps=4)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h) * weight)`` with ``h = x + residual`` (``x`` itself when ``residual`` is
    ``None``) over the last dim; ``x``/``residual`` ``[..., N]`` of one dtype."""
    N = x.shape[-1]
    if weight.shape != (N,) or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype)):
        raise ValueError(f"add_rms_norm needs residual like x {tuple(x.shape)} {x.dtype} and weight [{N}], got "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)} and "
                         f"{tuple(weight.shape)}")
    x = x.contiguous()
    rows = x.numel() // N if N else 0
    h = x if residual is None else torch.empty_like(x)
    n = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(N)
        r = x if residual is None else residual.contiguous()
        _add_rms_norm_kernel[(rows,)](x, r, weight.contiguous(), h, n, N, float(eps), HAS_R=residual is not None,
                                      BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return h, n


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :H]) * x[..., H:]`` of ``x`` ``[..., 2H]``: ``[..., H]``."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul needs an even last dim (gate and up), got {tuple(x.shape)}")
    H = x.shape[-1] // 2
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], H), dtype=x.dtype, device=x.device)
    rows = x.numel() // (2 * H) if H else 0
    if rows:
        block = min(1024, triton.next_power_of_2(H))
        _silu_mul_kernel[(rows, triton.cdiv(H, block))](x, out, H, BLOCK=block, num_warps=4)
    return out
