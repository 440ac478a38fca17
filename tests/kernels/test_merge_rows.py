"""The split merge of many query rows (``triton_merge.MERGE_ROWS`` rows a program at
``MERGE_MANY_ROWS`` rows or more): the same output as one row a program, and the reference's,
whatever the rows' count past the last full block."""

from __future__ import annotations

import pytest
import torch
from test_triton_paged import IN_PROCESS, ON_GPU, TOL, run_attention

from triton_support import in_this_process_or_a_fresh_one

if IN_PROCESS:
    from kvtier.kernels import triton_merge

_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)


@pytest.mark.parametrize("B, Hq, T, splits", [(5, 4, 1, 3), (2, 8, 3, 2)])
def test_row_blocks_merge_as_single_rows(monkeypatch, B, Hq, T, splits):
    """20 decode rows (a block of 16 and 4 past it); 48 rows of a 3-query extend. Every launch
    merges in blocks of rows here; the reference checks inside ``run_attention``."""
    lengths = [40 + 7 * b for b in range(B)]
    monkeypatch.setattr(triton_merge, "MERGE_MANY_ROWS", 1)
    blocks = run_attention("fp", B, Hq, 1, T, 64, 16, lengths, torch.float32, splits=splits)
    monkeypatch.setattr(triton_merge, "MERGE_MANY_ROWS", 10**9)
    single = run_attention("fp", B, Hq, 1, T, 64, 16, lengths, torch.float32, splits=splits)
    torch.testing.assert_close(blocks, single, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fp", "q8"])
def test_gpu_a_large_launch_merges_in_row_blocks(monkeypatch, mode):
    """65 rows x 32 heads (2,080 query rows, past the threshold and a block of 16) in three
    splits, bf16: against the reference, and the one-row merge to within a bf16 rounding."""
    lengths = [300 + 37 * b for b in range(65)]
    assert triton_merge.MERGE_MANY_ROWS <= 65 * 32
    blocks = run_attention(mode, 65, 32, 8, 1, 128, 16, lengths, torch.bfloat16, splits=3)
    monkeypatch.setattr(triton_merge, "MERGE_MANY_ROWS", 10**9)
    single = run_attention(mode, 65, 32, 8, 1, 128, 16, lengths, torch.bfloat16, splits=3)
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(blocks.float(), single.float(), atol=tol, rtol=tol)
