"""A sliding window on the Triton attention kernel: query ``i`` of row ``b`` sees keys ``q_start[b] +
i - window < j <= q_start[b] + i`` (``j < kv_len[b]``), each tile read from its first query's
window. Against SDPA over each row's gathered keys under the window's mask and against the
PyTorch references, for decode steps (which leave the Gluon and CUDA-core kernels for this one),
prompt chunks, packed rows, the ragged tier's buffers and the dispatch. Without CUDA the kernel
runs under Triton's interpreter on small shapes; the ``gpu``-marked tests take a model's."""

from __future__ import annotations

import pytest
import torch
from test_triton_paged import DEVICE, IN_PROCESS, ON_GPU, TOL, build_cache, gathered_reference

from triton_support import in_this_process_or_a_fresh_one

if IN_PROCESS:
    from kvtier.kernels.dispatch import KernelDispatch
    from kvtier.kernels.paged import (
        paged_attention,
        paged_attention_packed,
        paged_attention_packed_reference,
        paged_attention_reference,
    )
    from kvtier.kernels.ragged import ragged_attention
    from kvtier.kernels.reference import causal_attention, round_queries_int8
    from kvtier.kernels.triton_paged import LaunchConfig, paged_attention_triton
    from kvtier.kernels.triton_ragged import ragged_decode_attention_triton, ragged_decode_reference

_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)


def _kw(c):
    return dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])


def run_windowed(mode, Hq, H_kv, T, D, page, lengths, window, dtype, *, q_start=None, splits=None, seed=0):
    """The kernel over rows of ``lengths`` keys, ``T`` queries a row from ``q_start`` (default: the
    rows' last ``T`` positions), against SDPA over the gathered keys and the paged reference."""
    c = build_cache(mode, len(lengths), H_kv, D, page, lengths, dtype, seed=seed)
    q = torch.randn(len(lengths), Hq, T, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    qs = torch.tensor(q_start or [max(0, n - T) for n in lengths], dtype=torch.int64, device=DEVICE)
    out = paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], window=window,
                                 config=LaunchConfig(num_splits=splits), **_kw(c))
    assert out.shape == q.shape and out.dtype == dtype
    if mode == "q8" and ON_GPU and dtype != torch.float32:  # the kernel scores q8 keys with int8 queries
        q = round_queries_int8(q).to(dtype)
    tol = TOL[dtype] * (4 if mode.startswith("turboquant") else 1)
    torch.testing.assert_close(out.float(), gathered_reference(c, q, qs, window=window), atol=tol, rtol=tol)
    ref = paged_attention_reference(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], window=window, **_kw(c))
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # the window matters in these cases: without it the answer is another (by more than the tolerance)
    assert (gathered_reference(c, q, qs) - ref.float()).abs().max() > 2 * tol
    return out


@pytest.mark.parametrize("mode, Hq, H_kv, D, lengths, window, splits, dtype", [
    ("fp", 4, 1, 64, [1, 20, 47], 8, None, torch.float32),  # a row shorter than the window; mid-block starts
    ("fp", 8, 2, 64, [40, 33], 5, 3, torch.bfloat16),  # three splits, the first ones before every window
    ("fp", 4, 4, 128, [64, 17], 16, 2, torch.float16),  # a window of one block
    ("fp", 4, 1, 64, [300, 170, 9], 20, 4, torch.float32),  # splits over the window, not the table
    ("q8", 4, 1, 64, [30, 9], 7, 2, torch.bfloat16),
    ("q4", 4, 1, 64, [37, 25], 6, None, torch.bfloat16),
    ("turboquant:q8_0,q3_0", 4, 1, 64, [29, 50], 9, 2, torch.bfloat16),
])
def test_decode_steps_see_the_window(mode, Hq, H_kv, D, lengths, window, splits, dtype):
    run_windowed(mode, Hq, H_kv, 1, D, 16, lengths, window, dtype, splits=splits)


