"""The Triton attention kernel over packed rows (a serving step's prompt chunks side by side in
one ``[1, H_q, N, D]`` forward, decode rows first) against SDPA row by row and against
``kvtier.kernels.paged.paged_attention_packed_reference``. Without CUDA the kernel runs
under Triton's interpreter on small shapes; the ``gpu``-marked test takes a serving step's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_triton_paged import (  # the same cache builder and references as the other kernel tests
    DEVICE,
    IN_PROCESS,
    ON_GPU,
    TOL,
    build_cache,
    gathered_reference,
)

from kvtier.kernels.dispatch import KernelDispatch
from kvtier.kernels.paged import paged_attention_packed, paged_attention_packed_reference
from kvtier.kernels.reference import round_queries_int8
from kvtier.kernels.triton_paged import LaunchConfig, paged_attention_triton
from triton_support import in_this_process_or_a_fresh_one

_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)


# -- packed rows (prompt chunks of several rows in one forward) --------------------------------
def run_packed(mode, counts, lengths, Hq, H_kv, D, page, dtype, *, block_n=None, seed=0, singles=0):
    """Row ``b``'s last ``counts[b]`` tokens as queries, the rows side by side in ``[1, Hq, N, D]``
    (one spare token at the end that no row names); the kernel against each row's SDPA over its
    gathered K/V and against the padded reference. ``singles``: the leading one-query rows that
    go to the decode launch (``single_rows``)."""
    c = build_cache(mode, len(lengths), H_kv, D, page, lengths, dtype, seed=seed)
    N = sum(counts)
    q = torch.randn(1, Hq, N + 1, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    offsets = [sum(counts[:b]) for b in range(len(counts))]
    to = dict(dtype=torch.int64, device=DEVICE)
    qs = torch.tensor([n - k for n, k in zip(lengths, counts)], **to)
    qo = torch.tensor(offsets, **to)
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    width = max(1, max(counts))
    out = paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], q_offsets=qo,
                                 max_q_len=width, config=LaunchConfig(block_n=block_n), single_rows=singles,
                                 **kw)
    assert out.shape == q.shape and out.dtype == dtype
    # token-major (TurboQuant's too, as rotate_back keeps it): the model's (1, N, H_q * D) view is free
    assert out.transpose(1, 2).is_contiguous()
    tol = TOL[dtype]
    if mode == "q8" and ON_GPU and dtype != torch.float32:  # the kernel scores q8 keys with int8 queries
        q = round_queries_int8(q).to(dtype)
    for b, (o, k) in enumerate(zip(offsets, counts)):
        if not k:
            continue
        one = {**c, "table": c["table"][b : b + 1], "kv_len": c["kv_len"][b : b + 1]}
        ref = gathered_reference(one, q[:, :, o : o + k], qs[b : b + 1])  # (1, Hq, k, D)
        torch.testing.assert_close(out[:, :, o : o + k].float(), ref, atol=tol, rtol=tol)
    ref2 = paged_attention_packed_reference(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], q_offsets=qo,
                                            max_q_len=width, **kw)
    assert torch.count_nonzero(ref2[:, :, N:]) == 0  # the spare token: no row names it
    torch.testing.assert_close(out[:, :, :N].float(), ref2[:, :, :N].float(), atol=tol, rtol=tol)
    return c, out


@pytest.mark.parametrize(
    "mode, counts, lengths, Hq, H_kv, D, dtype",
    [
        ("fp", [5, 1, 7], [8, 1, 13], 4, 1, 64, torch.float32),  # a chunk after history, a 1-token row
        ("fp", [3, 0, 40], [3, 9, 40], 8, 2, 64, torch.bfloat16),  # a row with no queries; full prefill
        ("fp", [17, 2], [50, 2], 2, 2, 128, torch.float16),  # MHA, D 128
        ("q8", [4, 9], [30, 9], 4, 1, 64, torch.bfloat16),
        ("fp8", [6, 3], [6, 20], 4, 1, 64, torch.bfloat16),
        ("turboquant:q8_0,q3_0", [5, 2], [21, 2], 4, 1, 64, torch.bfloat16),
    ],
)
def test_packed_rows_match_each_row_alone(mode, counts, lengths, Hq, H_kv, D, dtype):
    run_packed(mode, counts, lengths, Hq, H_kv, D, 16, dtype)


@pytest.mark.parametrize(
    "mode, counts, lengths, singles",
    [
        ("fp", [1, 1, 5, 7], [40, 1, 8, 13], 2),  # two decode rows, then chunks
        ("fp", [1, 1, 1], [5, 70, 1], 3),  # decode rows only
        ("q8", [1, 4, 9], [33, 30, 9], 1),
        ("fp8", [1, 6], [50, 6], 1),
        ("turboquant:q8_0,q3_0", [1, 1, 5], [21, 40, 5], 2),
    ],
)
def test_packed_rows_with_decode_rows_first(mode, counts, lengths, singles):
    """Leading one-query rows as a decode launch into the same token-major result: each row
    equals its SDPA, and the whole the packed launch of every row."""
    _, split = run_packed(mode, counts, lengths, 4, 1, 64, 16, torch.bfloat16, singles=singles)
    _, whole = run_packed(mode, counts, lengths, 4, 1, 64, 16, torch.bfloat16)
    n = sum(counts)
    torch.testing.assert_close(split[:, :, :n].float(), whole[:, :, :n].float(), atol=2e-2, rtol=2e-2)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=3),
       group=st.sampled_from([1, 4]))
def test_packed_random_rows(rows, group):
    counts = [k for k, _ in rows]
    lengths = [k + h for k, h in rows]  # h tokens of history before each chunk
    run_packed("fp", counts, lengths, group, 1, 64, 16, torch.float32)


def test_packed_dispatch_serves_from_the_kernel_and_the_reference_alike():
    c = build_cache("fp", 2, 1, 64, 16, [12, 5], torch.float32)
    q = torch.randn(1, 4, 9, 64, device=DEVICE)
    args = (q, c["kp"], c["vp"], c["table"], torch.tensor([8, 0], device=DEVICE), c["kv_len"])
    kw = dict(q_offsets=torch.tensor([0, 4], device=DEVICE), max_q_len=5, k_codec=c["kc"], v_codec=c["vc"],
              k_sidecars=c["ks"], v_sidecars=c["vs"])
    outs = {}
    for backend in ("triton", "torch"):
        dispatch = KernelDispatch(backend)
        outs[backend] = paged_attention_packed(dispatch, *args, **kw)
        assert dict(dispatch.attention_calls) == {backend: 1} and dispatch.fallback_reason is None
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_m", [16, 32])
def test_packed_rows_any_query_tile(block_m):
    """The packed launch's result does not depend on its query tile (``LaunchConfig.block_m``)."""
    c = build_cache("fp", 2, 1, 64, 16, [40, 9], torch.float32)
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    qs, qo = torch.tensor([10, 0], device=DEVICE), torch.tensor([0, 30], device=DEVICE)
    q = torch.randn(1, 4, 39, 64, device=DEVICE)
    outs = [paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], q_offsets=qo, max_q_len=30,
                                   config=LaunchConfig(block_m=m), **kw) for m in (block_m, None)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for bad in (0, 8, 48, True, 64.0):
        with pytest.raises(ValueError, match="block_m must be a power of two"):
            LaunchConfig(block_m=bad)


