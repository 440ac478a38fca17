"""PagedKVCache (full precision): rows, blocks, growth, freezing, persistence and the read path.

The reference for contents is a list of tokens per row; for attention, PyTorch
SDPA over each row's contiguous K/V. Quantised storage and fallback are in
``test_paged_quant.py``; the kernels on their own in ``test_paged_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.caches.base import CacheCapacityError
from kvtier.caches.paged import (
    PagedKVCache,
    PagedKVGrowthRefused,
    dynamic_paged_num_blocks,
    paged_grown_blocks,
)
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.config import KVCacheConfig, configure_kv_cache, make_caches
from kvtier.kernels.cpu_attention import load_kernels
from kvtier.kernels.reference import causal_attention

H, D = 2, 8


# -- helpers ---------------------------------------------------------------------------------
def rows_of(ref: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each row's tokens stacked as ``[H, n, D]``."""
    return [torch.stack(r, dim=1) if r else torch.zeros(H, 0, D) for r in ref]


def check_contents(cache: PagedKVCache, kref, vref) -> None:
    """fetch() equals the per-row lists, zero past each row's length; the pool books balance."""
    assert cache.offset.tolist() == [len(r) for r in kref]
    K, V = cache.fetch()
    n = max(len(r) for r in kref)
    assert K.shape == (len(kref), H, n, D) and V.shape == K.shape
    for b, (kr, vr) in enumerate(zip(rows_of(kref), rows_of(vref))):
        L = kr.shape[1]
        assert torch.equal(K[b, :, :L], kr) and torch.equal(V[b, :, :L], vr)
        assert not K[b, :, L:].any() and not V[b, :, L:].any()
    p = cache.pool
    held = [b for r in p.rows for b in r]
    assert len(held) == len(set(held)) and not set(held) & set(p.free)
    assert len(p.free) + p.used_blocks == p.num_blocks
    s = cache.paged_stats()
    assert s["free_blocks"] + s["used_blocks"] == s["allocated_blocks"]
    assert s["live_tokens"] == sum(len(r) for r in kref)


def snapshot(cache: PagedKVCache) -> dict:
    stats = {k: v for k, v in cache.stats().items() if k != "time_s"}
    return {
        "state": {k: v.clone() for k, v in cache.state.items()},
        "rows": [list(r) for r in cache.pool.rows],
        "free": list(cache.pool.free),
        "offset": cache.offset.tolist(),
        "stats": stats,
        "codecs": cache.codecs,
    }


def assert_unchanged(cache: PagedKVCache, snap: dict) -> None:
    now = snapshot(cache)
    assert now["state"].keys() == snap["state"].keys()
    for k in snap["state"]:
        assert torch.equal(now["state"][k], snap["state"][k]), k
    for k in ("rows", "free", "offset", "stats", "codecs"):
        assert now[k] == snap[k], k


def prefix_cache(lengths, block_size=4, num_blocks=64, **kw):
    """A cache whose rows hold ``lengths`` tokens, and the K/V lists it holds."""
    B, n = len(lengths), max(lengths)
    cache = PagedKVCache(block_size, num_blocks, batch_size=B, **kw)
    k, v = torch.randn(B, H, n, D), torch.randn(B, H, n, D)
    cache.update(k, v, new_offsets=list(lengths))
    kref = [list(k[b, :, :L].unbind(1)) for b, L in enumerate(lengths)]
    vref = [list(v[b, :, :L].unbind(1)) for b, L in enumerate(lengths)]
    return cache, kref, vref


