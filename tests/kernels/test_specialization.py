"""A step's token count must not make Triton compile another variant of a kernel.

Triton specialises an integer argument on being 1 or a multiple of 16 unless told not to. A
serving step's token count changes every step, so a kernel specialised on it compiles a new
variant the first time a count of a new class comes along: in the middle of serving, a stall of
100-300 ms on the H200 (`benchmarks/tools/serve_kernels.py` found one in the KV write of a
prompt step). These tests count the compilations Triton starts (its ``jit_cache_hook``) while
the kernels run at token counts of every class.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_paged import DEVICE, IN_PROCESS, ON_GPU, build_cache, check_write, run_write

from numerics_support import assert_within_ulps

if IN_PROCESS:
    import triton

    from kvtier.kernels.triton_fused import rope
    from kvtier.kernels.triton_paged import LaunchConfig, paged_attention_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="compilations happen on CUDA only")]

#: token counts of every class Triton tells apart: 1, odd, even, multiples of 16
COUNTS = [7, 1, 10, 16, 33, 48]


@pytest.fixture
def compiled(monkeypatch):
    """The names of the kernels Triton compiles (or loads from its disk cache) from here on."""
    names: list[str] = []

    def hook(*, fn, **_):
        names.append(fn.name)
        return None  # go on and compile

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", hook)
    return names


@pytest.mark.parametrize("mode", ["fp", "q8", "q4"])
def test_the_kv_write_compiles_once_for_every_token_count(compiled, mode):
    for T in COUNTS:
        check_write(run_write(mode, 1, 8, T, 128, 16, torch.bfloat16, seed=T), exact=True)
    assert compiled.count("_write_kernel") <= 1, compiled


def test_rope_compiles_once_for_every_token_count(compiled):
    from kvtier.model.llama import apply_rope, rotate_half

    for T in COUNTS:
        x = torch.randn(1, T, 8, 128, device=DEVICE, dtype=torch.bfloat16)
        angle = torch.arange(T, device=DEVICE)[:, None] * torch.rand(64, device=DEVICE)
        cos = torch.cat([angle.cos(), angle.cos()], -1)[None, :, None].to(x.dtype)
        sin = torch.cat([angle.sin(), angle.sin()], -1)[None, :, None].to(x.dtype)
        terms = (x.float() * cos.float()).abs() + (rotate_half(x).float() * sin.float()).abs()
        assert_within_ulps(rope(x, cos, sin), apply_rope(x, cos, sin), 2, scale=terms)
    assert compiled.count("_rope_kernel") <= 1, compiled


def test_the_split_merge_compiles_once_for_every_split_count(compiled):
    c = build_cache("fp", 2, 8, 128, 16, [3000, 2500], torch.bfloat16)
    q = torch.randn(2, 32, 1, 128, device=DEVICE, dtype=torch.bfloat16)
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    outs = [paged_attention_triton(q, c["kp"], c["vp"], c["table"], c["kv_len"] - 1, c["kv_len"],
                                   config=LaunchConfig(num_splits=s), **kw) for s in (5, 6, 7)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=2e-2, rtol=0)
    assert compiled.count("_merge_kernel") <= 1, compiled
