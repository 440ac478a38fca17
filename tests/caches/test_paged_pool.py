"""BlockPool (the paged tier's memory) against a reference model of its books.

The reference is a plain dict: the set of free block ids and, per row, the list of
blocks it holds. Every operation is applied to both; after each one the pool must
agree with the reference and keep its invariant (every allocated block free or
held by exactly one row: ``free + used == allocated``), with block tables that
mirror the host lists and pages that keep what was written in them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.caches.paged_pool import BlockPool, PagedKVGrowthRefused, paged_grown_blocks
from kvtier.quant.codec import IdentityCodec

H, D, BS = 2, 4, 4
CODEC = IdentityCodec(D, torch.float32)


def pool_of(batch: int, blocks: int, **kw) -> BlockPool:
    return BlockPool(BS, batch, initial_blocks=blocks, **kw)


def check_books(pool: BlockPool, held: list[list[int]], free: set[int]) -> None:
    """The pool's books equal the reference's; tables mirror the host lists."""
    assert [list(r) for r in pool.rows] == held
    assert set(pool.free) == free and len(pool.free) == len(free)  # no id listed twice
    used = [b for r in pool.rows for b in r]
    assert len(used) == len(set(used)) and not set(used) & free
    assert sorted(used + pool.free) == list(range(pool.num_blocks))
    assert len(pool.free) + pool.used_blocks == pool.num_blocks
    figures = pool.figures(0)
    assert figures["free_blocks"] + figures["used_blocks"] == figures["allocated_blocks"]
    tables = pool.block_tables
    assert tables.shape == (len(held), pool.num_blocks) and tables.dtype == torch.int32
    for r, row in enumerate(held):
        assert tables[r, : len(row)].tolist() == row
        assert not tables[r, len(row):].any()


def mark(pool: BlockPool, blocks: list[int], value: float) -> None:
    """Fill whole blocks of both page tensors with ``value`` (what a row wrote there)."""
    if blocks:
        idx = torch.tensor(blocks)
        pool.key_cache[idx] = value
        pool.value_cache[idx] = -value


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_assign_release_sequences_keep_the_books(data):
    """assign / release / grow / add_rows / select in any order: the books follow the
    reference, blocks handed out were free, and every held block keeps its contents."""
    B = data.draw(st.integers(1, 4), label="B")
    dynamic = data.draw(st.booleans(), label="dynamic")
    pool = pool_of(B, data.draw(st.integers(1, 6), label="blocks"), dynamic=dynamic)
    pool.make_room(0, H, CODEC, CODEC, "cpu")  # allocate
    held = [[] for _ in range(B)]
    free = set(range(pool.num_blocks))
    owner_value: dict[int, float] = {}  # block -> what its row wrote in it
    for step in range(data.draw(st.integers(1, 12), label="ops")):
        op = data.draw(st.sampled_from(["assign", "assign", "release", "add_rows", "select"]), label="op")
        if op == "assign":
            extra = [data.draw(st.integers(0, 3), label="extra") for _ in held]
            need = sum(extra)
            if need > len(free) and not dynamic:
                before = ([list(r) for r in pool.rows], list(pool.free), pool.num_blocks)
                with pytest.raises(PagedKVGrowthRefused, match="KVTIER_DYNAMIC_PAGED_KV"):
                    pool.make_room(need, H, CODEC, CODEC, "cpu")
                assert ([list(r) for r in pool.rows], list(pool.free), pool.num_blocks) == before
                continue
            old = pool.num_blocks
            grew = pool.make_room(need, H, CODEC, CODEC, "cpu")
            if need > len(free):  # grown by the rule, the new blocks free
                need_tokens = (old - len(free) + need) * BS
                assert grew and pool.num_blocks == paged_grown_blocks(old, need_tokens, BS)
                free |= set(range(old, pool.num_blocks))
            else:
                assert not grew and pool.num_blocks == old
            pool.assign(extra)
            for r, k in enumerate(extra):
                new = pool.rows[r][len(held[r]):]
                assert len(new) == k and set(new) <= free  # handed out from the free list
                free -= set(new)
                held[r] += new
                mark(pool, new, float(step * 10 + r + 1))
                owner_value.update({b: float(step * 10 + r + 1) for b in new})
        elif op == "release":
            rows = data.draw(st.lists(st.integers(0, len(held) - 1), unique=True), label="rows")
            pool.release(rows)
            for r in rows:
                free |= set(held[r])
                for b in held[r]:
                    owner_value.pop(b)
                held[r] = []
        elif op == "add_rows":
            n = data.draw(st.integers(1, 2), label="count")
            pool.add_rows(n)
            held += [[] for _ in range(n)]
        else:  # filter: release the rows not kept, then select (the paged tier's order)
            keep = data.draw(st.lists(st.integers(0, len(held) - 1), unique=True, min_size=1), label="keep")
            gone = [r for r in range(len(held)) if r not in keep]
            pool.release(gone)
            for r in gone:
                free |= set(held[r])
                for b in held[r]:
                    owner_value.pop(b)
            pool.select(keep)
            held = [held[r] for r in keep]
        check_books(pool, held, free)
        for b, value in owner_value.items():  # growth and reordering never touch a held block
            assert torch.all(pool.key_cache[b] == value) and torch.all(pool.value_cache[b] == -value)


def test_freed_blocks_come_back_last_freed_first_and_new_blocks_lowest_first():
    pool = pool_of(2, 4)
    pool.make_room(0, H, CODEC, CODEC, "cpu")
    pool.assign([2, 1])
    assert pool.rows == [[0, 1], [2]]
    pool.release([0])
    assert pool.free == [3, 1, 0]  # the row's blocks, its first block on top
    pool.assign([0, 2])
    assert pool.rows == [[], [2, 0, 1]]


def test_slots_map_positions_through_the_row_blocks(monkeypatch):
    import kvtier.caches.paged_pool as pool_module

    pool = pool_of(2, 8)
    pool.make_room(0, H, CODEC, CODEC, "cpu")
    pool.assign([1, 0])
    pool.assign([1, 3])  # rows [[0, 2], [1, 3, 4]]
    starts, counts = [2, 5], [5, 6]
    want = [pool.rows[r][p // BS] * BS + p % BS for r in range(2) for p in range(starts[r], starts[r] + counts[r])]
    host = pool.slots(starts, counts, torch.device("cpu"))
    monkeypatch.setattr(pool_module, "HOST_SLOTS_MAX", 0)  # the device-table path
    device = pool.slots(starts, counts, torch.device("cpu"))
    assert host.tolist() == device.tolist() == want
    assert pool.extra_blocks([9, 12]) == [1, 0]  # row 0 needs a third block for position 8


def test_growth_refused_when_frozen_or_fixed_and_clamped_to_the_window():
    fixed = pool_of(1, 2)
    fixed.make_room(2, H, CODEC, CODEC, "cpu")
    with pytest.raises(PagedKVGrowthRefused, match="does not grow"):
        fixed.make_room(3, H, CODEC, CODEC, "cpu")
    frozen = pool_of(1, 2, dynamic=True)
    frozen.make_room(0, H, CODEC, CODEC, "cpu")
    frozen.frozen = True
    with pytest.raises(PagedKVGrowthRefused, match="frozen"):
        frozen.make_room(3, H, CODEC, CODEC, "cpu")
    assert frozen.num_blocks == 2 and frozen.free == [1, 0]
    window = pool_of(1, 10, dynamic=True, context_window_tokens=14 * BS)
    window.make_room(11, H, CODEC, CODEC, "cpu")
    assert window.num_blocks == 14  # 1.5x would give 15; the window holds 14


def test_state_round_trips_and_an_inconsistent_state_is_refused():
    pool = pool_of(2, 6)
    pool.make_room(0, H, CODEC, CODEC, "cpu")
    pool.assign([2, 1])
    mark(pool, pool.rows[0], 7.0)
    pool.release([1])
    state = {k: v.clone() for k, v in pool.state().items()}
    back = pool_of(2, 6)
    back.load(state, CODEC, CODEC)
    assert back.rows == pool.rows and back.free == pool.free
    assert torch.equal(back.key_cache, pool.key_cache) and torch.equal(back.block_tables, pool.block_tables)
    state["free_blocks"] = torch.tensor(pool.free[1:])  # a block lost from the books
    with pytest.raises(ValueError, match="exactly once"):
        pool_of(2, 6).load(state, CODEC, CODEC)
