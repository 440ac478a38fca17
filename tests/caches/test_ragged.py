"""RaggedBatchKVCache against a list of tokens per row, SDPA and the tail tier."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import KVCacheConfig, TailOwnedKVCache, configure_kv_cache, make_caches
from kvtier.caches.base import CacheCapacityError
from kvtier.caches.persist import load_cache, save_cache
from kvtier.caches.ragged import (
    RaggedBatchKVCache,
    RaggedCapacityError,
    restore_ragged_caches,
    restore_ragged_caches_masked,
    snapshot_ragged_caches,
)
from kvtier.kernels.reference import causal_attention

H, HQ, D, STEP = 2, 4, 8, 4
CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="no CUDA")])]


def kv(b: int, q: int, gen: torch.Generator | None = None, device: str = "cpu"):
    k = torch.randn(b, H, q, D, generator=gen)
    v = torch.randn(b, H, q, D, generator=gen)
    return k.to(device), v.to(device)


def rows_of(k: torch.Tensor, v: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per row, the list of (k, v) tokens, each ``[H, D]`` on the CPU."""
    k, v = k.cpu(), v.cpu()
    return [[(k[b, :, t], v[b, :, t]) for t in range(k.shape[2])] for b in range(k.shape[0])]


def stacked(row: list) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([t[0] for t in row], dim=1), torch.stack([t[1] for t in row], dim=1)


def check(cache: RaggedBatchKVCache, ref: list[list]) -> None:
    lens = [len(r) for r in ref]
    assert cache.offset.tolist() == lens
    assert cache.size() == max(lens)
    assert cache.host_bound >= max(lens)
    assert cache.capacity % cache.step == 0 and cache.capacity >= max(lens)
    for b, row in enumerate(ref):
        if row:
            k, v = stacked(row)
            assert torch.equal(cache.keys[b, :, : len(row)].cpu(), k)
            assert torch.equal(cache.values[b, :, : len(row)].cpu(), v)


def frozen_state(cache: RaggedBatchKVCache) -> tuple:
    s = cache.stats()
    s.pop("time_s")
    return (cache.keys.clone(), cache.values.clone(), cache.offset.clone(), s, cache.meta_state)


def assert_unchanged(cache: RaggedBatchKVCache, before: tuple) -> None:
    k, v, off, s, meta = before
    after = cache.stats()
    after.pop("time_s")
    assert torch.equal(cache.keys, k) and torch.equal(cache.values, v)
    assert torch.equal(cache.offset, off) and after == s and cache.meta_state == meta


def row_arg(values: list[int], form: str, device: str):
    return torch.tensor(values, device=device) if form == "tensor" else values


# -- property test: every operation against a list of tokens per row --------------------------
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_matches_per_row_token_lists(device, data):
    B = data.draw(st.integers(1, 3), label="B")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    cache = RaggedBatchKVCache(batch_size=B, step=STEP)
    ref: list[list] = [[] for _ in range(B)]
    snap = snap_ref = None
    ops = st.sampled_from(["write", "write", "write", "trim", "snapshot", "restore_masked",
                           "restore", "filter", "extend"])
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        op = data.draw(ops)
        if op == "write":
            q = data.draw(st.integers(1, 4))
            back = [data.draw(st.integers(0, min(2, len(r)))) for r in ref]  # > 0: REPLAY
            ws = [len(r) - n for r, n in zip(ref, back)]
            commit = data.draw(st.none() | st.lists(st.integers(0, q), min_size=B, max_size=B))
            no = None if commit is None else [w + c for w, c in zip(ws, commit)]
            form = data.draw(st.sampled_from(["list", "tensor"]))
            k, v = kv(B, q, gen, device)
            use_ws = any(back) or data.draw(st.booleans())
            cache.update(k, v, write_start=row_arg(ws, form, device) if use_ws else None,
                         new_offsets=None if no is None else row_arg(no, form, device))
            new = rows_of(k, v)
            end = [w + q for w in ws] if no is None else no
            ref = [(r[:w] + n)[:e] for r, w, n, e in zip(ref, ws, new, end)]
            queries = torch.randn(B, HQ, q, D, generator=gen).to(device)
            out = cache.attention(queries)
            for b in range(B):
                if ref[b]:
                    kb, vb = stacked(ref[b])
                    want = causal_attention(queries[b : b + 1].cpu(), kb[None], vb[None], q_start=ws[b])
                    torch.testing.assert_close(out[b : b + 1].cpu(), want, atol=1e-5, rtol=1e-5)
                else:
                    assert not out[b].any()
        elif op == "trim":
            n = data.draw(st.integers(0, 3))
            m = min(n, min(len(r) for r in ref))
            assert cache.trim(n) == m
            ref = [r[: len(r) - m] for r in ref]
        elif op == "snapshot":
            snap, snap_ref = cache.snapshot(), [list(r) for r in ref]
        elif op in ("restore_masked", "restore") and snap is not None and len(snap_ref) == B:
            if op == "restore":
                cache.restore(snap)
                ref = [list(r) for r in snap_ref]
            else:
                mask = data.draw(st.lists(st.booleans(), min_size=B, max_size=B))
                arg = torch.tensor(mask, device=device) if data.draw(st.booleans()) else mask
                cache.restore_masked(snap, arg)
                ref = [list(s) if m else r for r, s, m in zip(ref, snap_ref, mask)]
        elif op == "filter":
            idx = data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=3))
            cache.filter(idx)
            ref, B = [list(ref[i]) for i in idx], len(idx)
        elif op == "extend" and B < 5:
            lens = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=2))
            if max(lens) == 0:
                other = RaggedBatchKVCache(batch_size=len(lens), step=2 * STEP)
                new = [[] for _ in lens]
            else:
                k, v = kv(len(lens), max(lens), gen, device)
                other = RaggedBatchKVCache(step=2 * STEP, keys=k, values=v, offsets=lens)
                new = [r[:n] for r, n in zip(rows_of(k, v), lens)]
            cache.extend(other)
            ref, B = ref + new, B + len(lens)
        check(cache, ref)