# -- property test: random writes, partial commits, trims and releases -----------------------------
@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_operations_match_a_list_per_row(data):
    B = data.draw(st.integers(1, 3), label="B")
    bs = data.draw(st.sampled_from([1, 2, 3, 4]), label="block_size")
    cache = PagedKVCache(bs, 3, batch_size=B, dynamic=True)
    kref = [[] for _ in range(B)]
    vref = [[] for _ in range(B)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        op = data.draw(st.sampled_from(["write", "write", "write", "trim", "release"]))
        if op == "write":
            T = data.draw(st.integers(1, 5), label="T")
            ws = [data.draw(st.integers(0, len(r)), label="write_start") for r in kref]
            new = [data.draw(st.integers(w, w + T), label="new_offsets") for w in ws]
            k, v = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
            cache.update(k, v, write_start=ws, new_offsets=new)
            for b in range(B):
                kref[b] = (kref[b][: ws[b]] + list(k[b].unbind(1)))[: new[b]]
                vref[b] = (vref[b][: ws[b]] + list(v[b].unbind(1)))[: new[b]]
        elif op == "trim":
            n = data.draw(st.integers(0, 4), label="trim")
            assert cache.trim(n) == min(n, max(len(r) for r in kref))
            kref = [r[: max(0, len(r) - n)] for r in kref]
            vref = [r[: max(0, len(r) - n)] for r in vref]
        elif cache.pool.allocated:
            rows = data.draw(st.lists(st.integers(0, B - 1), unique=True), label="release")
            free_before = len(cache.pool.free)
            freed = sum(len(cache.pool.rows[r]) for r in rows)
            cache.release(rows)
            assert len(cache.pool.free) == free_before + freed
            for r in rows:
                kref[r], vref[r] = [], []
        if cache.pool.allocated:
            check_contents(cache, kref, vref)


@pytest.mark.parametrize("host_slots", [0, 256])
def test_slots_from_the_host_books_and_from_the_device_tables_agree(seed, monkeypatch, host_slots):
    import kvtier.caches.paged_pool as pool_module

    monkeypatch.setattr(pool_module, "HOST_SLOTS_MAX", host_slots)  # 0: every write on the device path
    cache = PagedKVCache(3, 16, batch_size=2)
    kref, vref = [[], []], [[], []]
    for T, ws in ((5, None), (1, None), (2, [4, 6]), (1, None), (4, [0, 7])):
        k, v = torch.randn(2, H, T, D), torch.randn(2, H, T, D)
        ws = ws or [len(r) for r in kref]
        cache.update(k, v, write_start=ws)
        for b in range(2):
            kref[b] = kref[b][: ws[b]] + list(k[b].unbind(1))
            vref[b] = vref[b][: ws[b]] + list(v[b].unbind(1))
        check_contents(cache, kref, vref)


def test_freed_blocks_are_reused_by_another_row(seed):
    cache, kref, vref = prefix_cache([8, 4], block_size=4, num_blocks=4)
    assert cache.paged_stats()["free_blocks"] == 1
    row0_blocks = list(cache.pool.rows[0])
    cache.release([0])
    k, v = torch.randn(2, H, 9, D), torch.randn(2, H, 9, D)
    cache.update(k[:, :, :1], v[:, :, :1], write_start=[0, 4], new_offsets=[1, 4])
    assert cache.pool.rows[0] == [row0_blocks[0]]  # the last freed block comes back first
    # row 1 grows into row 0's old blocks
    cache.update(k[:, :, 1:9], v[:, :, 1:9], write_start=[1, 4], new_offsets=[1, 12])
    assert set(cache.pool.rows[1][1:]) <= set(row0_blocks) | {3}
    kref = [[k[0, :, 0]], kref[1] + list(k[1, :, 1:9].unbind(1))]
    vref = [[v[0, :, 0]], vref[1] + list(v[1, :, 1:9].unbind(1))]
    check_contents(cache, kref, vref)


# -- attention against SDPA -------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hq", [2, 4, 8])  # GQA groups 1, 2, 4
@pytest.mark.parametrize("T", [1, 3, 9])  # decode, short and long prefill chunks
def test_attention_equals_sdpa_per_row(seed, block_size, hq, T):
    lengths = [3, 16, 0, 11]  # different lengths; 16 ends on a block boundary
    cache, kref, vref = prefix_cache(lengths, block_size=block_size, num_blocks=128)
    k, v = torch.randn(4, H, T, D), torch.randn(4, H, T, D)
    cache.update(k, v)  # each row appends at its own offset
    q = torch.randn(4, hq, T, D)
    out = cache.attention(q)
    for b in range(4):
        K = torch.cat([rows_of(kref)[b], k[b]], dim=1)[None]  # (1, H, L+T, D)
        V = torch.cat([rows_of(vref)[b], v[b]], dim=1)[None]
        expect = causal_attention(q[b : b + 1], K, V)
        torch.testing.assert_close(out[b : b + 1], expect, atol=1e-5, rtol=1e-5)
    # a decode step through the C kernel (over the table's view of its columns), chunks the reference
    want = "cpu" if T == 1 and load_kernels() is not None else "torch"
    assert cache.paged_stats()["attention_calls_by_backend"] == {want: 1}


def test_attention_after_a_rewrite_and_partial_commit_sees_committed_tokens_only(seed):
    cache, kref, vref = prefix_cache([6, 6], block_size=4)
    k, v = torch.randn(2, H, 3, D), torch.randn(2, H, 3, D)
    # row 0 rewrites from position 4 (two stale drafts) and commits 1 of 3; row 1 appends all
    cache.update(k, v, write_start=[4, 6], new_offsets=[5, 9])
    assert cache.offset.tolist() == [5, 9]
    assert cache.pool.rows[0] == cache.pool.rows[0][:2]  # nothing uncommitted took a block
    q = torch.randn(2, 4, 3, D)
    out = cache.attention(q)
    for b, (ws, n) in enumerate([(4, 5), (6, 9)]):
        K = torch.cat([rows_of(kref)[b][:, :ws], k[b]], dim=1)[None, :, :n]  # committed keys
        V = torch.cat([rows_of(vref)[b][:, :ws], v[b]], dim=1)[None, :, :n]
        expect = causal_attention(q[b : b + 1], K, V, q_start=ws, kv_len=n)
        torch.testing.assert_close(out[b : b + 1], expect, atol=1e-5, rtol=1e-5)


def test_changing_the_offset_a_caller_got_changes_nothing(seed):
    """``pos = cache.offset; pos += 1`` (positions for the next token, in place) must not move
    the lengths attention reads: before, row 1 then read another row's block."""
    cache, _, _ = prefix_cache([5, 2], block_size=4)
    q = torch.randn(2, 4, 1, D)
    before = cache.attention(q, q_start=[4, 1])
    pos = cache.offset
    pos += 4
    assert cache.offset.tolist() == [5, 2] and cache.lengths == [5, 2]
    torch.testing.assert_close(cache.attention(q, q_start=[4, 1]), before, atol=0, rtol=0)


def test_can_reserve_refuses_what_reserve_refuses(seed):
    cache, _, _ = prefix_cache([5, 2], block_size=4)
    for bad in (-100, 1.5, True, "4"):  # before: can_reserve said True to each
        for method in (cache.reserve, cache.can_reserve):
            with pytest.raises(ValueError, match=r"reserve\(tokens\) must be an int >= 0"):
                method(bad)
    assert cache.can_reserve(4)


def test_rows_added_by_extend_attend_as_they_did_alone(seed):
    """The added rows keep their last write's starts (before: their lengths, so their own
    queries saw every key they hold, not causally)."""
    a, _, _ = prefix_cache([4, 4], block_size=4)  # its last write: 4 tokens a row, as b's
    b = PagedKVCache(4, 16, batch_size=2)
    b.update(torch.randn(2, H, 4, D), torch.randn(2, H, 4, D))
    q = torch.randn(2, 4, 4, D)
    alone = b.attention(q)  # the write's own queries: causal from its start
    a.extend(b)
    out = a.attention(torch.cat([torch.randn(2, 4, 4, D), q]))
    torch.testing.assert_close(out[2:], alone, rtol=1e-6, atol=1e-6)


def test_an_empty_cache_converts_to_as_many_paged_rows(seed):
    """A tail cache trimmed to nothing still has B rows of buffers; one never written has none,
    and configure_kv_cache's batch_size gives them (before: one row either way, and the model's
    batch of 4 was refused at its first write)."""
    tail = TailOwnedKVCache(step=4)
    tail.update(torch.randn(4, H, 3, D), torch.randn(4, H, 3, D))
    tail.trim(3)
    fresh = [tail, TailOwnedKVCache(step=4)]
    configure_kv_cache(fresh, KVCacheConfig(tier="paged", paged_block_size=4), batch_size=4)
    for cache in fresh:
        assert cache.batch_size == 4
        cache.update(torch.randn(4, H, 2, D), torch.randn(4, H, 2, D))
        assert cache.lengths == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="batch_size must be an int >= 1 or None, got 0"):
        configure_kv_cache([TailOwnedKVCache()], KVCacheConfig(tier="paged"), batch_size=0)


