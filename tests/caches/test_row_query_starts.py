"""Where the per-row tiers put default queries once rows of different last writes share a
cache (``restore_masked``, ``extend``): the queries of the cache's last write start at that
write's ``write_start`` in the rows it wrote; every other row, and every other query count,
takes the row's newest positions (docs/ragged.md, Reading; docs/paged.md, Rows).

The reference is the same call with ``q_start`` given explicitly."""

from __future__ import annotations

import pytest
import torch

from kvtier.caches.paged import PagedKVCache
from kvtier.caches.ragged import RaggedBatchKVCache

H, HQ, D = 2, 4, 16


def kv(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, H, t, D, generator=g), torch.randn(b, H, t, D, generator=g)  # (B, H_kv, T, D)


def queries(b: int, t: int) -> torch.Tensor:
    return torch.randn(b, HQ, t, D, generator=torch.Generator().manual_seed(99))  # (B, H_q, T, D)


def newest(cache, t: int) -> list[int]:
    return [max(0, n - t) for n in cache.lengths]


@pytest.mark.parametrize("form", ["list", "tensor"])
def test_a_row_restored_to_a_longer_write_puts_a_one_token_query_at_its_newest_position(form):
    cache = RaggedBatchKVCache(batch_size=2, step=256, attention_backend="torch")
    cache.update(*kv(2, 10, 0))
    cache.update(*kv(2, 4, 1), new_offsets=[14, 12])  # a verify step at 10: row 1 commits 2 of 4
    snap = cache.snapshot()
    cache.update(*kv(2, 1, 2))  # the last write: one token per row
    mask = [False, True] if form == "list" else torch.tensor([False, True])
    cache.restore_masked(snap, mask)
    assert cache.lengths == [15, 12]
    q = queries(2, 1)
    # row 1's one query is no token of the cache's last write: it sits at 11 and sees all 12 keys
    # (before: at the snapshot's write_start 10, seeing 11)
    assert newest(cache, 1) == [14, 11]
    assert torch.equal(cache.attention(q), cache.attention(q, q_start=[14, 11]))
    assert cache.make_mask(1)[:, 0, 0].sum(-1).tolist() == [15, 12]


def test_after_a_trim_a_masked_restore_brings_back_the_last_write_of_the_restored_rows_only():
    cache = RaggedBatchKVCache(batch_size=2, step=8, attention_backend="torch")
    cache.update(*kv(2, 4, 0), new_offsets=[4, 3])  # a padded prefill from 0: row 1 commits 3
    snap = cache.snapshot()
    cache.update(*kv(2, 2, 1))
    cache.trim(1)  # no last write since: every query takes its row's newest positions
    cache.restore_masked(snap, [False, True])
    assert cache.lengths == [5, 3]
    q = queries(2, 4)
    # row 1 holds the prefill again: its 4 queries start where the prefill began; row 0's newest
    # (before: row 0 took the stale start 4 of the trimmed write)
    assert torch.equal(cache.attention(q), cache.attention(q, q_start=[1, 0]))
    assert cache.make_mask(4)[0, 0].sum(-1).tolist() == [2, 3, 4, 5]


def test_a_full_restore_brings_back_the_last_write_with_the_rows():
    cache = RaggedBatchKVCache(batch_size=2, step=8, attention_backend="torch")
    cache.update(*kv(2, 4, 0), new_offsets=[4, 3])
    snap = cache.snapshot()
    cache.update(*kv(2, 1, 1))
    cache.restore(snap)
    q = queries(2, 4)
    assert torch.equal(cache.attention(q), cache.attention(q, q_start=[0, 0]))


TIERS = {
    "ragged": lambda: RaggedBatchKVCache(batch_size=1, step=8, attention_backend="torch"),
    "paged": lambda: PagedKVCache(4, 16, batch_size=1, attention_backend="torch"),
}


@pytest.mark.parametrize("tier", list(TIERS))
def test_rows_brought_in_by_extend_put_other_query_counts_at_their_newest_positions(tier):
    mine, theirs = TIERS[tier](), TIERS[tier]()
    mine.update(*kv(1, 6, 0))
    mine.update(*kv(1, 1, 1))  # 7 tokens; the last write one token at 6
    theirs.update(*kv(1, 4, 2), new_offsets=3)  # a 4-token prefill from 0 that commits 3
    mine.extend(theirs)
    assert mine.lengths == [7, 3]
    q = queries(2, 1)
    # the appended row's one query sits at 2 and sees its 3 keys (before: at its old start 0)
    assert torch.equal(mine.attention(q), mine.attention(q, q_start=[6, 2]))


@pytest.mark.parametrize("tier", list(TIERS))
def test_extend_of_a_cache_without_a_last_write_takes_the_others(tier):
    mine, theirs = TIERS[tier](), TIERS[tier]()
    mine.update(*kv(1, 6, 0))
    mine.update(*kv(1, 2, 1))
    mine.trim(1)  # 7 tokens, no last write
    theirs.update(*kv(1, 4, 2), new_offsets=3)
    mine.extend(theirs)
    q = queries(2, 4)
    # the prefill's 4 queries start where it began in its row; this cache's row takes its newest
    # (before: its stale start 6)
    assert torch.equal(mine.attention(q), mine.attention(q, q_start=[3, 0]))
