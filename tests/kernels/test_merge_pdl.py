"""The split merge as a programmatic dependent launch (``triton_merge.MERGE_PDL``): on compute
capability 9.0+ the merge's programs are scheduled while the attention programs finish and wait
(``griddepcontrol.wait``) for their partials. The result must not change by a bit."""

from __future__ import annotations

import pytest
import torch
from test_triton_paged import DEVICE, IN_PROCESS, ON_GPU, build_cache

from triton_support import in_this_process_or_a_fresh_one

if IN_PROCESS:
    from kvtier.kernels import triton_merge
    from kvtier.kernels.triton_paged import LaunchConfig, paged_attention_triton

_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)


def _split_launch(B, L, splits, dtype):
    c = build_cache("fp", B, 8 if ON_GPU else 1, 128 if ON_GPU else 64, 16, [L - 5 * b for b in range(B)], dtype)
    Hq = 32 if ON_GPU else 4
    q = torch.randn(B, Hq, 1, c["kp"].shape[3], generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    qs = c["kv_len"] - 1
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    return lambda: paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"],
                                          config=LaunchConfig(num_splits=splits), **kw)


def test_no_dependent_launch_off_the_gpu():
    assert triton_merge._pdl(torch.device("cpu")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (elsewhere nothing launches dependently)")
@pytest.mark.parametrize("splits", [3, 7])
def test_merge_is_the_same_with_and_without_the_dependent_launch(monkeypatch, splits):
    attend = _split_launch(4, 4000, splits, torch.bfloat16)
    with_pdl = attend()
    monkeypatch.setattr(triton_merge, "MERGE_PDL", False)
    torch.testing.assert_close(attend(), with_pdl, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_gpu_dependent_launch_where_the_gpu_has_it():
    has = torch.cuda.get_device_capability()[0] >= 9
    assert triton_merge._pdl(torch.device("cuda")) == ({"PDL": True, "launch_pdl": True} if has else {})
    # inside a CUDA graph: a B=1 launch of 64 splits, replayed, equals the eager call
    attend = _split_launch(1, 4096, 64, torch.bfloat16)
    eager = attend()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attend()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = attend()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
