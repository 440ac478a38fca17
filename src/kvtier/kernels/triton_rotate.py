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

from kvtier.kernels.launch_plan import capability

#: rows (token x query head) and output channels a program takes, the depth 32 channels at a
#: time: a decode step of 64 rows x 32 heads is 64 programs of two channel blocks
BLOCK_R, BLOCK_J, BLOCK_C = 32, 64, 32


@triton.jit(do_not_specialize=["T", "N"])
def _rotate_kernel(
    X, stride_xb, stride_xh, stride_xt, R, stride_r0, stride_r1, OUT, stride_ob, stride_oh, stride_ot, T, HQ, N,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Output channels ``[program_id(1) * BLOCK_J, + BLOCK_J)`` of the rows ``[program_id(0) *
    BLOCK_R, + BLOCK_R)`` of the ``N`` rows ``r = (b, h, t)``: ``X @ R.T``, ``BLOCK_C`` channels
    of ``X`` at a time, on the tensor cores in three TF32 products a dot where ``PRECISION`` is
    ``"tf32x3"`` (about float32's error; compute capability 8.0 and up: TF32 tensor cores; one
    ``"ieee"`` float32 dot on the CUDA cores took the H200 76.6 us for 256 rows x 32 heads)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < N
    t = r % T
    h = (r // T) % HQ
    b = r // (T * HQ)
    x_row = b * stride_xb + h * stride_xh + t * stride_xt
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    c = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_R, BLOCK_J], tl.float32)
    for c0 in tl.static_range(0, HEAD_DIM, BLOCK_C):
        x = tl.load(X + x_row[:, None] + (c0 + c)[None, :], mask=r_ok[:, None], other=0.0)
        rot = tl.load(R + j[None, :] * stride_r0 + (c0 + c)[:, None] * stride_r1)  # (C, J) of R.T
        acc = tl.dot(x, rot, acc, input_precision=PRECISION)
    o = OUT + (b * stride_ob + h * stride_oh + t * stride_ot)[:, None] + j[None, :]
    tl.store(o, acc.to(OUT.dtype.element_ty), mask=r_ok[:, None])


def precision(device: torch.device) -> str:
    """The rotation's dot precision on ``device``: three TF32 products where the GPU has TF32
    tensor cores (compute capability 8.0 and up), else float32 (older GPUs, the interpreter)."""
    return "tf32x3" if capability(device) >= (8, 0) else "ieee"


def rotate_back(x: torch.Tensor, rotation: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x @ rotation.T`` in ``dtype``, laid out as ``x`` (a token-major ``x`` gives a token-major
    result): ``x`` fp32 ``[B, Hq, T, D]`` with a contiguous last dim, ``rotation`` fp32
    ``[D, D]`` of any strides, D a multiple of 32."""
    B, Hq, T, D = x.shape
    out = torch.empty_like(x, dtype=dtype)
    n = B * Hq * T
    block_j = BLOCK_J if D % BLOCK_J == 0 else BLOCK_C
    _rotate_kernel[(triton.cdiv(n, BLOCK_R), D // block_j)](
        x, x.stride(0), x.stride(1), x.stride(2), rotation, rotation.stride(0), rotation.stride(1),
        out, out.stride(0), out.stride(1), out.stride(2), T, Hq, n,
        HEAD_DIM=D, BLOCK_R=BLOCK_R, BLOCK_J=block_j, BLOCK_C=BLOCK_C,
        PRECISION=precision(x.device), num_warps=4,
    )  # fmt: skip
    return out
