"""A Triton matrix-vector product for batch-1 decode: ``y = x @ W.T`` with ``x`` one row.

At batch 1 every projection of a decoder step is a matrix-vector product whose time is the
time to stream ``W`` from memory once. A program owns ``BLOCK_N`` output channels and walks
their weight rows in ``BLOCK_K``-wide tiles, keeping a ``[BLOCK_N, BLOCK_K]`` fp32
accumulator that is summed once at the end, so every tile's loads are independent of the
previous tile's arithmetic. The sum runs in a fixed order (no atomics): the same inputs give
the same bits, in an eager step and in a CUDA graph alike.

Where it pays (H200, bf16, Llama-3-8B's projections at one row, ``benchmarks/tools/gemv_sweep.py``,
default tiles ``(8, 1024)``, 4 warps): ``wo`` (4096 x 4096) 11.0 us against cuBLAS's 13.6 us,
``w2`` (4096 x 14336) 30.5 against 32.3 us, where cuBLAS splits K and sums the parts in a
second launch. ``wqkv`` ties and the wide ``w13`` and LM head are faster on cuBLAS (56.4
against 59.6 us), so :func:`kvtier.model.llama.project` sends only projections with no more
outputs than inputs here.

Example::

    >>> y = gemv(x, weight)          # x (K,) or (1, K); weight (N, K) -> y (N,) or (1, N)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtier.kernels.triton_fused import silu_times

__all__ = ["GemvConfig", "gemv", "gemv_reference"]


@dataclass(frozen=True)
class GemvConfig:
    """Output channels and input width of one program's tile, warps and pipeline stages."""

    block_n: int = 8
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 1, got {v!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")


@triton.jit
def _gemv_kernel(X, W, Y, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SILU_MUL: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = W + n[:, None].to(tl.int64) * stride_wn + kk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + kk < K
        if SILU_MUL:  # x = silu(gate) * up of a [2K] input, as triton_fused.silu_mul computes it
            g = tl.load(X + k0 + kk, mask=k_ok, other=0.0)
            u = tl.load(X + K + k0 + kk, mask=k_ok, other=0.0)
            x = silu_times(g, u).to(tl.float32)
        else:
            x = tl.load(X + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(Y + n, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=n_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None, *,
         silu_mul: bool = False) -> torch.Tensor:
    """``x @ weight.T`` for one row ``x`` (``(..., K)`` with one row) and ``weight`` ``(N, K)``.

    ``silu_mul``: ``x`` is ``(..., 2K)``, gate then up, and the product is of
    ``silu(gate) * up`` (:func:`kvtier.kernels.triton_fused.silu_mul`'s rounding, so the result
    equals ``gemv(silu_mul(x), weight)`` bit for bit) without writing it out.
    Both in one floating dtype on one device, ``weight``'s rows contiguous. The result has
    ``x``'s leading shape and dtype. Raises ``ValueError`` naming the mismatch."""
    if x.dim() == 0 or x.numel() != x.shape[-1] or (silu_mul and x.shape[-1] % 2):
        raise ValueError(f"x must hold one row{' of gate and up' if silu_mul else ''}, got {tuple(x.shape)}; "
                         "use a matmul for more rows")
    k_in = x.shape[-1] // 2 if silu_mul else x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k_in:
        raise ValueError(f"weight must be (N, {k_in}) for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device or not x.dtype.is_floating_point:
        raise ValueError(f"x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) must share "
                         "one floating dtype and device")
    if weight.stride(1) != 1:
        raise ValueError(f"weight's rows must be contiguous, got strides {weight.stride()}; pass weight.contiguous()")
    cfg = config or GemvConfig()
    N, K = weight.shape
    xv = x.reshape(x.shape[-1])
    if xv.stride(0) != 1:
        xv = xv.contiguous()
    y = torch.empty(x.shape[:-1] + (N,), dtype=x.dtype, device=x.device)
    if N:
        _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
            xv, weight, y, N, K, weight.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            SILU_MUL=silu_mul, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return y


def gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same product in float64 on the CPU (the tests' reference)."""
    return (x.double().cpu() @ weight.double().cpu().T).to(x.dtype)
