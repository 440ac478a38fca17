"""TailOwnedKVCache against a plain list of tokens, PyTorch SDPA, and bad input."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.kernels.reference import causal_attention

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
    step=st.sampled_from([1, 7, 64, 256]),
    seed=st.integers(0, 2**16),
)
def test_matches_a_list_of_tokens(ops, batch, heads, step, seed):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    cache = TailOwnedKVCache(step=step)
    ref_k: list[torch.Tensor] = []  # one [B, H_kv, D] tensor per token, every row alike
    ref_v: list[torch.Tensor] = []
    updates = copied = 0
    for op, n in ops:
        if op == "update":
            k = torch.randn(batch, hkv, n, D, generator=gen)
            v = torch.randn(batch, hkv, n, D, generator=gen)
            K, V = cache.update_and_fetch(k, v)
            ref_k += list(k.unbind(2))
            ref_v += list(v.unbind(2))
            updates, copied = updates + 1, copied + 2 * k.numel() * 4
            assert torch.equal(K, torch.stack(ref_k, 2)) and torch.equal(V, torch.stack(ref_v, 2))
        else:
            dropped = cache.trim(n)
            assert dropped == min(n, len(ref_k))
            del ref_k[len(ref_k) - dropped :], ref_v[len(ref_v) - dropped :]
        assert cache.offset == cache.size() == len(ref_k)
        assert cache.capacity % step == 0 and cache.capacity >= cache.offset
        assert cache.stats()["updates"] == updates and cache.stats()["bytes"] == copied
    if ref_k:  # attention of the newest tokens over everything held, once per example
        q = torch.randn(batch, hq, min(len(ref_k), 7), D, generator=gen)
        expect = sdpa(q, torch.stack(ref_k, 2), torch.stack(ref_v, 2))
        torch.testing.assert_close(cache.attention(q), expect, atol=1e-5, rtol=1e-5)


def test_growth_is_stepwise_and_copies_only_the_live_prefix(seed):
    cache = TailOwnedKVCache(step=4)
    cache.update(torch.randn(1, 2, 3, D), torch.randn(1, 2, 3, D))
    assert (cache.capacity, cache.stats()["grow_events"]) == (4, 1)
    cache.update(torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D))
    assert (cache.capacity, cache.stats()["grow_events"]) == (4, 1)  # fits: no growth
    k, v = cache.fetch()
    live = k[:, :, :2].clone()
    cache.trim(2)
    cache.update(torch.randn(1, 2, 7, D), torch.randn(1, 2, 7, D))  # 2 + 7 = 9 -> 12
    assert (cache.capacity, cache.stats()["grow_events"]) == (12, 2)
    assert torch.equal(cache.fetch()[0][:, :, :2], live)
    s = cache.tail_owner_stats()
    assert s["tail_owner_grow_events"] == 2 and s["tail_owner_updates"] == 3


@pytest.mark.parametrize("chunks", [[1] * 6, [5, 1, 1, 9, 1], [16, 3, 1]])
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)])
def test_attention_equals_sdpa_decode_and_prefill(seed, chunks, heads):
    hq, hkv = heads
    cache = TailOwnedKVCache(step=8)
    for t in chunks:
        k, v = torch.randn(2, hkv, t, 16), torch.randn(2, hkv, t, 16)
        q = torch.randn(2, hq, t, 16)
        K, V = cache.update_and_fetch(k, v)
        torch.testing.assert_close(cache.attention(q), sdpa(q, K, V), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            cache.attention(q, scale=0.2), sdpa(q, K, V, scale=0.2), atol=1e-5, rtol=1e-5
        )


def test_the_cache_owns_its_copy(seed):
    qkv = torch.randn(1, 6, 3, D)  # a fused projection; K and V are slices of it
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    cache = TailOwnedKVCache(step=4)
    K, V = cache.update_and_fetch(k, v)
    expect_k, expect_v = k.clone(), v.clone()
    qkv.add_(1.0)
    assert torch.equal(cache.fetch()[0], expect_k) and torch.equal(cache.fetch()[1], expect_v)
    assert K.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()


def _snapshot(cache):
    k, v = cache.fetch()
    return (cache.offset, cache.capacity, cache.nbytes, dict(cache.copy_stats.as_dict()),
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
    cache = TailOwnedKVCache(step=4)
    cache.update(torch.randn(2, 2, 4, D), torch.randn(2, 2, 4, D))  # full: next write grows
    before = _snapshot(cache)
    with pytest.raises(ValueError):
        cache.update(*_bad_updates()[case])
    _same(before, _snapshot(cache))


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.trim(-1),
        lambda c: c.trim(1.5),
        lambda c: c.attention(torch.randn(2, 3, 1, D)),  # heads not a multiple of 2
        lambda c: c.attention(torch.randn(2, 2, 1, D + 1)),  # head_dim
        lambda c: c.attention(torch.randn(1, 2, 1, D)),  # batch
        lambda c: c.attention(torch.randn(2, 2, 6, D)),  # more queries than tokens
    ],
)
def test_bad_trim_or_queries_raise_and_leave_the_cache_unchanged(seed, call):
    cache = TailOwnedKVCache(step=4)
    cache.update(torch.randn(2, 2, 5, D), torch.randn(2, 2, 5, D))
    before = _snapshot(cache)
    with pytest.raises(ValueError):
        call(cache)
    _same(before, _snapshot(cache))


def test_empty_cache_and_bad_step():
    cache = TailOwnedKVCache()
    assert cache.empty() and cache.offset == 0 and cache.trim(3) == 0 and cache.nbytes == 0
    with pytest.raises(ValueError, match="empty"):
        cache.fetch()
    with pytest.raises(ValueError, match="empty"):
        cache.attention(torch.randn(1, 1, 1, D))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="step"):
            TailOwnedKVCache(step=bad)


@pytest.mark.parametrize("trim", [0, 3, 10])
def test_state_round_trip(seed, trim):
    cache = TailOwnedKVCache(step=4)
    cache.update(torch.randn(2, 2, 10, D), torch.randn(2, 2, 10, D))
    cache.trim(trim)
    back = TailOwnedKVCache.from_state(cache.state, cache.meta_state)
    assert back.meta_state == cache.meta_state
    assert back.capacity == math.ceil(max(cache.offset, 1) / 4) * 4
    for a, b in zip(back.fetch(), cache.fetch()):
        assert torch.equal(a, b)
    # the restored cache keeps checking input against what it holds, even with 0 tokens
    with pytest.raises(ValueError, match="head_dim"):
        back.update(torch.randn(2, 2, 1, D + 1), torch.randn(2, 2, 1, D + 1))


def test_from_state_rejects_an_inconsistent_state(seed):
    k = torch.randn(1, 2, 3, D)
    with pytest.raises(ValueError, match="offset"):
        TailOwnedKVCache.from_state({"keys": k, "values": k}, {"tier": "tail", "step": 4, "offset": 2})
    with pytest.raises(ValueError, match="values"):
        TailOwnedKVCache.from_state({"keys": k}, {"tier": "tail", "step": 4, "offset": 3})
    with pytest.raises(ValueError, match="step"):
        TailOwnedKVCache.from_state({}, {"tier": "tail", "offset": 0})


def test_from_cache_converts_a_block_cache(seed):
    block = BlockOwnedKVCache(block_size=3)
    block.update(torch.randn(1, 2, 8, D), torch.randn(1, 2, 8, D))
    block.trim(1)
    tail = TailOwnedKVCache.from_cache(block, step=4)
    assert tail.offset == 7 and tail.capacity == 8
    for a, b in zip(tail.fetch(), block.fetch()):
        assert torch.equal(a, b)
    assert TailOwnedKVCache.from_cache(BlockOwnedKVCache()).empty()


def test_a_write_in_place_after_make_room_is_booked_as_update_books_a_copy():
    """make_room grows as update() would; keys and values written at the offset by the caller and
    taken with commit_written give update()'s contents, offset, capacity and counters."""
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 7, 4, generator=g), torch.randn(1, 2, 7, 4, generator=g)
    copied, in_place = TailOwnedKVCache(step=4), TailOwnedKVCache(step=4)
    for s, e in ((0, 3), (3, 4), (4, 7)):
        copied.update(k[:, :, s:e], v[:, :, s:e])
        in_place.make_room(e - s, k[:, :, :0], v[:, :, :0])
        in_place.keys[:, :, s:e], in_place.values[:, :, s:e] = k[:, :, s:e], v[:, :, s:e]
        in_place.commit_written(e - s)
    assert in_place.offset == copied.offset == 7 and in_place.capacity == copied.capacity == 8
    for a, b in zip(in_place.fetch(), copied.fetch()):
        assert torch.equal(a, b)
    got, want = in_place.stats(), copied.stats()
    assert {n: got[n] for n in ("updates", "bytes", "grow_events")} == \
        {n: want[n] for n in ("updates", "bytes", "grow_events")}


