"""The per-row protocol of ``caches/base.py`` (:class:`RowKVCache`) on the ragged and paged tiers.

The reference is a list of tokens per row: ``lengths``, ``set_lengths`` (rollback),
``release`` and ``filter`` must leave each row holding exactly its list, later
writes must land at the rolled-back length, attention must see only the kept
tokens (PyTorch SDPA over the row's list), and bad input must change nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.caches.base import BlockTableView, CacheCapacityError, KVCache, RowKVCache
from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.paged import PagedKVCache
from kvtier.caches.ragged import RaggedBatchKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.kernels.reference import causal_attention

H, HQ, D = 2, 4, 8
TIERS = {
    "ragged": lambda B: RaggedBatchKVCache(batch_size=B, step=4),
    "paged": lambda B: PagedKVCache(2, 4, batch_size=B, dynamic=True),
}


def written(tier: str, lengths: list[int], seed: int = 0):
    """A cache whose rows hold ``lengths`` tokens, and the per-row lists of (k, v) tokens."""
    gen = torch.Generator().manual_seed(seed)
    B, n = len(lengths), max(lengths)
    k, v = torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)
    cache = TIERS[tier](B)
    cache.update(k, v, new_offsets=lengths)
    return cache, [[(k[b, :, t], v[b, :, t]) for t in range(L)] for b, L in enumerate(lengths)]


def check(cache: RowKVCache, ref: list[list]) -> None:
    assert cache.lengths == [len(r) for r in ref] == cache.offset.tolist()
    if cache.empty():
        return
    K, V = cache.fetch()
    for b, row in enumerate(ref):
        for t, (k, v) in enumerate(row):
            assert torch.equal(K[b, :, t], k) and torch.equal(V[b, :, t], v)


@pytest.mark.parametrize("tier", list(TIERS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_protocol_follows_a_list_of_tokens_per_row(tier, data):
    B = data.draw(st.integers(1, 3), label="B")
    cache = TIERS[tier](B)
    ref: list[list] = [[] for _ in range(B)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    for _ in range(data.draw(st.integers(1, 10), label="ops")):
        op = data.draw(st.sampled_from(["write", "write", "set_lengths", "release", "reserve", "filter"]))
        if op == "write":
            T = data.draw(st.integers(1, 4), label="T")
            append = data.draw(st.booleans(), label="append")
            ws = [len(r) if append else data.draw(st.integers(0, len(r)), label="ws") for r in ref]
            no = [data.draw(st.integers(w, w + T), label="no") for w in ws]
            k, v = torch.randn(len(ref), H, T, D, generator=gen), torch.randn(len(ref), H, T, D, generator=gen)
            cache.update(k, v, write_start=None if append else ws, new_offsets=no)
            ref = [(r[:w] + [(k[b, :, t], v[b, :, t]) for t in range(T)])[:n]
                   for b, (r, w, n) in enumerate(zip(ref, ws, no))]
        elif op == "set_lengths":
            new = [data.draw(st.integers(0, len(r)), label="length") for r in ref]
            cache.set_lengths(new)
            ref = [r[:n] for r, n in zip(ref, new)]
        elif op == "release":
            rows = data.draw(st.lists(st.integers(0, len(ref) - 1), unique=True), label="rows")
            cache.release(rows)
            ref = [[] if b in rows else r for b, r in enumerate(ref)]
        elif op == "reserve" and not cache.empty():
            n = data.draw(st.integers(0, 6), label="tokens")
            assert cache.can_reserve(n)
            cache.reserve(n)
            assert cache.headroom() >= n
        elif op == "filter" and not cache.empty():
            keep = data.draw(st.lists(st.integers(0, len(ref) - 1), unique=True, min_size=1), label="keep")
            cache.filter(keep)
            ref = [ref[b] for b in keep]
        assert cache.batch_size == len(ref)
        check(cache, ref)


@pytest.mark.parametrize("tier", list(TIERS))
def test_attention_after_a_rollback_sees_only_the_kept_tokens(tier):
    cache, ref = written(tier, [6, 4, 5])
    cache.set_lengths([3, 4, 1])
    ref = [r[:n] for r, n in zip(ref, [3, 4, 1])]
    k, v, q = torch.randn(3, H, 1, D), torch.randn(3, H, 1, D), torch.randn(3, HQ, 1, D)
    cache.update(k, v)  # each row appends at its rolled-back length
    out = cache.attention(q)
    for b, row in enumerate(ref):
        K = torch.stack([t[0] for t in row] + [k[b, :, 0]], dim=1)[None]  # (1, H, n + 1, D)
        V = torch.stack([t[1] for t in row] + [v[b, :, 0]], dim=1)[None]
        torch.testing.assert_close(out[b: b + 1], causal_attention(q[b: b + 1], K, V), atol=1e-5, rtol=1e-5)
    assert cache.lengths == [4, 5, 2]


def frozen(cache: RowKVCache) -> tuple:
    stats = {k: v for k, v in cache.stats().items() if k != "time_s"}
    return cache.lengths, [t.clone() for t in cache.fetch()], stats, cache.frozen


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("bad, match", [
    ([4, 2], r"rows \[0\] are outside"),
    ([1, 3], r"rows \[1\] are outside"),
    ([-1, 0], r"rows \[0\] are outside"),
    ([1], "2 ints"),
    (1, "2 ints"),
    ([1.0, 1], "2 ints"),
    ([True, 1], "2 ints"),
    (torch.tensor([1.0, 1.0]), "integer tensor"),
])
def test_bad_set_lengths_raise_and_change_nothing(tier, bad, match):
    cache, _ = written(tier, [3, 2])
    before = frozen(cache)
    with pytest.raises(ValueError, match=match):
        cache.set_lengths(bad)
    after = frozen(cache)
    assert after[0] == before[0] and after[2:] == before[2:]
    assert all(torch.equal(a, b) for a, b in zip(after[1], before[1]))
    cache.set_lengths(torch.tensor([1, 2]))  # an integer tensor is read on the host
    assert cache.lengths == [1, 2]


@pytest.mark.parametrize("tier", list(TIERS))
def test_reserve_then_freeze_allocates_nothing_more_and_refuses_past_it(tier):
    cache, ref = written(tier, [5, 2])
    cache.reserve(6)
    room = cache.headroom()
    assert room >= 6 and cache.can_reserve(room)
    cache.freeze()
    assert cache.frozen and cache.headroom() == room
    nbytes = cache.nbytes
    for _ in range(room):  # writes within the headroom allocate nothing
        cache.update(torch.randn(2, H, 1, D), torch.randn(2, H, 1, D))
    assert cache.nbytes == nbytes and cache.headroom() == 0
    before = frozen(cache)
    assert not cache.can_reserve(1000)
    with pytest.raises(CacheCapacityError):
        cache.reserve(1000)
    with pytest.raises(CacheCapacityError):
        cache.update(torch.randn(2, H, 1000, D), torch.randn(2, H, 1000, D))
    after = frozen(cache)
    assert after[0] == before[0] and after[2:] == before[2:]


def test_block_table_view_mirrors_the_books_and_only_a_pooled_tier_has_one():
    cache, _ = written("paged", [5, 1, 8])
    cache.release([1])
    view = cache.block_table_view()
    assert isinstance(view, BlockTableView) and view.block_size == 2
    assert [len(r) for r in view.rows] == [3, 0, 4]
    held = [b for r in view.rows for b in r]
    assert len(held) == len(set(held))  # no block in two rows
    assert view.tables.dtype == torch.int32 and tuple(view.tables.shape) == (3, 4)
    for r, row in enumerate(view.rows):
        assert view.tables[r, : len(row)].tolist() == list(row) and not view.tables[r, len(row):].any()
    assert PagedKVCache(batch_size=2).block_table_view().tables.shape == (2, 0)  # nothing allocated
    ragged, _ = written("ragged", [3, 1])
    assert ragged.block_table_view() is None and ragged.graph_blocker(torch.device("cuda")) is None
    assert "PyTorch reference" in PagedKVCache(attention_backend="torch").graph_blocker(torch.device("cuda"))
    for c in (cache, ragged):
        assert isinstance(c, RowKVCache) and c.storage_device == torch.device("cpu")
    for scalar in (TailOwnedKVCache(), BlockOwnedKVCache()):
        assert isinstance(scalar, KVCache) and not isinstance(scalar, RowKVCache)


def test_release_empties_rows_and_a_pooled_tier_takes_their_blocks_back():
    for tier in TIERS:
        cache, ref = written(tier, [5, 3, 4])
        cache.release([0, 2])
        check(cache, [[], ref[1], []])
        with pytest.raises(ValueError, match="distinct rows"):
            cache.release([1, 1])
        with pytest.raises(ValueError, match="distinct rows"):
            cache.release([3])
    assert cache.paged_stats()["used_blocks"] == 2  # the paged rows 0 and 2 gave their blocks back
