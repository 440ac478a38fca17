"""BlockOwnedKVCache against a plain list of tokens, PyTorch SDPA, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache

D = 4  # small head_dim keeps the property tests fast


def sdpa(q, k, v, scale=None):
    """Causal attention of the T newest positions straight through torch's SDPA."""
    T, S = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 300)),
        st.tuples(st.just("trim"), st.integers(0, 400)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(
    ops=ops,
    batch=st.integers(1, 3),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    block_size=st.sampled_from([7, 32, 1024]),
    seed=st.integers(0, 2**16),
)
def test_matches_a_list_of_tokens(ops, batch, heads, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    cache = BlockOwnedKVCache(block_size=block_size)
    ref_k: list[torch.Tensor] = []  # one [B, H_kv, D] tensor per token, every row alike
    ref_v: list[torch.Tensor] = []
    highest = 0
    for op, n in ops:
        if op == "update":
            k = torch.randn(batch, hkv, n, D, generator=gen)
            v = torch.randn(batch, hkv, n, D, generator=gen)
            K, V = cache.update_and_fetch(k, v)
            ref_k += list(k.unbind(2))
            ref_v += list(v.unbind(2))
            assert torch.equal(K, torch.stack(ref_k, 2)) and torch.equal(V, torch.stack(ref_v, 2))
        else:
            dropped = cache.trim(n)
            assert dropped == min(n, len(ref_k))
            del ref_k[len(ref_k) - dropped :], ref_v[len(ref_v) - dropped :]
        highest = max(highest, len(ref_k))
        assert cache.offset == cache.size() == len(ref_k)
        assert cache.num_blocks == math.ceil(highest / block_size)
        assert cache.stats()["grow_events"] == cache.num_blocks
        starts = [s for s, _, _ in cache.active_block_slices()]
        assert starts == list(range(0, len(ref_k), block_size))
    if ref_k:  # attention of the newest tokens over everything held, once per example
        q = torch.randn(batch, hq, min(len(ref_k), 7), D, generator=gen)
        expect = sdpa(q, torch.stack(ref_k, 2), torch.stack(ref_v, 2))
        torch.testing.assert_close(cache.attention(q), expect, atol=1e-5, rtol=1e-5)


def test_writes_split_across_block_boundaries(seed):
    cache = BlockOwnedKVCache(block_size=4)
    k, v = torch.randn(1, 2, 10, D), torch.randn(1, 2, 10, D)
    cache.update(k[:, :, :3], v[:, :, :3])
    assert cache.num_blocks == 1
    cache.update(k[:, :, 3:10], v[:, :, 3:10])  # 3..9 spans blocks 0, 1 and 2
    assert cache.num_blocks == 3
    slices = cache.active_block_slices()
    assert [(s, kb.shape[2]) for s, kb, _ in slices] == [(0, 4), (4, 4), (8, 2)]
    for (start, kb, vb), block_k, block_v in zip(slices, cache.key_blocks, cache.value_blocks):
        assert kb.data_ptr() == block_k.data_ptr() and vb.data_ptr() == block_v.data_ptr()  # views
        assert torch.equal(kb, k[:, :, start : start + kb.shape[2]])
        assert torch.equal(vb, v[:, :, start : start + vb.shape[2]])


def test_fetch_is_a_view_within_one_block_and_a_concatenation_across(seed):
    cache = BlockOwnedKVCache(block_size=8)
    cache.update(torch.randn(1, 2, 5, D), torch.randn(1, 2, 5, D))
    assert cache.fetch()[0].data_ptr() == cache.key_blocks[0].data_ptr()
    cache.update(torch.randn(1, 2, 5, D), torch.randn(1, 2, 5, D))
    K, _ = cache.fetch()
    assert K.shape == (1, 2, 10, D) and K.data_ptr() != cache.key_blocks[0].data_ptr()


def test_trim_keeps_blocks_and_later_writes_reuse_them(seed):
    cache = BlockOwnedKVCache(block_size=4)
    cache.update(torch.randn(1, 1, 10, D), torch.randn(1, 1, 10, D))
    blocks = [b.data_ptr() for b in cache.key_blocks]
    assert cache.trim(7) == 7 and cache.num_blocks == 3
    k = torch.randn(1, 1, 6, D)
    cache.update(k, k)  # offset 3 -> 9: blocks 0..2 again, no new one
    assert [b.data_ptr() for b in cache.key_blocks] == blocks
    assert torch.equal(cache.fetch()[0][:, :, 3:], k)


@pytest.mark.parametrize("chunks", [[1] * 10, [5, 1, 1, 9, 1, 3], [16, 3, 1], [33]])
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)])
def test_attention_equals_sdpa_across_blocks(seed, chunks, heads, monkeypatch):
    hq, hkv = heads
    cache = BlockOwnedKVCache(block_size=4)
    for t in chunks:
        k, v = torch.randn(2, hkv, t, 16), torch.randn(2, hkv, t, 16)
        q = torch.randn(2, hq, t, 16)
        K, V = cache.update_and_fetch(k, v)
        with monkeypatch.context() as m:
            m.setattr(torch, "cat", None)  # attention must not concatenate the blocks
            out, scaled = cache.attention(q), cache.attention(q, scale=0.2)
        torch.testing.assert_close(out, sdpa(q, K, V), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scaled, sdpa(q, K, V, scale=0.2), atol=1e-5, rtol=1e-5)
        assert out.dtype == q.dtype