def test_packed_rows_reject_bad_input():
    c = build_cache("fp", 2, 1, 64, 16, [12, 5], torch.float32)
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    qs, qo = torch.tensor([8, 0], device=DEVICE), torch.tensor([0, 4], device=DEVICE)
    q = torch.randn(1, 4, 9, 64, device=DEVICE)
    with pytest.raises(ValueError, match="max_q_len must be"):
        paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], q_offsets=qo, max_q_len=0, **kw)
    with pytest.raises(ValueError, match="goes with q_offsets"):
        paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], max_q_len=5, **kw)
    with pytest.raises(ValueError, match=r"packed rows need q \[1"):
        paged_attention_triton(q.expand(2, -1, -1, -1), c["kp"], c["vp"], c["table"], qs, c["kv_len"],
                               q_offsets=qo, max_q_len=5, **kw)
    with pytest.raises(ValueError, match="q_offsets must be"):
        paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], q_offsets=qo[:1],
                               max_q_len=5, **kw)
    for ref in (True, False) if not ON_GPU else (True,):  # the kernel checks lengths on the CPU only
        call = paged_attention_packed_reference if ref else paged_attention_triton
        with pytest.raises(ValueError, match="packed rows must name queries inside"):
            call(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], q_offsets=torch.tensor([0, 5], device=DEVICE),
                 max_q_len=5, **kw)  # row 1's 5 queries would run past q's 9 tokens
        with pytest.raises(ValueError, match="packed rows must name queries inside"):
            call(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], q_offsets=qo, max_q_len=4, **kw)
    for bad in (-1, 3, True, 1.0):
        with pytest.raises(ValueError, match="single_rows must be an int in"):
            paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], q_offsets=qo,
                                   max_q_len=5, single_rows=bad, **kw)
    with pytest.raises(ValueError, match="single_rows goes with q_offsets"):
        paged_attention_triton(q[0, :, :2].transpose(0, 1)[:, :, None], c["kp"], c["vp"], c["table"],
                               qs, c["kv_len"], single_rows=1, **kw)
    if not ON_GPU:  # row 0 feeds 4 queries: it cannot go to the decode launch
        with pytest.raises(ValueError, match="must feed one query each"):
            paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], q_offsets=qo,
                                   max_q_len=5, single_rows=1, **kw)


@pytest.mark.parametrize("mode", ["fp", "q8", "q4", "fp8", "turboquant:q8_0,q3_0"])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_packed_prompt_chunks(mode):
    # a step's chunks: a whole prompt, a chunk after 700 tokens of history, a 2-token tail, a long one
    run_packed(mode, [300, 256, 2, 1024], [300, 956, 90, 1024], 32, 8, 128, 16, torch.bfloat16)
    # a serving step: decode rows first (longest context first), as a decode launch, then chunks
    run_packed(mode, [1, 1, 1, 300, 256, 2], [1300, 700, 64, 300, 956, 90], 32, 8, 128, 16, torch.bfloat16,
               singles=3)
