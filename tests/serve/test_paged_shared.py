"""SharedBlockPagedKVCache: rows bound to blocks an outside manager owns, shared between rows.

The reference is a list of K/V tokens per row and PyTorch SDPA over them; for
quantised pages, a plain PagedKVCache of the same mode holding the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.caches.paged import PagedKVCache
from kvtier.caches.paged_pool import PagedKVGrowthRefused
from kvtier.caches.paged_shared import RowBinding, SharedBlockPagedKVCache, decode_plan
from kvtier.kernels.reference import causal_attention

H, HQ, D, BS, N = 2, 4, 64, 4, 16


def make(kv_quant=None) -> SharedBlockPagedKVCache:
    cache = SharedBlockPagedKVCache(block_size=BS, num_blocks=N, kv_quant=kv_quant)
    cache.allocate(H, D, torch.float32, "cpu")
    return cache


def bind(cache, blocks, lengths) -> RowBinding:
    rows = RowBinding.build(blocks, lengths, block_size=BS, num_blocks=N)
    cache.bind(rows)
    return rows


def test_allocate_takes_the_whole_pool_up_front() -> None:
    cache = make()
    s = cache.paged_stats()
    assert s["allocated_blocks"] == N and s["free_blocks"] == 0 and cache.frozen
    assert cache.key_cache.shape == (N, BS, H, D)
    with pytest.raises(ValueError, match="already allocated"):
        cache.allocate(H, D, torch.float32, "cpu")


def test_rows_share_a_prefix_block_and_attend_like_sdpa(seed) -> None:
    cache = make()
    prefix_k, prefix_v = torch.randn(1, H, 6, D), torch.randn(1, H, 6, D)
    bind(cache, [[7, 3]], [0])
    cache.update(prefix_k, prefix_v)  # row "A": 6 tokens in blocks 7, 3
    # two rows share block 7 (A's first 4 tokens); each writes its own continuation
    own_k, own_v = torch.randn(2, H, 3, D), torch.randn(2, H, 3, D)
    bind(cache, [[7, 3, 11], [7, 9]], [6, 4])
    cache.update(own_k[:, :, :3], own_v[:, :, :3], new_offsets=[9, 6])  # row 1 commits 2 of 3
    q = torch.randn(2, HQ, 3, D)
    out = cache.attention(q)
    for r, (keep, start) in enumerate(((6, 6), (4, 4))):
        k = torch.cat([prefix_k[:, :, :keep], own_k[r : r + 1]], dim=2)  # (1, H, keep+3, D)
        v = torch.cat([prefix_v[:, :, :keep], own_v[r : r + 1]], dim=2)
        n = 9 if r == 0 else 6
        want = causal_attention(q[r : r + 1], k[:, :, :n], v[:, :, :n], q_start=start, kv_len=n)
        torch.testing.assert_close(out[r : r + 1], want)
    # row 0's tokens 4..5 (block 3) are untouched by row 1's write into block 9
    bind(cache, [[7, 3]], [6])
    K, _ = cache.fetch()
    torch.testing.assert_close(K, prefix_k)


def test_decode_plan_equals_the_unplanned_step(seed) -> None:
    planned, plain = make(), make()
    k0, v0 = torch.randn(2, H, 5, D), torch.randn(2, H, 5, D)
    blocks, lengths = [[1, 2], [4, 5]], [5, 3]
    for c in (planned, plain):
        bind(c, blocks, [0, 0])
        c.update(k0, v0, new_offsets=lengths)
    k, v, q = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D), torch.randn(2, HQ, 1, D)
    rows = bind(planned, blocks, lengths)
    plan = decode_plan(rows)
    planned.update(k, v, plan=plan)
    bind(plain, blocks, lengths)
    plain.update(k, v)
    assert planned.offset.tolist() == plain.offset.tolist() == [6, 4]
    torch.testing.assert_close(planned.attention(q), plain.attention(q))


def test_quantised_pages_share_like_the_paged_tier(seed) -> None:
    shared, ref = make("q8"), PagedKVCache(block_size=BS, num_blocks=N, batch_size=1, kv_quant="q8")
    k, v = torch.randn(1, H, 8, D), torch.randn(1, H, 8, D)
    bind(shared, [[0, 1]], [0])
    shared.update(k, v)
    ref.update(k, v)
    assert shared.codecs.mode == "q8"
    kq, vq = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
    bind(shared, [[0, 1, 2], [0, 3]], [8, 4])  # row 1 reads row 0's first quantised block
    shared.update(kq, vq)
    q = torch.randn(2, HQ, 1, D)
    out = shared.attention(q)
    K, V = ref.fetch()  # the dequantised prefix
    for r, n in enumerate((8, 4)):
        ref_row = PagedKVCache(block_size=BS, num_blocks=N, batch_size=1, kv_quant="q8")
        ref_row.update(K[:, :, :n], V[:, :, :n])
        ref_row.update(kq[r : r + 1], vq[r : r + 1])
        torch.testing.assert_close(out[r : r + 1], ref_row.attention(q[r : r + 1]), atol=1e-5, rtol=1e-4)


def test_write_past_held_blocks_raises_and_changes_nothing(seed) -> None:
    cache = make()
    bind(cache, [[0]], [0])
    cache.update(torch.randn(1, H, 3, D), torch.randn(1, H, 3, D))
    before = cache.key_cache.clone()
    with pytest.raises(PagedKVGrowthRefused, match="own only"):
        cache.update(torch.randn(1, H, 2, D), torch.randn(1, H, 2, D))
    assert torch.equal(cache.key_cache, before) and cache.offset.tolist() == [3]
    with pytest.raises(ValueError, match="no block for position"):
        decode_plan(RowBinding.build([[0]], [4], block_size=BS, num_blocks=N))


@pytest.mark.parametrize("blocks, lengths, match", [
    ([[0]], [5], "claims 5 tokens"),
    ([[0, N]], [1], r"not in \[0, 16\)"),
    ([], [], "at least one row"),
])
def test_bad_bindings_are_refused(blocks, lengths, match) -> None:
    with pytest.raises(ValueError, match=match):
        RowBinding.build(blocks, lengths, block_size=BS, num_blocks=N)


def test_block_lifecycle_calls_are_refused() -> None:
    cache = make()
    for call in (lambda: cache.release([0]), lambda: cache.filter([0]), lambda: cache.reserve(1),
                 lambda: cache.extend(make())):
        with pytest.raises(ValueError, match="block manager"):
            call()
    with pytest.raises(ValueError, match="8 blocks of 4"):
        cache.bind(RowBinding.build([[0]], [0], block_size=BS, num_blocks=8))