def test_released_row_attends_to_nothing_and_others_are_unaffected(seed):
    cache, kref, vref = prefix_cache([5, 7], block_size=4)
    k, v = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
    cache.update(k, v)
    cache.release([0])
    q = torch.randn(2, 2, 1, D)
    out = cache.attention(q)
    assert not out[0].any()
    K = torch.cat([rows_of(kref)[1], k[1]], dim=1)[None]
    V = torch.cat([rows_of(vref)[1], v[1]], dim=1)[None]
    torch.testing.assert_close(out[1:], causal_attention(q[1:], K, V), atol=1e-5, rtol=1e-5)


def test_single_row_fetch_is_exactly_the_offset_and_matches_the_tail_tier(seed):
    paged, tail = PagedKVCache(4, 8), TailOwnedKVCache(step=4)
    for T in (5, 1, 1, 3):
        k, v = torch.randn(1, H, T, D), torch.randn(1, H, T, D)
        K, V = paged.update_and_fetch(k, v)
        Kt, Vt = tail.update_and_fetch(k, v)
        assert K.shape == (1, H, tail.offset, D)
        assert torch.equal(K, Kt) and torch.equal(V, Vt)
        q = torch.randn(1, 4, T, D)
        torch.testing.assert_close(paged.attention(q), tail.attention(q), atol=1e-5, rtol=1e-5)
    assert paged.trim(3) == 3 and tail.trim(3) == 3
    assert torch.equal(paged.fetch()[0], tail.fetch()[0])


