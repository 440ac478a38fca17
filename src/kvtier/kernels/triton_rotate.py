"""The rotation back from the values' domain, as one Triton launch.

TurboQuant stores values rotated (``stored = v @ R``, :mod:`kvtier.quant.turboquant`), so the
attention kernels return ``out @ R`` in fp32, and the caller takes it back: ``out @ R.T``, in
the queries' dtype. :func:`rotate_back` does that product in fp32 and the rounding in one launch,
where a matmul and a cast took two (H200, B=1 / 4k: 10.7 us of a 23.0 us decode step;
benchmarks/RESULTS.md, 2026-12-04).

Example::

    >>> out = rotate_back(x, rotation, torch.bfloat16)  # x fp32 [B, Hq, T, D]  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: query heads and output channels a program takes: 16 heads (the dot's rows) and 32 channels,
#: so a decode step of 32 heads and head_dim 128 has eight programs a row
BLOCK_H, BLOCK_J = 16, 32


@triton.jit(do_not_specialize=["T"])
def _rotate_kernel(
    X, stride_xb, stride_xh, stride_xt, R, stride_r0, stride_r1, OUT, stride_ob, stride_oh, stride_ot, T, HQ,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Output channels ``[program_id(2) * BLOCK_J, + BLOCK_J)`` of the query heads
    ``[program_id(1) * BLOCK_H, + BLOCK_H)`` of token ``(b, t) = program_id(0)``: ``X @ R.T``
    in fp32, ``BLOCK_C`` channels of ``X`` at a time."""
    bt = tl.program_id(0)
    t = bt % T
    b = bt // T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < HQ
    x_row = b * stride_xb + h * stride_xh + t * stride_xt
    j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    c = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_H, BLOCK_J], tl.float32)
    for c0 in tl.static_range(0, HEAD_DIM, BLOCK_C):
        x = tl.load(X + x_row[:, None] + (c0 + c)[None, :], mask=h_ok[:, None], other=0.0)
        rot = tl.load(R + j[None, :] * stride_r0 + (c0 + c)[:, None] * stride_r1)  # (C, J) of R.T
        acc = tl.dot(x, rot, acc, input_precision="ieee")
    o = OUT + b * stride_ob + h[:, None] * stride_oh + t * stride_ot + j[None, :]
    tl.store(o, acc.to(OUT.dtype.element_ty), mask=h_ok[:, None])


def rotate_back(x: torch.Tensor, rotation: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x @ rotation.T`` in ``dtype``, laid out as ``x`` (a token-major ``x`` gives a token-major
    result): ``x`` fp32 ``[B, Hq, T, D]`` with a contiguous last dim, ``rotation`` fp32
    ``[D, D]`` of any strides, D a multiple of 32."""
    B, Hq, T, D = x.shape
    out = torch.empty_like(x, dtype=dtype)
    _rotate_kernel[(B * T, triton.cdiv(Hq, BLOCK_H), D // BLOCK_J)](
        x, x.stride(0), x.stride(1), x.stride(2), rotation, rotation.stride(0), rotation.stride(1),
        out, out.stride(0), out.stride(1), out.stride(2), T, Hq,
        HEAD_DIM=D, BLOCK_H=BLOCK_H, BLOCK_J=BLOCK_J, BLOCK_C=32, num_warps=4,
    )  # fmt: skip
    return out
