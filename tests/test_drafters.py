"""Rolling caches back (``roll_back``) and the model drafter's own caches, against references.

The reference for a cache is a list of tokens per row: after ``roll_back`` every
layer holds exactly each row's kept tokens and the next write lands right after
them. A model drafter's caches must hold exactly the K/V of the tokens it says it
fed (``fed``), which a fresh forward of the same model over those tokens gives.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.config import KVCacheConfig, make_caches
from kvtier.drafters import Draft, ModelDrafter, draw, roll_back
from kvtier.model import ModelArgs, build_random
from kvtier.sampling import SamplingParams

H, D, LAYERS = 2, 8, 3
TIERS = ("tail", "block", "ragged", "paged")


def config(tier: str) -> KVCacheConfig:
    return KVCacheConfig(tier=tier, step=4, owned_block_size=4, paged_block_size=2, paged_num_blocks=64)


def per_row(tier: str) -> bool:
    return tier in ("ragged", "paged")


def written(tier: str, lengths: list[int], gen: torch.Generator):
    """Per-layer caches whose rows hold ``lengths`` tokens, and the per-layer, per-row lists."""
    caches = make_caches(LAYERS, config(tier), batch_size=len(lengths))
    B, n = len(lengths), max(lengths)
    ref = []
    for c in caches:
        k, v = torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)
        c.update(k, v, **({"new_offsets": lengths} if per_row(tier) else {}))
        ref.append([[(k[b, :, t], v[b, :, t]) for t in range(L)] for b, L in enumerate(lengths)])
    return caches, ref


def check(caches, ref) -> None:
    for c, rows in zip(caches, ref):
        off = c.offset
        assert (off.tolist() if isinstance(off, torch.Tensor) else [off] * len(rows)) == [len(r) for r in rows]
        K, V = c.fetch()
        for b, row in enumerate(rows):
            for t, (k, v) in enumerate(row):
                assert torch.equal(K[b, :, t], k) and torch.equal(V[b, :, t], v)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("seed", range(4))
def test_roll_back_keeps_each_rows_tokens_and_the_next_write_follows_them(tier, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    B = 3 if per_row(tier) else 1
    lengths = [rng.randint(1, 9) for _ in range(B)]
    caches, ref = written(tier, lengths, gen)
    for _ in range(3):  # rejected drafts: each row keeps a prefix, then the next cycle writes
        keep = [rng.randint(0, n) for n in lengths] if per_row(tier) else [rng.randint(0, lengths[0])]
        roll_back(caches, keep)
        ref = [[row[:n] for row, n in zip(rows, keep)] for rows in ref]
        check(caches, ref)
        T = rng.randint(1, 4)
        for c, rows in zip(caches, ref):
            k, v = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
            c.update(k, v)
            for b, row in enumerate(rows):
                row += [(k[b, :, t], v[b, :, t]) for t in range(T)]
        lengths = [n + T for n in keep]
        check(caches, ref)


@pytest.mark.parametrize("tier", TIERS)
def test_roll_back_past_a_row_or_to_uneven_scalar_rows_changes_nothing(tier):
    gen = torch.Generator().manual_seed(0)
    lengths = [4, 2] if per_row(tier) else [4, 4]
    caches, ref = written(tier, lengths, gen)
    bad = [[5, 2], [2, 3]] if per_row(tier) else [[5, 5], [3, 2]]
    for lengths_asked in bad:
        with pytest.raises(ValueError, match="outside|one length for every row"):
            roll_back(caches, lengths_asked)
        check(caches, ref)


def tiny(seed: int = 0):
    return build_random(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                  vocab_size=32), seed=seed, std=1.0)


def reference_kv(model, tokens: list[int], num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    caches = model.make_caches(KVCacheConfig(tier="tail"))
    with torch.inference_mode():
        model(torch.tensor([tokens]), caches, num_layers=num_layers)
    return [c.fetch() for c in caches[:num_layers]]  # per layer (1, H_kv, n, D)


@pytest.mark.parametrize("tier", ["tail", "ragged", "paged"])
def test_a_model_drafters_caches_hold_exactly_the_tokens_it_fed(tier):
    """Contexts that accept some drafts and reject others, row by row: after every
    proposal the drafter's caches hold the K/V of ``fed`` and nothing else."""
    model, rng = tiny(), random.Random(1)
    B = 1 if tier == "tail" else 3
    drafter = ModelDrafter(model, num_layers=1, cache_config=config(tier))
    contexts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]][:B]
    for _ in range(5):
        ks = [rng.randint(1, 4) for _ in contexts]
        draft = drafter.propose(contexts, ks, params=SamplingParams())
        assert draft.counts == ks and draft.probs is None
        for r, ctx in enumerate(contexts):  # the target keeps a random prefix, then its own token
            a = rng.randint(0, ks[r])
            ctx += draft.tokens[r, :a].tolist() + [rng.randrange(32)]
        for r, fed in enumerate(drafter.fed):
            assert len(fed) == drafter.held[r]
            for (rk, rv), cache in zip(reference_kv(model, fed, 1), drafter.caches):
                k, v = cache.fetch()
                torch.testing.assert_close(k[r: r + 1, :, : len(fed)], rk, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v[r: r + 1, :, : len(fed)], rv, atol=1e-5, rtol=1e-5)
            off = drafter.caches[0].offset
            assert (off.tolist()[r] if isinstance(off, torch.Tensor) else off) == len(fed)


def test_draw_takes_a_one_hot_row_exactly_and_never_a_zero_probability_token():
    gen = torch.Generator().manual_seed(0)
    assert draw(torch.eye(5), gen).tolist() == [0, 1, 2, 3, 4]
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0]]).expand(2000, 4)
    got = draw(probs, gen)
    assert set(got.tolist()) == {0, 2} and 800 < int((got == 0).sum()) < 1200
    empty = Draft.empty(3, "cpu")
    assert empty.tokens.shape == (3, 0) and empty.counts == [0, 0, 0]