# -- sizing and growth -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "current, tokens, bs, window, expect",
    [
        (10, 160, 16, None, 10),  # fits: unchanged
        (10, 161, 16, None, 15),  # 11 needed; 1.5x wins
        (10, 400, 16, None, 25),  # 25 needed wins
        (1, 2, 1, None, 2),  # current + 1 wins over ceil(1.5)
        (0, 5, 4, None, 2),
        (10, 200, 16, 224, 14),  # clamped to the window's 14 blocks
        (10, 240, 16, 224, 15),  # requirement (15) does not fit the window: no clamp
    ],
)
def test_paged_grown_blocks(current, tokens, bs, window, expect):
    assert paged_grown_blocks(current, tokens, bs, window) == expect


@pytest.mark.parametrize(
    "kw, expect",
    [
        ({}, 64),  # only the margin (8 blocks): the configured 64 wins
        ({"request_tokens": 4000}, 258),  # (4000 + 128) / 16
        ({"previous_high_water": 4000}, 383),  # (6000 + 128) / 16 rounded up
        ({"request_tokens": 7000, "previous_high_water": 4000}, 446),
        ({"request_tokens": 4000, "margin": 0}, 250),
        ({"request_tokens": 4000, "min_blocks": 300}, 300),
    ],
)
def test_dynamic_paged_num_blocks(kw, expect):
    assert dynamic_paged_num_blocks(16, 64, **kw) == expect


def test_config_sizes_a_dynamic_pool_with_the_same_rule():
    cfg = KVCacheConfig(tier="paged", dynamic_paged=True, paged_num_blocks=8,
                        dynamic_paged_tokens=1000)
    assert cfg.initial_paged_blocks() == dynamic_paged_num_blocks(16, 8, request_tokens=1000)
    assert make_caches(1, cfg)[0].num_blocks == 71


