"""Reference attention against a naive per-query loop, and chunked merging against one shot."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.kernels.reference import (
    OnlineSoftmax,
    causal_attention,
    causal_mask,
    partial_attention,
)


def naive_attention(q, k, v, q_start, kv_len, scale=None):
    """One query at a time: softmax over the keys it may see, zeros if it sees none."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, Hq, T, v.shape[3], dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(T):
                visible = [j for j in range(k.shape[2]) if j <= q_start[b] + i and j < kv_len[b]]
                if not visible:
                    continue
                kk = k[b, h // G, visible].double()  # (n, D)
                w = torch.softmax(kk @ q[b, h, i].double() * scale, dim=0)
                out[b, h, i] = w @ v[b, h // G, visible].double()
    return out.float()


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (6, 1)])
def test_causal_attention_per_row_positions(seed, hq, hkv):
    B, T, S, D = 3, 3, 7, 8
    q = torch.randn(B, hq, T, D)
    k, v = torch.randn(B, hkv, S, D), torch.randn(B, hkv, S, D)
    q_start, kv_len = [4, 2, -1], [7, 5, 3]  # row 2: query 0 sees nothing
    out = causal_attention(q, k, v, q_start=torch.tensor(q_start), kv_len=torch.tensor(kv_len))
    torch.testing.assert_close(out, naive_attention(q, k, v, q_start, kv_len), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2, :, 0], torch.zeros(hq, D)) and out[2, :, 1].abs().sum() > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_that_sees_nothing_gets_zeros_on_every_backend(seed, device, dtype):
    """SDPA answers a fully masked query with NaN on the CPU and with a mean of the values in
    some CUDA kernels; the reference gives zeros on both (an empty row beside a full one)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    B, Hq, Hkv, T, S, D = 2, 4, 1, 1, 30, 64
    q = torch.randn(B, Hq, T, D).to(device, dtype)
    k, v = (torch.randn(B, Hkv, S, D).to(device, dtype) for _ in range(2))
    q_start, kv_len = [9, 0], [30, 0]  # row 0 sees keys 0..9, row 1 none
    out = causal_attention(q, k, v, q_start=torch.tensor(q_start), kv_len=torch.tensor(kv_len))
    assert torch.equal(out[1].float().cpu(), torch.zeros(Hq, T, D))
    want = naive_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), q_start, kv_len)
    torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)


def test_causal_attention_defaults_to_newest_positions_and_scale(seed):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    expect = naive_attention(q, k, v, [4, 4], [9, 9], scale=0.3)
    torch.testing.assert_close(causal_attention(q, k, v, scale=0.3), expect, atol=1e-5, rtol=1e-5)


def test_causal_mask_accepts_a_scalar_tensor_and_key_start():
    m = causal_mask(2, 2, 3, torch.tensor(4), key_start=3)  # queries at 4, 5; keys 3, 4, 5
    expect = torch.tensor([[True, True, False], [True, True, True]])
    assert m.shape == (2, 1, 2, 3)
    assert torch.equal(m[0, 0], expect) and torch.equal(m[1, 0], expect)


@pytest.mark.parametrize("bounds", [[0, 9], [0, 4, 9], [0, 1, 2, 6, 7, 9], [0, 3, 5, 9]])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
def test_partial_chunks_merge_to_one_shot(seed, bounds, hq, hkv):
    B, T, S, D = 2, 4, 9, 8
    q = torch.randn(B, hq, T, D)
    k, v = torch.randn(B, hkv, S, D), torch.randn(B, hkv, S, D)
    q_start = S - T
    online = OnlineSoftmax()
    for a, b in zip(bounds, bounds[1:]):
        mask = causal_mask(B, T, b - a, q_start, key_start=a)
        online.add(*partial_attention(q, k[:, :, a:b], v[:, :, a:b], mask))
    torch.testing.assert_close(online.result(torch.float32), causal_attention(q, k, v), atol=1e-5, rtol=1e-5)
    # the merged log-sum-exp is that of all visible scores at once
    s = torch.einsum("bhtd,bhsd->bhts", q, k.repeat_interleave(hq // hkv, 1)) / math.sqrt(D)
    s = s.masked_fill(~causal_mask(B, T, S, q_start), float("-inf"))
    torch.testing.assert_close(online.lse, torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def test_chunk_that_no_query_sees_contributes_nothing(seed):
    q, k, v = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    # queries at 0 and 1: keys 2..5 are all in their future
    seen = partial_attention(q, k[:, :, :2], v[:, :, :2], causal_mask(1, 2, 2, 0))
    unseen = partial_attention(q, k[:, :, 2:], v[:, :, 2:], causal_mask(1, 2, 4, 0, key_start=2))
    assert torch.isinf(unseen[1]).all() and torch.equal(unseen[0], torch.zeros(1, 2, 2, 8))
    expect = causal_attention(q, k[:, :, :2], v[:, :, :2])
    online = OnlineSoftmax()
    online.add(*unseen)
    online.add(*unseen)  # two chunks that no query sees: still nothing, no NaN
    assert torch.equal(online.out, torch.zeros_like(online.out)) and torch.isinf(online.lse).all()
    online.add(*seen)
    torch.testing.assert_close(online.result(torch.float32), expect, atol=1e-6, rtol=0)


def test_partial_attention_value_head_dim_may_differ(seed):
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 6)
    out, _ = partial_attention(q, k, v, causal_mask(1, 3, 5, 2))
    torch.testing.assert_close(out, naive_attention(q, k, v, [2], [5]), atol=1e-5, rtol=1e-5)
