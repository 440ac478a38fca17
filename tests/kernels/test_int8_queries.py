"""q8 keys scored with int8 queries (``LaunchConfig(int8_queries=True)``, the default on compiled
launches of bf16/fp16 queries) against the references fed the queries rounded the same way.

``kvtier.kernels.reference.round_queries_int8`` is the kernel's rounding in PyTorch: each query
row's int8 codes at the scale ``max|q| / 127``. With fp32 queries under the interpreter the
kernel's other products are fp32, so the kernel must match the reference over the rounded
queries to fp32 accuracy and differ from the one over the queries as given by the rounding's
effect (about 1e-3 here): a kernel that skipped the rounding, or rounded otherwise, fails.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_paged import DEVICE, IN_PROCESS, ON_GPU, TOL, build_cache, gathered_reference

from kvtier.kernels.reference import round_queries_int8
from triton_support import in_this_process_or_a_fresh_one

if IN_PROCESS:
    from kvtier.kernels import triton_attention
    from kvtier.kernels.paged import paged_attention_packed_reference
    from kvtier.kernels.triton_paged import LaunchConfig, paged_attention_triton

_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)

#: fp32 queries: what the kernel may differ from the reference over the same rounded queries
EXACT = 2e-5


def _attend(c, q, qs, **cfg):
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    return paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], config=LaunchConfig(**cfg), **kw)


def _case(mode, B, Hq, H_kv, T, D, lengths, dtype=torch.float32, seed=0):
    c = build_cache(mode, B, H_kv, D, 16, lengths, dtype, seed=seed)
    q = torch.randn(B, Hq, T, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    qs = torch.tensor([max(0, n - T) for n in lengths], dtype=torch.int64, device=DEVICE)
    return c, q, qs


@pytest.mark.parametrize(
    "B, Hq, H_kv, T, D, lengths, splits",
    [
        (3, 4, 1, 1, 64, [1, 17, 45], None),  # decode: one key, a page edge + 1, a few pages
        (2, 8, 2, 1, 128, [70, 33], 3),  # GQA 4, head_dim 128, three splits merged
        (2, 4, 1, 5, 64, [40, 5], None),  # five queries a row (a verification, a prompt chunk)
    ],
)
def test_int8_queries_score_like_the_rounded_reference(B, Hq, H_kv, T, D, lengths, splits):
    c, q, qs = _case("q8", B, Hq, H_kv, T, D, lengths)
    out = _attend(c, q, qs, int8_queries=True, num_splits=splits)
    rounded = gathered_reference(c, round_queries_int8(q), qs)
    torch.testing.assert_close(out, rounded, atol=EXACT, rtol=EXACT)
    plain = gathered_reference(c, q, qs)
    assert (out - plain).abs().max() > 10 * EXACT  # the rounding is there, and this test can see it
    assert (out - plain).abs().max() < 2e-2  # and no more than rounding: about 1e-3 on these rows
    exact = _attend(c, q, qs, int8_queries=False, num_splits=splits)
    torch.testing.assert_close(exact, plain, atol=EXACT, rtol=EXACT)


def test_packed_prompt_rows_take_int8_queries():
    """A serving step: a decode row first, then two prompt chunks, over q8 pages."""
    lengths, counts = [20, 30, 9], [1, 6, 9]
    c = build_cache("q8", 3, 1, 64, 16, lengths, torch.float32, seed=3)
    N = sum(counts)
    q = torch.randn(1, 4, N, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    to = dict(dtype=torch.int64, device=DEVICE)
    qs = torch.tensor([n - k for n, k in zip(lengths, counts)], **to)
    qo = torch.tensor([0, 1, 7], **to)
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"], q_offsets=qo,
              max_q_len=max(counts))
    out = paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], single_rows=1,
                                 config=LaunchConfig(int8_queries=True), **kw)
    ref = paged_attention_packed_reference(round_queries_int8(q), c["kp"], c["vp"], c["table"], qs, c["kv_len"], **kw)
    torch.testing.assert_close(out, ref, atol=EXACT, rtol=EXACT)


@pytest.mark.parametrize("mode", ["fp", "q4", "q4_g32", "fp8", "turboquant:q8_0,q3_0"])
def test_other_keys_ignore_int8_queries(mode):
    """Only q8 keys are scored in integers; every other format reads exactly as before."""
    c, q, qs = _case(mode, 2, 4, 1, 1, 64, [33, 8])
    torch.testing.assert_close(_attend(c, q, qs, int8_queries=True), _attend(c, q, qs, int8_queries=False),
                               atol=0, rtol=0)


def test_default_rounds_only_16_bit_queries_on_compiled_launches():
    c, q, qs = _case("q8", 2, 4, 1, 1, 64, [33, 8])
    assert triton_attention.INT8_QUERIES
    # fp32 queries (and the interpreter) keep fp32 products by default
    torch.testing.assert_close(_attend(c, q, qs), _attend(c, q, qs, int8_queries=False), atol=0, rtol=0)
    if ON_GPU:
        c, q, qs = _case("q8", 2, 4, 1, 1, 64, [33, 8], dtype=torch.bfloat16)
        torch.testing.assert_close(_attend(c, q, qs), _attend(c, q, qs, int8_queries=True), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("B, L, splits", [(64, 8192, None), (8, 16384, None), (1, 4096, None), (4, 3000, 5)])
def test_gpu_int8_queries_long_rows(B, L, splits):
    """bf16 queries on the H200's shapes (32/8 heads, head_dim 128): the default launch against
    SDPA over the decoded keys with the rounded queries, and within bf16's tolerance of the
    fp16-operand launch."""
    lengths = [L - 37 * b for b in range(B)]
    c, q, qs = _case("q8", B, 32, 8, 1, 128, lengths, dtype=torch.bfloat16)
    out = _attend(c, q, qs, num_splits=splits)
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.float(), gathered_reference(c, round_queries_int8(q), qs), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), _attend(c, q, qs, int8_queries=False).float(), atol=tol, rtol=tol)