def test_commit_written_takes_only_the_room_make_room_left():
    cache = TailOwnedKVCache(step=4)
    k = torch.zeros(1, 2, 0, 4)
    with pytest.raises(ValueError, match=r"commit_written\(1\) takes an int in \[1, 0\].*make_room\(\) first"):
        cache.commit_written(1)  # before: AttributeError on the missing buffers
    cache.make_room(3, k, k)
    for bad in (5, 0, -4, 2.0, True):  # before: an offset past the capacity, or negative
        with pytest.raises(ValueError, match=r"takes an int in \[1, 4\]"):
            cache.commit_written(bad)
    assert cache.offset == 0
    cache.commit_written(4)
    assert cache.offset == 4 == cache.capacity


@pytest.mark.parametrize("bad", [-5, 0, 2.5, True, "3"])
def test_make_room_takes_only_a_count_of_at_least_one(bad):
    cache = TailOwnedKVCache(step=4)
    k = torch.zeros(1, 2, 3, 4)
    cache.update(k, k)
    with pytest.raises(ValueError, match=re.escape(f"make_room({bad!r}) takes an int >= 1")):
        cache.make_room(bad, k, k)  # (before: taken, and -5 or 2.5 silently made no room)
    assert (cache.offset, cache.capacity) == (3, 4)