# -- attention ------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefill", [1, 7])
def test_equal_offsets_match_tail_tier(prefill):
    torch.manual_seed(0)
    ragged, tail = RaggedBatchKVCache(batch_size=2, step=STEP), TailOwnedKVCache(step=STEP)
    for q in (prefill, 1, 1, 3, 1):  # prefill, decode steps, a verify-sized chunk
        k, v = kv(2, q)
        ragged.update(k, v)
        tail.update(k, v)
        queries = torch.randn(2, HQ, q, D)
        torch.testing.assert_close(ragged.attention(queries), tail.attention(queries),
                                   atol=1e-5, rtol=1e-5)


def test_padding_and_other_rows_never_leak():
    torch.manual_seed(1)
    k, v = kv(3, 9)
    cache = RaggedBatchKVCache(step=STEP, keys=k, values=v, offsets=[3, 9, 6])
    cache.update(*kv(3, 2))
    queries = torch.randn(3, HQ, 2, D)
    out = cache.attention(queries)
    for b, n in enumerate(cache.offset.tolist()):  # huge values in every slot past a row's length
        cache.keys[b, :, n:] = 1e4
        cache.values[b, :, n:] = 1e4
    torch.testing.assert_close(cache.attention(queries), out, atol=0, rtol=0)
    cache.keys[1], cache.values[1] = 1e4, -1e4  # another row's content does not reach row 0 or 2
    after = cache.attention(queries)
    torch.testing.assert_close(after[[0, 2]], out[[0, 2]], atol=0, rtol=0)


def test_make_mask_shape_is_static_and_values_follow_rows():
    cache = RaggedBatchKVCache(step=STEP, keys=torch.zeros(2, H, 6, D), values=torch.zeros(2, H, 6, D),
                               offsets=[2, 6])
    cache.update(*kv(2, 2), write_start=[2, 5], new_offsets=[3, 7])
    mask = cache.make_mask(2)
    assert mask.shape == (2, 1, 2, cache.capacity) and mask.dtype == torch.bool
    # row 0: queries at 2, 3 see keys < 3; row 1: queries at 5, 6 see j <= 5, 6 and j < 7
    assert mask[0, 0].nonzero().tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert mask[1, 0, 0].nonzero().flatten().tolist() == list(range(6))
    assert mask[1, 0, 1].nonzero().flatten().tolist() == list(range(7))
    assert cache.make_mask(2, key_len=4).shape == (2, 1, 2, 4)
    assert cache.make_mask(1, q_start=[0, 0])[:, 0, 0].sum(-1).tolist() == [1, 1]