def test_the_cache_owns_its_copy(seed):
    qkv = torch.randn(1, 6, 6, D)  # a fused projection; K and V are slices of it
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    cache = BlockOwnedKVCache(block_size=4)
    cache.update(k, v)
    expect_k, expect_v = k.clone(), v.clone()
    qkv.add_(1.0)
    assert torch.equal(cache.fetch()[0], expect_k) and torch.equal(cache.fetch()[1], expect_v)


def _snapshot(cache):
    k, v = cache.fetch()
    return (cache.offset, cache.num_blocks, cache.nbytes, dict(cache.copy_stats.as_dict()),
            k.clone(), v.clone())


def _same(a, b):
    assert a[:4] == b[:4] and torch.equal(a[4], b[4]) and torch.equal(a[5], b[5])


def _bad_updates():
    k = torch.randn(2, 2, 3, D)
    return {
        "rank": (k[0], k[0]),
        "kv_length": (k, torch.randn(2, 2, 2, D)),
        "batch": (torch.randn(1, 2, 3, D),) * 2,
        "heads": (torch.randn(2, 1, 3, D),) * 2,
        "head_dim": (torch.randn(2, 2, 3, D + 1),) * 2,
        "dtype": (k.double(), k.double()),
        "kv_dtype": (k, k.half()),
        "device": (torch.empty(2, 2, 3, D, device="meta"),) * 2,
        "zero_tokens": (k[:, :, :0], k[:, :, :0]),
        "not_a_tensor": (k.tolist(), k),
    }


@pytest.mark.parametrize("case", list(_bad_updates()))
def test_bad_update_raises_and_leaves_the_cache_unchanged(seed, case):
    cache = BlockOwnedKVCache(block_size=4)
    cache.update(torch.randn(2, 2, 4, D), torch.randn(2, 2, 4, D))  # full: next write allocates
    before = _snapshot(cache)
    with pytest.raises(ValueError):
        cache.update(*_bad_updates()[case])
    _same(before, _snapshot(cache))


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.trim(-1),
        lambda c: c.trim("2"),
        lambda c: c.attention(torch.randn(2, 3, 1, D)),  # heads not a multiple of 2
        lambda c: c.attention(torch.randn(2, 2, 1, D + 1)),  # head_dim
        lambda c: c.attention(torch.randn(1, 2, 1, D)),  # batch
        lambda c: c.attention(torch.randn(2, 2, 6, D)),  # more queries than tokens
    ],
)
def test_bad_trim_or_queries_raise_and_leave_the_cache_unchanged(seed, call):
    cache = BlockOwnedKVCache(block_size=4)
    cache.update(torch.randn(2, 2, 5, D), torch.randn(2, 2, 5, D))
    before = _snapshot(cache)
    with pytest.raises(ValueError):
        call(cache)
    _same(before, _snapshot(cache))


def test_empty_cache_and_bad_block_size():
    cache = BlockOwnedKVCache()
    assert cache.empty() and cache.num_blocks == 0 and cache.active_block_slices() == []
    with pytest.raises(ValueError, match="empty"):
        cache.fetch()
    with pytest.raises(ValueError, match="empty"):
        cache.attention(torch.randn(1, 1, 1, D))
    for bad in (0, -4, 16.0, False):
        with pytest.raises(ValueError, match="block_size"):
            BlockOwnedKVCache(block_size=bad)


@pytest.mark.parametrize("trim", [0, 5, 11])
def test_state_round_trip_keeps_contents_and_blocks(seed, trim):
    cache = BlockOwnedKVCache(block_size=4)
    cache.update(torch.randn(2, 2, 11, D), torch.randn(2, 2, 11, D))
    cache.trim(trim)
    back = BlockOwnedKVCache.from_state(cache.state, cache.meta_state)
    assert back.meta_state == cache.meta_state and back.num_blocks == 3
    for a, b in zip(back.fetch(), cache.fetch()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="dtype"):
        back.update(torch.randn(2, 2, 1, D).double(), torch.randn(2, 2, 1, D).double())


def test_from_state_rejects_an_inconsistent_state(seed):
    k = torch.randn(1, 2, 9, D)
    meta = {"tier": "block", "block_size": 4, "offset": 9, "num_blocks": 3}
    with pytest.raises(ValueError, match="num_blocks"):
        BlockOwnedKVCache.from_state({"keys": k, "values": k}, meta | {"num_blocks": 2})
    with pytest.raises(ValueError, match="offset"):
        BlockOwnedKVCache.from_state({"keys": k, "values": k}, meta | {"offset": 8})
    with pytest.raises(ValueError, match="block_size"):
        BlockOwnedKVCache.from_state({"keys": k, "values": k}, meta | {"block_size": "4"})


def test_from_cache_converts_a_tail_cache(seed):
    tail = TailOwnedKVCache(step=4)
    tail.update(torch.randn(1, 2, 9, D), torch.randn(1, 2, 9, D))
    block = BlockOwnedKVCache.from_cache(tail, block_size=4)
    assert block.offset == 9 and block.num_blocks == 3
    for a, b in zip(block.fetch(), tail.fetch()):
        assert torch.equal(a, b)
    assert BlockOwnedKVCache.from_cache(TailOwnedKVCache()).empty()