def test_growth_follows_the_rule_and_keeps_contents(seed):
    cache, kref, vref = prefix_cache([6, 2], block_size=2, num_blocks=4, dynamic=True)
    assert cache.paged_stats()["allocated_blocks"] == 4 and cache.copy_stats.grow_events == 0
    k, v = torch.randn(2, H, 3, D), torch.randn(2, H, 3, D)
    cache.update(k, v)  # rows grow to 9 and 5 tokens: 5 + 3 = 8 blocks > 4
    s = cache.paged_stats()
    assert s["allocated_blocks"] == paged_grown_blocks(4, 8 * 2, 2) == 8
    assert s["grow_events"] == 1 and s["capacity"] == 16
    for b in range(2):
        kref[b] += list(k[b].unbind(1))
        vref[b] += list(v[b].unbind(1))
    check_contents(cache, kref, vref)
    cache.update(k, v)  # 12 + 8 tokens: 6 + 4 = 10 blocks > 8: grows to 1.5 x 8 = 12
    assert cache.paged_stats()["allocated_blocks"] == 12 and cache.copy_stats.grow_events == 2


def test_growth_is_clamped_to_the_context_window(seed):
    cache = PagedKVCache(4, 4, dynamic=True, context_window_tokens=20)
    cache.update(torch.randn(1, H, 17, D), torch.randn(1, H, 17, D))  # 5 blocks; 1.5x=6; window 5
    assert cache.paged_stats()["allocated_blocks"] == 5 and cache.copy_stats.grow_events == 1


@pytest.mark.parametrize("frozen", [False, True])
def test_refused_growth_changes_nothing(seed, frozen):
    cache, _, _ = prefix_cache([7, 3], block_size=4, num_blocks=4, dynamic=frozen)
    if frozen:
        cache.freeze()
    snap = snapshot(cache)
    with pytest.raises(PagedKVGrowthRefused) as e:
        cache.update(torch.randn(2, H, 6, D), torch.randn(2, H, 6, D))
    msg = str(e.value)
    assert isinstance(e.value, CacheCapacityError) and isinstance(e.value, MemoryError)
    assert "KVTIER_DYNAMIC_PAGED_KV" in msg and "num_blocks" in msg
    assert ("frozen" in msg) == frozen
    assert_unchanged(cache, snap)
    cache.update(torch.randn(2, H, 1, D), torch.randn(2, H, 1, D))  # a write that fits still works


def test_a_first_write_larger_than_the_pool_allocates_nothing():
    cache = PagedKVCache(4, 2)
    with pytest.raises(PagedKVGrowthRefused):
        cache.update(torch.randn(1, H, 9, D), torch.randn(1, H, 9, D))
    assert cache.nbytes == 0 and cache.empty() and cache.codecs is None


def test_an_allocation_failure_during_growth_leaves_the_cache_as_it_was(seed, monkeypatch):
    cache, kref, vref = prefix_cache([8], block_size=4, num_blocks=2, dynamic=True)
    snap = snapshot(cache)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: no memory for the grown pool")

    monkeypatch.setattr(cache.pool, "_new_tensors", out_of_memory)
    with pytest.raises(PagedKVGrowthRefused, match="simulated"):
        cache.update(torch.randn(1, H, 1, D), torch.randn(1, H, 1, D))
    assert_unchanged(cache, snap)
    check_contents(cache, kref, vref)


# -- bytes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nbytes_is_the_layout_arithmetic(dtype):
    cache = PagedKVCache(16, 10, batch_size=3)
    cache.update(torch.randn(3, H, 20, D, dtype=dtype), torch.randn(3, H, 20, D, dtype=dtype),
                 new_offsets=[20, 5, 17])
    item = torch.empty((), dtype=dtype).element_size()
    assert cache.nbytes == 2 * 10 * 16 * H * D * item
    s = cache.paged_stats()
    assert s["payload_bytes"] == cache.nbytes and s["sidecar_bytes"] == 0
    assert s["bytes_per_token"] == 2 * H * D * item
    assert s["bytes_per_live_token"] == cache.nbytes / 42
    assert (s["used_blocks"], s["live_tokens"], s["held_waste_tokens"]) == (2 + 1 + 2, 42, 5 * 16 - 42)
    assert s["waste_tokens"] == 160 - 42 and s["mode"] == "fp"


# -- rows: filter, extend ------------------------------------------------------------------------
def test_filter_keeps_rows_in_order_and_frees_the_rest(seed):
    cache, kref, vref = prefix_cache([5, 9, 2], block_size=4)
    cache.filter([2, 0])
    assert cache.batch_size == 2 and cache.paged_stats()["used_blocks"] == 1 + 2
    check_contents(cache, [kref[2], kref[0]], [vref[2], vref[0]])
    k, v = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
    cache.update(k, v)
    check_contents(cache, [kref[2] + [k[0, :, 0]], kref[0] + [k[1, :, 0]]],
                   [vref[2] + [v[0, :, 0]], vref[0] + [v[1, :, 0]]])