@pytest.mark.parametrize("pad", [float("nan"), float("inf")])
def test_padding_a_write_does_not_commit_never_reaches_attention(pad):
    """A padded prefill: row 1 commits 2 of the chunk's 4 tokens, its padding holds NaN or inf
    (``torch.empty`` garbage). Masked slots still enter the matmuls, so the cache stores what a
    write does not commit as zeros, and row 1 sees its own 2 keys only."""
    gen = torch.Generator().manual_seed(5)
    k, v = kv(2, 4, gen)
    k[1, :, 2:], v[1, :, 2:] = pad, pad
    cache = RaggedBatchKVCache(step=STEP)
    cache.update(k, v, new_offsets=[4, 2])
    q = torch.randn(2, HQ, 4, D, generator=gen)
    out = cache.attention(q)
    torch.testing.assert_close(out[1, :, :2], causal_attention(q[1:, :, :2], k[1:, :, :2], v[1:, :, :2])[0])
    torch.testing.assert_close(out[0], causal_attention(q[:1], k[:1], v[:1])[0])
    k2, v2 = kv(2, 1, gen)
    cache.update(k2, v2, write_start=[4, 2])  # row 1's next token lands on its first padding slot
    out = cache.attention(q[:, :, :1])
    want = causal_attention(q[1:, :, :1], torch.cat([k[1:, :, :2], k2[1:]], 2), torch.cat([v[1:, :, :2], v2[1:]], 2),
                            q_start=2)
    torch.testing.assert_close(out[1], want[0])


# -- capacity ------------------------------------------------------------------------------------
def seeded(batch: int = 3, tokens: int = 5, step: int = 16) -> RaggedBatchKVCache:
    tail = TailOwnedKVCache(step=step)
    tail.update(*kv(1, tokens))
    return RaggedBatchKVCache.from_scalar_cache(tail, batch_size=batch)


def test_freeze_keeps_buffers_and_refuses_past_capacity():
    cache = seeded()
    cache.freeze_capacity(300)
    assert cache.capacity == 304 and cache.frozen
    ptrs = [t.data_ptr() for t in (cache.keys, cache.values, cache.offset)]
    for i in range(200):
        ws = None if i % 3 else [n - 1 for n in cache.offset.tolist()]  # REPLAY every third
        cache.update(*kv(3, 2), write_start=ws, new_offsets=None if ws is None else [n + 1 for n in ws])
    assert [t.data_ptr() for t in (cache.keys, cache.values, cache.offset)] == ptrs
    before = frozen_state(cache)
    room = cache.capacity - cache.size()
    with pytest.raises(RaggedCapacityError, match=r"position \d+ is past the frozen capacity 304"):
        cache.update(*kv(3, room + 1))
    assert_unchanged(cache, before)
    assert issubclass(RaggedCapacityError, CacheCapacityError) and issubclass(RaggedCapacityError, MemoryError)
    cache.update(*kv(3, room))  # exactly up to the capacity fits
    with pytest.raises(ValueError, match="below the longest row"):
        cache.freeze_capacity(10)


def test_freeze_before_first_write_and_reserve():
    cache = RaggedBatchKVCache(batch_size=2, step=8)
    cache.freeze_capacity(20)
    cache.update(*kv(2, 3))
    assert cache.capacity == 24
    with pytest.raises(RaggedCapacityError):
        cache.reserve(30)
    grown = seeded(step=8)
    grown.reserve(40)
    ptr, cap = grown.keys.data_ptr(), grown.capacity
    for _ in range(40):
        grown.update(*kv(3, 1))
    assert (grown.keys.data_ptr(), grown.capacity) == (ptr, cap)
    assert grown.stats()["grow_events"] == 2  # the seed's allocation and the reservation


def test_a_reservation_that_cannot_be_allocated_is_a_capacity_error_and_changes_nothing(monkeypatch):
    cache = seeded(step=8)
    before = frozen_state(cache)
    real = torch.Tensor.new_zeros

    def refuse_large(self, *size, **kw):  # as the allocator refuses 10^12 positions
        if size[2] > 1000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(self, *size, **kw)

    monkeypatch.setattr(torch.Tensor, "new_zeros", refuse_large)
    with pytest.raises(RaggedCapacityError, match="allocating 1000000000008 positions of 3 rows failed .* the "
                                                  "cache is unchanged"):
        cache.reserve(10**12)
    assert_unchanged(cache, before)
    cache.reserve(16)  # what fits still does