# -- kv_dtype: float16 / bfloat16 buffers behind float32 keys, values and queries ----------------


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_narrow_buffers_hold_the_rounded_keys_and_attend_as_sdpa_over_them(kv_dtype):
    g = torch.Generator().manual_seed(0)
    cache = TailOwnedKVCache(step=8, kv_dtype=kv_dtype)
    ks, vs = [], []
    for T in (5, 1, 7, 1):  # across two growths
        k, v = torch.randn(2, 2, T, D, generator=g), torch.randn(2, 2, T, D, generator=g)
        cache.update(k, v)
        ks.append(k)
        vs.append(v)
        q = torch.randn(2, 4, T, D, generator=g)
        K, V = torch.cat(ks, 2).to(kv_dtype), torch.cat(vs, 2).to(kv_dtype)
        got_k, got_v = cache.fetch()
        assert got_k.dtype == kv_dtype and torch.equal(got_k, K) and torch.equal(got_v, V)
        out = cache.attention(q)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, sdpa(q, K.float(), V.float()), rtol=1e-5, atol=1e-6)
    s = cache.stats()
    assert s["kv_dtype"] == str(kv_dtype).removeprefix("torch.") and s["capacity"] == 16
    assert cache.nbytes == 2 * 2 * 2 * 16 * D * 2  # (K and V) x B x H x capacity x D x 2 bytes
    assert s["bytes"] == 2 * 2 * 2 * 14 * D * 2  # the stored bytes of every write


