"""StepPlanner against the unplanned per-layer path, on the caches alone (no model).

The reference is the same per-layer caches written the ordinary way: each layer
books its own one-token write (``write_start``/``new_offsets``). A planned step
must leave the same lengths and contents and give the same attention, with the
positions and page slots computed once for every layer.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.caches.base import CacheCapacityError
from kvtier.caches.paged import PagedKVCache
from kvtier.caches.ragged import RaggedBatchKVCache
from kvtier.caches.step_plan import StepPlanner
from kvtier.caches.tail_owned import TailOwnedKVCache

H, HQ, D, LAYERS = 2, 4, 8, 3
MAKERS = {
    "ragged": lambda B: RaggedBatchKVCache(batch_size=B, step=8),
    "paged": lambda B: PagedKVCache(4, 64, batch_size=B),
    "paged-growing": lambda B: PagedKVCache(4, 2, batch_size=B, dynamic=True),
}


def layers(tier: str, B: int) -> list:
    return [MAKERS[tier](B) for _ in range(LAYERS)]


def write_prefix(caches: list, lengths: list[int], gen: torch.Generator) -> None:
    """Each layer its own K/V; row ``r`` commits ``lengths[r]`` tokens."""
    if max(lengths) == 0:
        return
    B, n = len(lengths), max(lengths)
    for c in caches:
        c.update(torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen),
                 new_offsets=lengths)


def same_contents(a: list, b: list) -> None:
    for ca, cb in zip(a, b):
        assert ca.lengths == cb.lengths and ca.offset.tolist() == cb.offset.tolist()
        for x, y in zip(ca.fetch(), cb.fetch()):
            for r, n in enumerate(ca.lengths):
                assert torch.equal(x[r, :, :n], y[r, :, :n])


@pytest.mark.parametrize("tier", list(MAKERS))
@pytest.mark.parametrize("lengths", [[6, 10, 2], [1, 1], [3], [0, 0]])
def test_planned_steps_equal_the_per_layer_path(tier, lengths):
    """Block boundaries and capacity steps are crossed, capacity is reserved on the way
    (reserve_tokens=5), and [0, 0] starts from empty caches (the first step unplanned)."""
    B, steps = len(lengths), 13
    gen = torch.Generator().manual_seed(len(lengths))
    planned, ref = layers(tier, B), layers(tier, B)
    state = gen.get_state()
    write_prefix(planned, lengths, gen)
    gen.set_state(state)
    write_prefix(ref, lengths, gen)
    planner = StepPlanner(planned, lengths, reserve_tokens=5)
    pos = list(lengths)
    for _ in range(steps):
        kw = planner.prepare()
        if "plan" in kw and planner.block_size is not None:  # the slots come from the one table
            view, bs = planned[0].block_table_view(), planner.block_size
            want = [view.rows[r][p // bs] * bs + p % bs for r, p in enumerate(pos)]
            assert kw["plan"].slots.tolist() == want
        for i in range(LAYERS):
            k, v = torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen)
            q = torch.randn(B, HQ, 1, D, generator=gen)
            planned[i].update(k, v, **kw)
            ref[i].update(k, v, write_start=pos, new_offsets=[p + 1 for p in pos])
            torch.testing.assert_close(planned[i].attention(q), ref[i].attention(q), rtol=0, atol=1e-6)
        pos = [p + 1 for p in pos]
        assert planner.lengths == pos
    same_contents(planned, ref)
    assert all(c.lengths == pos for c in planned)  # the host books follow the plan: no device read
    if tier != "ragged":  # one table for all layers: every layer holds the same blocks
        assert all(c.block_table_view().rows == planned[0].block_table_view().rows for c in planned)


def test_a_cache_changed_outside_the_plan_ends_it_and_a_no_op_does_not():
    gen = torch.Generator().manual_seed(0)
    caches = layers("paged", 2)
    write_prefix(caches, [5, 3], gen)
    planner = StepPlanner(caches, [5, 3])
    for _ in range(2):
        kw = planner.prepare()
        for c in caches:
            c.update(torch.randn(2, H, 1, D), torch.randn(2, H, 1, D), **kw)
    caches[1].set_lengths([7, 5])  # the lengths it has: nothing changes, the plan holds
    assert kw["plan"].valid
    caches[1].set_lengths([6, 5])  # a rollback outside the plan
    assert not kw["plan"].valid
    with pytest.raises(ValueError, match="changed outside"):
        planner.prepare()
    assert planner.lengths == [7, 5] and caches[0].lengths == [7, 5]


def test_a_frozen_ragged_cache_without_room_refuses_the_step_and_books_nothing():
    caches = layers("ragged", 2)
    write_prefix(caches, [7, 2], torch.Generator().manual_seed(0))
    for c in caches:
        c.freeze()  # capacity 8: one more step for row 0
    planner = StepPlanner(caches)
    kw = planner.prepare()
    for c in caches:
        c.update(torch.randn(2, H, 1, D), torch.randn(2, H, 1, D), **kw)
    with pytest.raises(CacheCapacityError, match="frozen capacity"):
        planner.prepare()
    assert planner.lengths == [8, 3] and all(c.lengths == [8, 3] for c in caches)


def test_a_planned_write_checks_its_input_and_changes_nothing_when_refused():
    caches = [PagedKVCache(4, 16, batch_size=2), PagedKVCache(4, 16, batch_size=2)]
    k = torch.randn(2, 2, 3, 16)
    for c in caches:
        c.update(k, k, new_offsets=[3, 2])
    planner = StepPlanner(caches, [3, 2])
    kw = planner.prepare()
    data = [t.clone() for t in caches[0].fetch()]
    with pytest.raises(ValueError, match="1 token"):
        caches[0].update(k, k, **kw)  # three tokens where the plan writes one
    with pytest.raises(ValueError, match="plan's own tensor"):
        caches[0].update(k[:, :, :1], k[:, :, :1], plan=kw["plan"], write_start=torch.tensor([3, 2]))
    assert caches[0].offset.tolist() == [3, 2]
    assert all(torch.equal(a, b) for a, b in zip(data, caches[0].fetch()))


def test_step_planner_refuses_caches_it_cannot_plan():
    with pytest.raises(ValueError, match="RowKVCache"):
        StepPlanner([TailOwnedKVCache(), TailOwnedKVCache()])
    with pytest.raises(ValueError, match="one per-row tier"):
        StepPlanner([RaggedBatchKVCache(batch_size=2), PagedKVCache(batch_size=2)])
    caches = [RaggedBatchKVCache(batch_size=2, step=8) for _ in range(2)]
    caches[0].update(torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16))
    with pytest.raises(ValueError, match="layer 1 holds rows of lengths"):
        StepPlanner(caches, [3, 3])
    with pytest.raises(ValueError, match="2 ints"):
        StepPlanner(caches[:1], [3])
    with pytest.raises(ValueError, match="reserve_tokens"):
        StepPlanner(caches[:1], reserve_tokens=0)
    paged = [PagedKVCache(4, 16, batch_size=2) for _ in range(2)]
    k = torch.randn(2, 2, 2, 16)
    for c, first in zip(paged, ([0, 2], [2, 0])):  # the rows take their blocks in another order
        c.update(k, k, new_offsets=first)
        c.update(k, k, write_start=first, new_offsets=[2, 2])
    assert paged[0].block_table_view().rows != paged[1].block_table_view().rows
    with pytest.raises(ValueError, match="block tables differ"):
        StepPlanner(paged, [2, 2])