@pytest.mark.parametrize("T, lengths, q_start, window, splits", [
    (5, [40, 12], None, 6, 2),  # the rows' last tokens: a chunk past the window
    (4, [30, 4], [10, 0], 3, None),  # queries inside the cache (a chunked prefill)
    (6, [20, 33], [17, 30], 4, 2),  # queries past the committed keys (a partial commit)
    (9, [9, 25], None, 1, None),  # a window of one key: each query sees itself
    (5, [260, 120], [200, 100], 30, 3),  # long rows: three splits over the window's 34 keys
])
def test_prompt_chunks_see_the_window(T, lengths, q_start, window, splits):
    run_windowed("fp", 4, 2, T, 64, 16, lengths, window, torch.float32, q_start=q_start, splits=splits)


def test_a_window_longer_than_every_row_changes_nothing():
    c = build_cache("fp", 2, 1, 64, 16, [23, 40], torch.float32)
    q = torch.randn(2, 4, 3, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    qs = c["kv_len"] - 3
    whole = paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], **_kw(c))
    wide = paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], window=40, **_kw(c))
    torch.testing.assert_close(wide, whole, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("mode, singles", [("fp", 2), ("q8", 0)])
def test_packed_rows_see_the_window(mode, singles):
    """Two decode rows (a launch of their own), then chunks past the window, side by side."""
    counts, lengths, window, dtype = [1, 1, 5, 7], [20, 9, 30, 7], 6, torch.bfloat16
    c = build_cache(mode, len(lengths), 1, 64, 16, lengths, dtype)
    N = sum(counts)
    q = torch.randn(1, 4, N, 64, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    to = dict(dtype=torch.int64, device=DEVICE)
    qs = torch.tensor([n - k for n, k in zip(lengths, counts)], **to)
    offsets = [sum(counts[:b]) for b in range(len(counts))]
    kw = dict(q_offsets=torch.tensor(offsets, **to), max_q_len=max(counts), **_kw(c))
    out = paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], single_rows=singles,
                                 window=window, **kw)
    if mode == "q8" and ON_GPU:
        q = round_queries_int8(q).to(dtype)
    tol = TOL[dtype]
    for b, (o, k) in enumerate(zip(offsets, counts)):
        one = {**c, "table": c["table"][b : b + 1], "kv_len": c["kv_len"][b : b + 1]}
        ref = gathered_reference(one, q[:, :, o : o + k], qs[b : b + 1], window=window)
        torch.testing.assert_close(out[:, :, o : o + k].float(), ref, atol=tol, rtol=tol)
    ref2 = paged_attention_packed_reference(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], window=window, **kw)
    torch.testing.assert_close(out.float(), ref2.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("q_start, splits", [(None, None), ([19, 3, 40], 2)])
def test_ragged_decode_sees_the_window(q_start, splits):
    """Rows of a padded buffer; given positions past a row's keys (a partial commit) keep theirs."""
    gen = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(3, 2, 48, 64, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(3, 4, 1, 64, generator=gen).to(DEVICE)
    kv_len = torch.tensor([20, 3, 37], device=DEVICE)
    qs = None if q_start is None else torch.tensor(q_start, device=DEVICE)
    out = ragged_decode_attention_triton(q, keys, values, kv_len, window=7, q_start=qs,
                                         config=LaunchConfig(num_splits=splits))
    ref = ragged_decode_reference(q, keys, values, kv_len, window=7, q_start=qs)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=0)
    ref2 = causal_attention(q, keys, values, q_start=kv_len - 1 if qs is None else qs, kv_len=kv_len, window=7)
    torch.testing.assert_close(out, ref2, atol=TOL[torch.float32], rtol=0)
    with pytest.raises(ValueError, match="q_start goes with a window"):
        ragged_decode_attention_triton(q, keys, values, kv_len, q_start=kv_len - 1)


def test_the_dispatch_sends_windowed_calls_to_the_kernel():
    c = build_cache("fp", 2, 1, 64, 16, [9, 30], torch.float32)
    dispatch = KernelDispatch("triton")
    for T in (1, 4):
        q = torch.randn(2, 4, T, 64, generator=torch.Generator().manual_seed(T)).to(DEVICE)
        qs = c["kv_len"] - T
        out = paged_attention(dispatch, q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], window=5, **_kw(c))
        ref = paged_attention_reference(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], window=5, **_kw(c))
        torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=0)
    kw = dict(q_offsets=torch.tensor([0, 1], device=DEVICE), max_q_len=3, single_rows=1, window=5, **_kw(c))
    q = torch.randn(1, 4, 4, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    qs = c["kv_len"] - torch.tensor([1, 3], device=DEVICE)
    out = paged_attention_packed(dispatch, q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], **kw)
    kw.pop("single_rows")
    ref = paged_attention_packed_reference(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], **kw)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=0)
    keys, values = torch.randn(2, 2, 2, 40, 64, device=DEVICE).unbind(0)
    q = torch.randn(2, 4, 1, 64, device=DEVICE)
    kv_len = torch.tensor([40, 11], device=DEVICE)
    out = ragged_attention(dispatch, q, keys, values, kv_len - 1, kv_len, window=6)
    torch.testing.assert_close(out, causal_attention(q, keys, values, q_start=kv_len - 1, kv_len=kv_len, window=6),
                               atol=TOL[torch.float32], rtol=0)
    assert dict(dispatch.attention_calls) == {"triton": 4} and dispatch.fallback_reason is None


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_a_window_that_is_not_a_positive_int_is_refused(window):
    c = build_cache("fp", 1, 1, 64, 16, [9], torch.float32)
    q = torch.randn(1, 4, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="window must be a positive int"):
        paged_attention_triton(q, c["kp"], c["vp"], c["table"], c["kv_len"] - 1, c["kv_len"], window=window, **_kw(c))
    with pytest.raises(ValueError, match="window must be a positive int"):
        ragged_decode_attention_triton(q, torch.zeros(1, 1, 9, 64, device=DEVICE), torch.zeros(1, 1, 9, 64, device=DEVICE),
                                       c["kv_len"], window=window)
    dispatch = KernelDispatch("triton")  # refused before the kernel: no fallback for later calls
    with pytest.raises(ValueError, match="window must be a positive int"):
        paged_attention(dispatch, q, c["kp"], c["vp"], c["table"], c["kv_len"] - 1, c["kv_len"], window=window, **_kw(c))
    with pytest.raises(ValueError, match="window must be a positive int"):
        ragged_attention(dispatch, q, *torch.zeros(2, 1, 1, 9, 64, device=DEVICE), c["kv_len"] - 1, c["kv_len"],
                         window=window)
    assert dispatch.fallback_reason is None and not dispatch.attention_calls