def test_seeded_host_bound_writes_never_read_the_device(monkeypatch):
    torch.manual_seed(2)
    tail = TailOwnedKVCache(step=8)
    k0, v0 = kv(1, 5)
    tail.update(k0, v0)
    cache = RaggedBatchKVCache.from_scalar_cache(tail, batch_size=3, step=8)
    ref = [rows_of(k0, v0)[0] for _ in range(3)]
    writes = [(kv(3, 1), None, None) for _ in range(9)]  # grows past 8 and 16 on the way
    writes += [(kv(3, 3), [13, 12, 14], [16, 13, 15])]  # REPLAY + partial commits as host lists
    writes += [(kv(3, 2), None, None)]

    def boom(*args, **kwargs):
        raise AssertionError("the write path read a tensor's value on the host")

    for name in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for (k, v), ws, no in writes:
        cache.update(k, v, write_start=ws, new_offsets=no)
        cache.attention(torch.randn(3, HQ, k.shape[2], D))
        new = rows_of(k, v)
        ws = ws or [len(r) for r in ref]
        no = no or [w + k.shape[2] for w in ws]
        ref = [(r[:w] + n)[:e] for r, w, n, e in zip(ref, ws, new, no)]
    monkeypatch.undo()
    check(cache, ref)
    assert cache.stats()["grow_events"] == 3 and cache.host_bound == max(len(r) for r in ref)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA")
