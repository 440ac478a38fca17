"""BlockManager: reference counts, the hash chain, the LRU of cached blocks.

The reference is a plain model of the requests: each holds its token ids and its
block list, and each physical block the tokens written into it. A cached block may
only be handed to a request whose prompt starts with exactly that block's chain.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.serve.prefix import BlockManager, NoFreeBlocks, chain_hash

BS = 4


def test_chain_hash_depends_on_every_block_before() -> None:
    a = chain_hash(None, [1, 2, 3, 4])
    assert chain_hash(a, [5, 6, 7, 8]) != chain_hash(chain_hash(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert chain_hash(a, [5, 6, 7, 8]) == chain_hash(chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_shared_prefix_is_reused_and_counted() -> None:
    bm = BlockManager(8, BS)
    prompt = list(range(10))
    a = bm.allocate(10)
    assert bm.match_prefix(prompt) == []  # nothing computed yet
    bm.cache_full_blocks(a, prompt, 10)
    b_prefix = bm.match_prefix(prompt[:9] + [99])
    assert b_prefix == a[:2]
    b = bm.allocate(11, b_prefix)
    assert b[:2] == a[:2] and len(b) == 3 and b[2] not in a
    assert [bm.ref_count(x) for x in a[:2]] == [2, 2]
    assert (bm.prefix_queries, bm.prefix_hits) == (21, 8)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2


def test_lru_evicts_least_recently_freed_tail_first() -> None:
    bm = BlockManager(3, BS)
    old, new = list(range(8)), list(range(100, 108))
    for prompt in (old, new[:4]):
        blocks = bm.allocate(len(prompt))
        bm.cache_full_blocks(blocks, prompt, len(prompt))
        bm.free(blocks)
    assert bm.num_cached_blocks == 3
    fresh = bm.allocate(4)  # no never-cached block left: evicts old's tail block first
    assert bm.match_prefix(old) == bm.match_prefix(old[:4]) and len(bm.match_prefix(old)) == 1
    assert len(bm.match_prefix(new[:4])) == 1
    bm.free(fresh)


def test_duplicate_block_is_not_shared_and_freed_plainly() -> None:
    bm = BlockManager(4, BS)
    prompt = list(range(5))
    a, b = bm.allocate(5), bm.allocate(5)  # two requests compute the same prompt at once
    bm.cache_full_blocks(a, prompt, 5)
    bm.cache_full_blocks(b, prompt, 5)
    assert bm.num_cached_blocks == 1 and bm.match_prefix(prompt) == a[:1]
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.match_prefix(prompt) == a[:1]


def test_errors_change_nothing() -> None:
    bm = BlockManager(2, BS)
    blocks = bm.allocate(5)
    with pytest.raises(NoFreeBlocks, match="num-blocks"):
        bm.allocate(1)
    with pytest.raises(NoFreeBlocks):
        bm.grow(blocks, 9)
    assert len(blocks) == 2 and bm.num_free_blocks == 0
    with pytest.raises(ValueError, match="no cached prefix"):
        bm.allocate(9, [blocks[0]])
    bm.free(blocks)
    with pytest.raises(ValueError, match="exactly once"):
        bm.free(blocks)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate(0)
    with pytest.raises(ValueError, match="positive int"):
        BlockManager(0, BS)
    assert bm.num_free_blocks == 2


def test_reset_prefix_cache_forgets_every_prefix_only_when_no_block_is_held() -> None:
    bm = BlockManager(8, BS)
    prompt = list(range(10))
    a = bm.allocate(10)
    bm.cache_full_blocks(a, prompt, 10)
    with pytest.raises(ValueError, match="3 blocks are held by requests"):
        bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 2 and bm.prefix_queries == 10  # nothing changed
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert (bm.num_cached_blocks, bm.num_free_blocks, bm.prefix_queries, bm.prefix_hits) == (0, 8, 0, 0)
    assert bm.match_prefix(prompt) == []
    assert sorted(bm.allocate(8 * BS)) == list(range(8))  # every block handed out again


def test_prefix_caching_off_never_shares() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    a = bm.allocate(9)
    bm.cache_full_blocks(a, prompt, 9)
    assert bm.match_prefix(prompt) == [] and bm.num_cached_blocks == 0
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.prefix_queries == 0


class BlockBooks(RuleBasedStateMachine):
    """Random admissions, computations, growth and frees against the reference model."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS)
        self.requests: list[dict] = []  # {"tokens", "blocks", "computed"}
        self.content: dict[int, tuple[int, ...]] = {}  # block -> every token up to its end

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, tokens):
        prefix = self.bm.match_prefix(tokens[:-1])
        for i, b in enumerate(prefix):  # the safety property: a cached block holds this very chain
            assert self.content[b] == tuple(tokens[: (i + 1) * BS])
        needed = self.bm.blocks_needed(len(tokens), prefix)
        before = self.books()
        if needed > self.bm.num_free_blocks:
            with pytest.raises(NoFreeBlocks):
                self.bm.allocate(len(tokens), prefix)
            assert self.books() == before
            return
        blocks = self.bm.allocate(len(tokens), prefix)
        assert blocks[: len(prefix)] == prefix and len(blocks) == self.bm.blocks_for(len(tokens))
        for b in blocks[len(prefix):]:
            self.content.pop(b, None)  # a fresh block holds nothing yet
        self.requests.append({"tokens": list(tokens), "blocks": blocks, "computed": len(prefix) * BS})

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), n=st.integers(1, 12))
    def compute(self, i, n):
        r = self.requests[i % len(self.requests)]
        end = min(len(r["tokens"]), r["computed"] + n)
        for pos in range(r["computed"], end):  # the forward writes these positions
            b = r["blocks"][pos // BS]
            assert self.bm.ref_count(b) == 1, "a shared block was written"
            if (pos + 1) % BS == 0:
                self.content[b] = tuple(r["tokens"][: pos + 1])
        r["computed"] = end
        self.bm.cache_full_blocks(r["blocks"], r["tokens"], end)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, i, new):
        r = self.requests[i % len(self.requests)]
        if r["computed"] < len(r["tokens"]):
            return  # decode appends only after the prompt is in
        before = self.books()
        try:
            self.bm.grow(r["blocks"], len(r["tokens"]) + len(new))
        except NoFreeBlocks:
            assert self.books() == before
            return
        r["tokens"] += new
        for b in r["blocks"][len(before["lists"][self.requests.index(r)]):]:
            self.content.pop(b, None)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        r = self.requests.pop(i % len(self.requests))
        self.bm.free(r["blocks"])

    def books(self) -> dict:
        bm = self.bm
        return {"refs": list(bm._refs), "free": list(bm._free), "lru": list(bm._evictable),
                "map": dict(bm._by_hash), "lists": [list(r["blocks"]) for r in self.requests]}

    @invariant()
    def balanced(self):
        bm = self.bm
        held = [b for r in self.requests for b in r["blocks"]]
        for b in range(bm.num_blocks):
            assert bm.ref_count(b) == held.count(b) >= 0
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert bm.num_used_blocks == len(set(held))
        unreferenced = sorted(bm._free + list(bm._evictable))
        assert unreferenced == [b for b in range(bm.num_blocks) if bm.ref_count(b) == 0]
        for h, b in bm._by_hash.items():  # a cached block's hash is the chain of what it holds
            tokens, parent = self.content[b], None
            for i in range(len(tokens) // BS):
                parent = chain_hash(parent, tokens[i * BS : (i + 1) * BS])
            assert parent == h and len(tokens) % BS == 0


TestBlockBooks = BlockBooks.TestCase
TestBlockBooks.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