@pytest.mark.parametrize("tier", ["ragged", "paged"])
@torch.no_grad()
def test_a_windowed_model_on_the_kernel_gives_the_references_logits(tier):
    """A random model with a window of 6 in its first layer: a 4-token chunk, then one token a
    call to 14 (past the window), rows of different lengths; the tiers on the kernel against the
    same tiers on the PyTorch reference."""
    from kvtier.config import KVCacheConfig
    from kvtier.model import ModelArgs, build_random

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=50,
                     sliding_window=6, sliding_layers=(0,))
    model = build_random(args, device=DEVICE)
    ids = torch.randint(0, 50, (2, 14), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    logits, calls = {}, None
    for backend in ("triton", "torch"):
        cfg = KVCacheConfig(tier=tier, step=16, paged_block_size=4, paged_num_blocks=32, attention_backend=backend)
        caches = model.make_caches(cfg, batch_size=2)
        out = [model(ids[:, :4], caches)] + [model(ids[:, t : t + 1], caches) for t in range(4, 14)]
        logits[backend] = torch.cat(out, 1)
        calls = calls or dict(caches[0].dispatch.calls["attention"])
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    # (the ragged tier's kernel takes one query a row: its 4-token chunk goes to the reference)
    assert calls == ({"triton": 10, "torch": 1} if tier == "ragged" else {"triton": 11}), calls


# -- a model's shapes on the GPU -------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fp", "q8", "q4", "q4_g32", "fp8", "turboquant:q8_0,q3_0"])
@pytest.mark.parametrize("T", [1, 7])
def test_gpu_windowed_steps_at_a_models_shape(mode, T):
    """B=8, 32/8 heads of 128, rows of 1,000 to 4,100 keys past a window of 1,024 (a Mistral's
    shape, scaled), bf16: every page kind, a decode step and a verify-sized chunk."""
    lengths = [1000 + 443 * b for b in range(8)]
    run_windowed(mode, 32, 8, T, 128, 16, lengths, 1024, torch.bfloat16)