def test_frozen_cuda_writes_allocate_nothing_and_never_sync():
    tail = TailOwnedKVCache(step=16)
    tail.update(*kv(1, 5, device="cuda"))
    cache = RaggedBatchKVCache.from_scalar_cache(tail, batch_size=4)
    cache.freeze_capacity(512)
    step_kv = [kv(4, 1, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(200):
            cache.update(*step_kv[i % 8])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "segment.all.allocated"):
        assert stats1[key] == stats0[key], key
    # REPLAY with device tensors: checked on the device, no sync, the buffers stay put
    ptrs = [t.data_ptr() for t in (cache.keys, cache.values, cache.offset)]
    ws = (cache.offset - 1).clone()
    k, v, no, q = *kv(4, 3, device="cuda"), ws + 2, torch.randn(4, HQ, 3, D, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.update(k, v, write_start=ws, new_offsets=no)
        cache.attention(q)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [t.data_ptr() for t in (cache.keys, cache.values, cache.offset)] == ptrs
    assert cache.offset.tolist() == [5 + 200 + 1] * 4


# -- bad input -------------------------------------------------------------------------------------
BAD_WRITES = [
    ({"write_start": [0]}, "entries|2 ints"),
    ({"write_start": torch.tensor([1.0, 2.0])}, "integer tensor"),
    ({"write_start": torch.tensor([True, False])}, "integer tensor"),
    ({"write_start": torch.tensor([[1, 2]])}, r"shape \(2,\)"),
    ({"write_start": [-1, 0]}, ">= 0"),
    ({"write_start": torch.tensor([-1, 0])}, ">= 0"),
    ({"write_start": [5, 2]}, "gap"),
    ({"write_start": "0"}, "must be an int"),
    ({"new_offsets": [7, 3]}, r"\[4, 6\]"),
    ({"write_start": [2, 2], "new_offsets": [1, 3]}, r"new_offsets\[0\]=1"),
    ({"new_offsets": [4, 4, 4]}, "2 ints"),
    ({"new_offsets": torch.tensor([4.5, 4.0])}, "integer tensor"),
    ({"new_offsets": [True, 4]}, "must hold ints"),
]


@pytest.mark.parametrize("kwargs,match", BAD_WRITES)
def test_bad_rows_raise_and_change_nothing(kwargs, match):
    cache = RaggedBatchKVCache(batch_size=2, step=STEP)
    cache.update(*kv(2, 4), new_offsets=[4, 2])
    before = frozen_state(cache)
    with pytest.raises(ValueError, match=match):
        cache.update(*kv(2, 2), **kwargs)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("shape,match", [((3, H, 1, D), "batch size 3"), ((2, H + 1, 1, D), "kv_heads"),
                                         ((2, H, 1, D + 1), "head_dim")])
def test_bad_kv_raise_and_change_nothing(shape, match):
    cache = RaggedBatchKVCache(batch_size=2, step=STEP)
    with pytest.raises(ValueError, match="batch size 3"):
        cache.update(*kv(3, 1))  # the declared batch size holds before the first write
    cache.update(*kv(2, 3))
    before = frozen_state(cache)
    with pytest.raises(ValueError, match=match):
        cache.update(torch.randn(shape), torch.randn(shape))
    assert_unchanged(cache, before)


def test_bad_calls_elsewhere_raise_value_errors():
    cache = seeded()
    before = frozen_state(cache)
    for call in (lambda: cache.filter([]), lambda: cache.filter([3]), lambda: cache.filter(2),
                 lambda: cache.restore_masked(cache.snapshot(), [True]),
                 lambda: cache.restore_masked(cache.snapshot(), torch.tensor([1, 0, 1])),
                 lambda: cache.restore(seeded(batch=2).snapshot()),
                 lambda: cache.extend(TailOwnedKVCache()), lambda: cache.trim(-1),
                 lambda: cache.reserve(-1), lambda: cache.freeze_capacity(0),
                 lambda: cache.attention(torch.randn(2, HQ, 1, D)),
                 lambda: RaggedBatchKVCache(step=0), lambda: RaggedBatchKVCache(batch_size=0),
                 lambda: RaggedBatchKVCache(offsets=[1])):
        with pytest.raises(ValueError):
            call()
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="empty"):
        RaggedBatchKVCache(batch_size=2).attention(torch.randn(2, HQ, 1, D))


def test_bad_query_counts_are_refused_by_name_and_a_late_start_sees_all():
    cache = seeded(batch=2)  # rows of 5 tokens
    before = frozen_state(cache)
    for call, match in ((lambda: cache.make_mask(-1), "q_len"), (lambda: cache.make_mask(1.5), "q_len"),
                        (lambda: cache.make_mask(True), "q_len"), (lambda: cache.make_mask("2"), "q_len"),
                        (lambda: cache.make_mask(1, -3), "key_len"),
                        (lambda: cache.restore_masked(cache.snapshot(), torch.tensor([True, False], device="meta")),
                         "meta device")):
        with pytest.raises(ValueError, match=match):
            call()
    assert_unchanged(cache, before)
    # a start past a row's tokens is taken: its query sees all of the row's keys (a released row's do too)
    assert cache.make_mask(1, None, [9, 4])[:, 0, 0, :6].tolist() == [[True] * 5 + [False], [True] * 5 + [False]]


# -- bookkeeping, rollback, batch ------------------------------------------------------------------
def test_trim_is_clamped_by_the_shortest_row():
    cache = RaggedBatchKVCache(step=STEP, keys=torch.randn(2, H, 5, D), values=torch.randn(2, H, 5, D),
                               offsets=[5, 2])
    assert cache.trim(3) == 2 and cache.offset.tolist() == [3, 0]
    assert cache.trim(1) == 0 and cache.is_trimmable()
    assert not cache.empty() and RaggedBatchKVCache(batch_size=2).empty()


def test_masked_restore_from_a_smaller_capacity():
    torch.manual_seed(3)
    cache = RaggedBatchKVCache(batch_size=2, step=STEP)
    cache.update(*kv(2, 3))
    snap, keys0, values0 = cache.snapshot(), cache.keys[:, :, :3].clone(), cache.values[:, :, :3].clone()
    cache.update(*kv(2, 9))  # grows from 4 to 12
    grown_row1 = cache.keys[1, :, :12].clone()
    cache.restore_masked(snap, [True, False])
    assert cache.offset.tolist() == [3, 12]
    assert torch.equal(cache.keys[0, :, :3], keys0[0]) and torch.equal(cache.values[0, :, :3], values0[0])
    assert torch.equal(cache.keys[1, :, :12], grown_row1)
    cache.update(*kv(2, 1))  # the restored row appends at its restored length
    assert cache.offset.tolist() == [4, 13]


def test_layer_helpers_check_everything_before_restoring():
    layers = [seeded(), seeded()]
    snaps = snapshot_ragged_caches(layers)
    for c in layers:
        c.update(*kv(3, 2))
    before = [frozen_state(c) for c in layers]
    with pytest.raises(ValueError):
        restore_ragged_caches(layers, snaps[:1])
    with pytest.raises(ValueError):
        restore_ragged_caches_masked(layers, snaps, [True, False])
    for c, b in zip(layers, before):
        assert_unchanged(c, b)
    restore_ragged_caches_masked(layers, snaps, [False, True, False])
    assert [c.offset.tolist() for c in layers] == [[7, 5, 7]] * 2
    restore_ragged_caches(layers, snaps)
    assert [c.offset.tolist() for c in layers] == [[5, 5, 5]] * 2


def test_extend_aligns_capacities_and_refuses_past_a_frozen_one():
    small, big = seeded(batch=1, step=8), seeded(batch=2, tokens=20, step=8)
    small.extend(big)
    assert small.capacity == 24 and small.offset.tolist() == [5, 20, 20]
    frozen = seeded(batch=1, step=8)
    frozen.freeze_capacity(8)
    with pytest.raises(RaggedCapacityError):
        frozen.extend(seeded(batch=1, tokens=20, step=8))
    pinned = RaggedBatchKVCache(batch_size=1, step=8)
    pinned.freeze_capacity(64)  # before its first write: extend keeps it (before: took the other's 8)
    pinned.extend(seeded(batch=1, step=8))
    assert pinned.capacity == 64 == pinned.meta_state["capacity"] and pinned.frozen and pinned.can_reserve(59)


def test_state_round_trip_is_exact():
    torch.manual_seed(4)
    cache = RaggedBatchKVCache(batch_size=3, step=STEP)
    cache.update(*kv(3, 6), new_offsets=[6, 2, 4])
    cache.update(*kv(3, 2), write_start=[5, 2, 3])
    cache.freeze_capacity(16)
    back = RaggedBatchKVCache.from_state(cache.state, cache.meta_state)
    assert back.meta_state == cache.meta_state and torch.equal(back.offset, cache.offset)
    n = cache.size()
    assert torch.equal(back.keys[:, :, :n], cache.keys[:, :, :n]) and back.capacity == 16
    q = torch.randn(3, HQ, 2, D)
    torch.testing.assert_close(back.attention(q), cache.attention(q), atol=0, rtol=0)
    for empty in (RaggedBatchKVCache(batch_size=2), RaggedBatchKVCache()):
        again = RaggedBatchKVCache.from_state(empty.state, empty.meta_state)
        assert again.meta_state == empty.meta_state and again.empty()
    with pytest.raises(ValueError, match="tier"):
        RaggedBatchKVCache.from_state({}, {"tier": "tail", "step": 4, "capacity": 0})


def test_a_frozen_large_capacity_round_trips_through_a_file(tmp_path):
    """Frozen for static shapes (freeze_capacity(131072)) and saved after a 1,000-token prompt:
    the capacity is part of the cache's contract, so it loads exactly (it was refused: more
    than the tokens plus 65536); writes go on in the same buffers, as the original's do."""
    torch.manual_seed(5)
    cache = RaggedBatchKVCache(batch_size=2, step=256)
    cache.freeze_capacity(131_072)
    cache.update(*kv(2, 1000), new_offsets=[1000, 600])
    save_cache(tmp_path / "c.safetensors", [cache])
    (back,), _ = load_cache(tmp_path / "c.safetensors")
    assert (back.capacity, back.frozen) == (131_072, True) and back.meta_state == cache.meta_state
    assert all(torch.equal(back.state[n], cache.state[n]) for n in cache.state)
    ptr = back.keys.data_ptr()
    for c in (back, cache):
        c.update(*kv(2, 1, torch.Generator().manual_seed(1)))
    assert torch.equal(back.keys, cache.keys) and torch.equal(back.values, cache.values)
    q = torch.randn(2, HQ, 2, D)
    assert torch.equal(back.attention(q), cache.attention(q)) and back.keys.data_ptr() == ptr
    with pytest.raises(RaggedCapacityError, match="past the frozen capacity 131072"):
        back.reserve(131_072)


def test_conversions_and_config():
    tail = TailOwnedKVCache(step=8)
    k, v = kv(2, 5)
    tail.update(k, v)
    ragged = RaggedBatchKVCache.from_cache(tail, step=16)
    assert ragged.offset.tolist() == [5, 5] and ragged.capacity == 16
    assert torch.equal(ragged.keys[:, :, :5], k)
    copy = RaggedBatchKVCache.from_cache(ragged, step=4)
    assert copy.capacity == 8 and torch.equal(copy.keys[:, :, :5], k)
    with pytest.raises(ValueError, match="1 or 3 rows"):
        RaggedBatchKVCache.from_scalar_cache(tail, batch_size=3)
    caches = [tail, None]
    stats = configure_kv_cache(caches, KVCacheConfig(tier="ragged", step=32))
    assert stats["entries"] == 1 and isinstance(caches[0], RaggedBatchKVCache)
    assert caches[0].step == 32 and caches[0].offset.tolist() == [5, 5]
    fresh = make_caches(2, KVCacheConfig(tier="ragged"), batch_size=3)
    assert all(c.offset.tolist() == [0, 0, 0] for c in fresh)
    back = TailOwnedKVCache.from_cache(copy)
    assert back.offset == 5 and torch.equal(back.keys[:, :, :5], k)


def test_docs_example_runs():
    text = (Path(__file__).parents[2] / "docs" / "ragged.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/ragged.md", "exec"), {})