def test_extend_copies_the_other_rows_exactly(seed):
    a, ka, va = prefix_cache([5, 2], block_size=4, num_blocks=4, dynamic=True)
    b, kb, vb = prefix_cache([9], block_size=4, num_blocks=8)
    b.trim(2)  # b's row holds a block past its length: only live blocks are copied
    kb, vb = [kb[0][:7]], [vb[0][:7]]
    a.extend(b)
    assert a.batch_size == 3 and a.paged_stats()["used_blocks"] == 2 + 1 + 2
    check_contents(a, ka + kb, va + vb)
    check_contents(b, kb, vb)  # the other cache is untouched
    empty = PagedKVCache(4, 8)
    empty.extend(a)  # an empty cache adopts the other's storage
    check_contents(empty, [[]] + ka + kb, [[]] + va + vb)


# -- persistence and conversion ----------------------------------------------------------------------
def test_state_round_trip_is_exact_and_continues_identically(seed):
    cache, kref, vref = prefix_cache([5, 9, 2], block_size=4, num_blocks=5, dynamic=True)
    cache.release([1])
    cache.freeze()
    copy = PagedKVCache.from_state(cache.state, cache.meta_state)
    assert copy.meta_state == cache.meta_state
    for name, t in cache.state.items():
        assert torch.equal(copy.state[name], t) and copy.state[name].dtype == t.dtype, name
    assert copy.pool.free == cache.pool.free and copy.pool.rows == cache.pool.rows
    k, v = torch.randn(3, H, 2, D), torch.randn(3, H, 2, D)
    for c in (cache, copy):
        c.update(k, v)
    assert copy.pool.rows == cache.pool.rows
    assert torch.equal(copy.fetch()[0], cache.fetch()[0])
    assert copy.frozen and copy.key_cache.data_ptr() != cache.key_cache.data_ptr()


def test_state_of_an_unwritten_cache_round_trips():
    cache = PagedKVCache(8, 3, batch_size=2, dynamic=True)
    copy = PagedKVCache.from_state(cache.state, cache.meta_state)
    assert cache.state == {} and copy.meta_state == cache.meta_state


def test_inconsistent_state_is_rejected(seed):
    cache, _, _ = prefix_cache([5], block_size=4, num_blocks=3)
    state = dict(cache.state)
    state["free_blocks"] = torch.tensor([0], dtype=torch.long)  # block 0 is held by row 0
    with pytest.raises(ValueError, match="inconsistent"):
        PagedKVCache.from_state(state, cache.meta_state)
    state = dict(cache.state, key_cache=cache.state["key_cache"][:, :, :, :4])
    with pytest.raises(ValueError, match="inconsistent"):
        PagedKVCache.from_state(state, cache.meta_state)


def test_from_cache_and_configure_kv_cache(seed):
    tails = [TailOwnedKVCache() for _ in range(2)]
    k, v = torch.randn(1, H, 7, D), torch.randn(1, H, 7, D)
    for t in tails:
        t.update(k, v)
    stats = configure_kv_cache(tails, KVCacheConfig(tier="paged", paged_block_size=4,
                                                    paged_num_blocks=4))
    assert stats["entries"] == 2 and all(isinstance(c, PagedKVCache) for c in tails)
    assert tails[0].block_size == 4 and torch.equal(tails[0].fetch()[0], k)
    ragged_like, kref, vref = prefix_cache([3, 6], block_size=2)
    copy = PagedKVCache.from_cache(ragged_like, block_size=4, num_blocks=8)
    check_contents(copy, kref, vref)