def test_narrow_buffers_take_only_the_first_writes_dtype_and_refuse_other_storage():
    cache = TailOwnedKVCache(kv_dtype=torch.float16)
    cache.update(torch.ones(1, 1, 2, D), torch.ones(1, 1, 2, D))
    before = cache.fetch()[0].clone()
    with pytest.raises(ValueError, match=r"dtype torch.float16 differs from the cache's torch.float32"):
        cache.update(torch.ones(1, 1, 1, D, dtype=torch.float16), torch.ones(1, 1, 1, D, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"queries dtype torch.float16 differs from the cache's torch.float32"):
        cache.attention(torch.ones(1, 1, 1, D, dtype=torch.float16))
    assert cache.offset == 2 and torch.equal(cache.fetch()[0], before)
    for bad in (torch.float32, torch.int8, "float16"):
        with pytest.raises(ValueError, match=r"kv_dtype must be None .* or one of torch.float16, torch.bfloat16"):
            TailOwnedKVCache(kv_dtype=bad)


@pytest.mark.parametrize("tier", ["tail", "block", "ragged", "paged"])
def test_a_narrow_tail_converts_to_a_cache_that_takes_the_models_dtype(tier):
    """from_cache (and configure_kv_cache) widen a float16 tail's tokens back to the float32 the
    model writes, exactly; before, the new cache took float16 and refused the model's keys."""
    from kvtier import KVCacheConfig, configure_kv_cache

    g = torch.Generator().manual_seed(2)
    cache = TailOwnedKVCache(step=4, kv_dtype=torch.float16)
    cache.update(torch.randn(1, 2, 5, D, generator=g), torch.randn(1, 2, 5, D, generator=g))
    caches = [cache]
    configure_kv_cache(caches, KVCacheConfig(tier=tier, step=4, paged_block_size=4))
    new = caches[0]
    k, v = torch.randn(1, 2, 1, D, generator=g), torch.randn(1, 2, 1, D, generator=g)
    new.update(k, v)
    K, V = cache.fetch()
    want_k, want_v = torch.cat([K.float(), k], 2), torch.cat([V.float(), v], 2)
    q = torch.randn(1, 4, 1, D, generator=g)
    torch.testing.assert_close(new.attention(q), causal_attention(q, want_k, want_v), atol=1e-6, rtol=1e-6)


def test_narrow_buffers_survive_state_and_meta_state():
    g = torch.Generator().manual_seed(1)
    cache = TailOwnedKVCache(step=4, kv_dtype=torch.float16)
    cache.update(torch.randn(1, 2, 6, D, generator=g), torch.randn(1, 2, 6, D, generator=g))
    meta = cache.meta_state
    assert meta["kv_dtype"] == "float16" and meta["dtype"] == "float32"
    back = TailOwnedKVCache.from_state(cache.state, meta)
    assert back.kv_dtype == torch.float16 and back.dtype == torch.float32 and back.offset == 6
    assert all(torch.equal(a, b) for a, b in zip(back.fetch(), cache.fetch()))
    q = torch.randn(1, 2, 1, D, generator=g)
    assert torch.equal(back.attention(q), cache.attention(q))
    with pytest.raises(ValueError, match=r"names kv_dtype without dtype"):
        TailOwnedKVCache.from_state(cache.state, {**meta, "dtype": None})
    for name, bad in (("dtype", "int8"), ("dtype", "float33"), ("kv_dtype", "half")):
        # the words every tier's meta_state check uses (state_checks.meta_dtype)
        with pytest.raises(ValueError, match=rf"^meta_state\['{name}'\] must name a dtype, one of "
                                             rf"\['float32', 'float16', 'bfloat16', 'float64'\]; got '{bad}'$"):
            TailOwnedKVCache.from_state(cache.state, {**meta, name: bad})
    with pytest.raises(ValueError, match=r"state holds torch.float16 keys but meta_state says kv_dtype torch.bfloat16"):
        TailOwnedKVCache.from_state(cache.state, {**meta, "kv_dtype": "bfloat16"})
