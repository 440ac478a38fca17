"""The split merge of the Triton attention kernels (flash-decoding): each split of a row's
keys writes its softmax-normalised partial output and base-2 log-sum-exp; one launch combines
them. Splits that saw no key (lse ``-inf``, partial 0) weigh nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kvtier.kernels.launch_plan import SHORT_SPLITS, SMALL_GRID, _next_pow2, capability

#: Launch the split merge as a programmatic dependent launch on compute capability 9.0+: its
#: programs are scheduled while the attention programs finish, and wait for their results.
MERGE_PDL = True


@triton.jit(do_not_specialize=["T", "num_splits", "N"])  # one variant for every query count and split count
def _merge_kernel(
    PO, PL, O, stride_ob, stride_oh, stride_ot, T, HQ, num_splits, N,
    HEAD_DIM: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Log-sum-exp merge of the splits of the query rows ``r = (b, hq, t)`` in ``[program_id(0)
    * BLOCK_R, + BLOCK_R)`` of ``N``, channels ``[program_id(1) * BLOCK_D, + BLOCK_D)``. ``PDL``:
    launched as a programmatic dependent launch, so it first waits for the attention grid's
    results."""
    if PDL:
        gdc_wait()
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < N
    d0 = tl.program_id(1) * BLOCK_D
    t = r % T
    hq = (r // T) % HQ
    b = r // (T * HQ)
    s = tl.arange(0, SPLITS_P2)
    ok = r_ok[:, None] & (s < num_splits)[None, :]
    at = r[:, None] * num_splits + s[None, :]  # (R, S)
    lse = tl.load(PL + at, mask=ok, other=float("-inf"))
    mx = tl.max(lse, axis=1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - mx[:, None]))  # (R, S)
    d = d0 + tl.arange(0, BLOCK_D)
    part = tl.load(PO + (at * HEAD_DIM)[:, :, None] + d[None, None, :], mask=ok[:, :, None],
                   other=0.0).to(tl.float32)  # fmt: skip
    total = tl.sum(w, axis=1)
    out = tl.sum(part * w[:, :, None], axis=1) / tl.where(total == 0.0, 1.0, total)[:, None]
    o = O + (b * stride_ob + hq * stride_oh + t * stride_ot)[:, None] + d[None, :]
    tl.store(o, out.to(O.dtype.element_ty), mask=r_ok[:, None])


def split_partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a launch of ``splits`` splits writes for ``out`` ``[B, Hq, T, D]``: partials
    ``[B, Hq, T, splits, D]`` (in :func:`partial_dtype`) and base-2 lse ``[B, Hq, T, splits]``;
    ``out`` itself, twice, when unsplit."""
    if splits == 1:
        return out, out
    B, Hq, T, D = out.shape
    po = torch.empty((B, Hq, T, splits, D), dtype=partial_dtype(out.dtype, out.device), device=out.device)
    return po, torch.empty((B, Hq, T, splits), dtype=torch.float32, device=out.device)


def merge_splits(po, pl, out, splits: int, base: int, split_len: int, block_n: int) -> None:
    """Merge a launch's split partials into ``out`` (nothing when unsplit). A small grid's splits
    are one tile each whatever the table's width, so an eager step (planned on the width its rows
    hold) and a CUDA graph (on the width it was captured with) differ only by empty trailing
    splits: one merge tile for every count keeps their sums in one order, and the two bit for
    bit alike."""
    if splits > 1:
        _merge(po, pl, out, splits, fixed=base < SMALL_GRID and split_len <= block_n)


#: channels a merge program reduces: 32 (one warp, four programs a row of 128; H200, B=1 / 4k:
#: 13.8-14.0 -> 13.1-13.4 us against one 4-warp program a row, benchmarks/RESULTS.md 2026-12-02).
#: Launches of at least MERGE_MANY_ROWS query rows take MERGE_ROWS rows a program on four warps
#: (one-warp programs were bound by their count: 6.0 us at 64 x 32 heads, 20.9 at 256 x 32)
MERGE_BLOCK_D, MERGE_MANY_ROWS, MERGE_ROWS = 32, 1024, 16


def partial_dtype(out_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the split partials for an output of ``out_dtype``: its own 16-bit type on
    the GPU (the merged output is rounded to it anyway; half the bytes each split stores and
    the merge reads), else float32 (the interpreter has no 16-bit arithmetic)."""
    if device.type == "cuda" and out_dtype in (torch.bfloat16, torch.float16):
        return out_dtype
    return torch.float32


def _merge(po: torch.Tensor, pl: torch.Tensor, out: torch.Tensor, splits: int, fixed: bool = False) -> None:
    """Merge split partials ``po`` ``[B, Hq, T, S, D]`` (lse ``pl`` ``[B, Hq, T, S]``) into ``out``.

    ``fixed``: reduce over a tile of :data:`SHORT_SPLITS` splits whatever ``S`` (up to that),
    so that partials padded with empty splits (partial 0, lse ``-inf``) merge to the same bits."""
    B, Hq, T, D = out.shape
    tile = SHORT_SPLITS if fixed and splits <= SHORT_SPLITS else max(2, _next_pow2(splits))
    block_d = min(D, MERGE_BLOCK_D)
    n = B * Hq * T
    rows = MERGE_ROWS if n >= MERGE_MANY_ROWS else 1
    _merge_kernel[(triton.cdiv(n, rows), D // block_d)](
        po, pl, out, out.stride(0), out.stride(1), out.stride(2), T, Hq, splits, n,
        HEAD_DIM=D, SPLITS_P2=tile, BLOCK_D=block_d, BLOCK_R=rows, num_warps=4 if rows > 1 else 1,
        **_pdl(out.device),
    )  # fmt: skip


def _pdl(device: torch.device) -> dict[str, bool]:
    """The merge's launch options: a programmatic dependent launch where :data:`MERGE_PDL` and the
    GPU has it (compute capability 9.0+), nothing elsewhere (the interpreter)."""
    if not MERGE_PDL or capability(device) < (9, 0):
        return {}
    return {"PDL": True, "launch_pdl": True}