# -- bad input leaves the cache unchanged -----------------------------------------------------------
BAD_UPDATES = [
    ({"k": (3, H, 1, D)}, "batch"),
    ({"k": (2, H + 1, 1, D)}, "kv_heads"),
    ({"k": (2, H, 1, D + 2)}, "head_dim"),
    ({"dtype": torch.float64}, "dtype"),
    ({"write_start": [6, 0]}, "write_start"),
    ({"write_start": [-1, 0]}, "write_start"),
    ({"write_start": [0]}, "write_start"),
    ({"write_start": torch.tensor([0.0, 1.0])}, "write_start"),
    ({"new_offsets": [7, 9]}, "new_offsets"),
    ({"new_offsets": [4, 5]}, "new_offsets"),
    ({"new_offsets": "all"}, "new_offsets"),
]


@pytest.mark.parametrize("bad, word", BAD_UPDATES)
def test_bad_updates_raise_and_change_nothing(seed, bad, word):
    cache, _, _ = prefix_cache([5, 3], block_size=4)
    snap = snapshot(cache)
    shape = bad.get("k", (2, H, 1, D))
    k = torch.randn(*shape, dtype=bad.get("dtype", torch.float32))
    kw = {n: bad[n] for n in ("write_start", "new_offsets") if n in bad}
    with pytest.raises(ValueError, match=word):
        cache.update(k, k.clone(), **kw)
    assert_unchanged(cache, snap)


@pytest.mark.parametrize(
    "call, word",
    [
        (lambda c: c.trim(-1), "trim"),
        (lambda c: c.release([2]), "rows"),
        (lambda c: c.release([0, 0]), "twice"),
        (lambda c: c.filter([]), "at least one"),
        (lambda c: c.filter([1, 1]), "twice"),
        (lambda c: c.extend(PagedKVCache(8, 4)), "block_size"),
        (lambda c: c.extend(c), "itself"),
        (lambda c: c.attention(torch.randn(2, 3, 1, D)), "multiple"),
        (lambda c: c.attention(torch.randn(1, 2, 1, D)), "batch"),
        (lambda c: c.attention(torch.randn(2, 2, 1, D), q_start=[-1, 0]), "q_start"),
    ],
)
def test_bad_calls_raise_and_change_nothing(seed, call, word):
    cache, _, _ = prefix_cache([5, 3], block_size=4)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=word):
        call(cache)
    assert_unchanged(cache, snap)


@pytest.mark.parametrize(
    "kw",
    [{"block_size": 0}, {"num_blocks": -1}, {"batch_size": 0}, {"kv_quant": "q3"},
     {"attention_backend": "cuda"}, {"context_window_tokens": 0}, {"dynamic": "yes"},
     {"turboquant": "q8_0"}],
)
def test_bad_constructor_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        PagedKVCache(**kw)


def test_reads_on_an_empty_cache_say_what_to_do():
    cache = PagedKVCache()
    with pytest.raises(ValueError, match="update"):
        cache.fetch()
    with pytest.raises(ValueError, match="update"):
        cache.attention(torch.randn(1, 2, 1, D))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_cache_holds_and_reads_what_a_cpu_cache_does(seed):
    gpu = PagedKVCache(16, 16, batch_size=3, attention_backend="torch")
    cpu = PagedKVCache(16, 16, batch_size=3)
    for T, new in ((40, [40, 17, 1]), (1, None), (5, [46, 23, 3])):
        k, v, q = (torch.randn(3, n, T, 64) for n in (2, 2, 8))
        gpu.update(k.cuda(), v.cuda(), new_offsets=new)
        cpu.update(k, v, new_offsets=new)
        torch.testing.assert_close(gpu.attention(q.cuda()).cpu(), cpu.attention(q), atol=1e-4, rtol=1e-4)
    assert gpu.offset.device.type == "cuda" and gpu.offset.tolist() == cpu.offset.tolist()
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu.fetch(), cpu.fetch()))


def test_trim_drops_from_every_row_and_empties_shorter_ones(seed):
    cache, kref, vref = prefix_cache([6, 2, 0], block_size=4)
    blocks = [list(r) for r in cache.pool.rows]
    assert cache.trim(3) == 3
    check_contents(cache, [kref[0][:3], [], []], [vref[0][:3], [], []])
    assert cache.pool.rows == blocks  # trimmed tokens' blocks stay with their rows
    assert cache.trim(10) == 3 and cache.size() == 0
