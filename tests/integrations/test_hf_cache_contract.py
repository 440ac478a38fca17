"""transformers' own cache checks, run on DynamicCache and on KVTierCache for every tier.

Ported from transformers' tests/utils/test_cache_utils.py (test_dynamic_cache,
test_dynamic_cache_retrocompatibility, test_reorder_cache_retrocompatibility,
test_cache_copy, test_cache_extra_left_padding, the exportability tests' layer by
layer comparison of ``.keys`` / ``.values``) and from what the installed
cache_utils.py documents for ``DynamicCache`` (iteration, ``len``, ``crop``, row
selection, ``reset``). Each check runs the same calls on a ``DynamicCache`` and on a
``KVTierCache`` and asserts that they agree: the same tensors (within the codec's
rounding for paged q8), the same lengths, the same errors.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvtier.config import KVCacheConfig  # noqa: E402
from kvtier.integrations.hf import ATTENTION_NAME, KVTierCache, cache_kwarg  # noqa: E402

# small steps, blocks and pages, so that a few tokens cross their boundaries
TIERS = {
    "tail": KVCacheConfig(tier="tail", step=4),
    "block": KVCacheConfig(tier="block", owned_block_size=4),
    "ragged": KVCacheConfig(tier="ragged", step=4),
    "paged": KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=64),
    "paged-q8": KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=64, kv_quant="q8"),
}


def kvtier(tier: str, **kw) -> KVTierCache:
    return KVTierCache(TIERS[tier], **kw)


def assert_kv_equal(got: torch.Tensor | None, want: torch.Tensor | None, tier: str) -> None:
    """Exact at full precision; for q8, within half a step of each token and head's scale
    (one fp32 scale per token and head: ``amax / 127``)."""
    if want is None:
        assert got is None
        return
    assert got.shape == want.shape and got.dtype == want.dtype
    if tier == "paged-q8":
        half_step = want.abs().amax(-1, keepdim=True) / 254  # (B, H_kv, T, 1)
        assert bool(((got - want).abs() <= half_step * 1.001 + 1e-7).all())
    else:
        assert torch.equal(got, want)


def assert_caches_agree(ours: KVTierCache, ref: DynamicCache, tier: str) -> None:
    assert len(ours) == len(ref)
    for i, (mine, theirs) in enumerate(zip(ours.layers, ref.layers)):
        assert mine.is_initialized == theirs.is_initialized, i
        assert mine.get_seq_length() == theirs.get_seq_length(), i
        assert ours.get_seq_length(i) == ref.get_seq_length(i)
        assert ours.get_mask_sizes(3, i) == ref.get_mask_sizes(3, i)
        assert_kv_equal(mine.keys, theirs.keys, tier)
        assert_kv_equal(mine.values, theirs.values, tier)


def rand_kv(*shape: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g), torch.rand(shape, generator=g)


# -- test_dynamic_cache: prefilled states, hard-coded expectations -------------------------------
@pytest.mark.parametrize("tier", list(TIERS))
def test_dynamic_cache_scenarios(tier):
    prefill = torch.tensor([1.0, 2.0])[None, None, :, None]  # (1, 1, 2, 1)
    update3, update4 = torch.tensor(3.0)[None, None, None, None], torch.tensor(4.0)[None, None, None, None]
    for cache in (DynamicCache(), kvtier(tier)):
        cache.update(prefill, prefill, 0)
        cache.update(update3, update3, 0)
        assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0]
        cache.update(update4, update4, 0)
        assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
        assert cache.layers[0].values[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]

    prefill1 = torch.tensor([10.0, 20.0])[None, None, :, None]
    update3_1, update4_1 = torch.tensor(30.0)[None, None, None, None], torch.tensor(40.0)[None, None, None, None]
    for cache in (DynamicCache(), kvtier(tier)):  # two layers, updated in turn
        cache.update(prefill, prefill, 0)
        cache.update(prefill1, prefill1, 1)
        for a, b in ((update3, update3_1), (update4, update4_1)):
            cache.update(a, a, 0)
            cache.update(b, b, 1)
        assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
        assert cache.layers[1].keys[0, 0, :, 0].tolist() == [10.0, 20.0, 30.0, 40.0]


# -- test_dynamic_cache_retrocompatibility: the layers as tuples --------------------------------
@pytest.mark.parametrize("tier", list(TIERS))
def test_iteration_and_len_as_dynamic_cache(tier):
    legacy, ref, ours = (), DynamicCache(), kvtier(tier)
    for layer_idx in range(10):
        k, v = rand_kv(2, 4, 8, 16, seed=layer_idx)
        ref.update(k, v, layer_idx)
        ours.update(k, v, layer_idx)
        legacy += ((k, v),)
    assert len(ours) == len(ref) == len(legacy) == 10
    items, ref_items = list(ours), list(ref)
    assert len(items) == len(ref_items) == 10
    for (k, v, window), (rk, rv, rwindow), (lk, lv) in zip(items, ref_items, legacy):
        assert window is None and rwindow is None
        assert_kv_equal(k, rk, tier)
        assert_kv_equal(v, rv, tier)
        assert_kv_equal(k, lk, tier)
        assert_kv_equal(v, lv, tier)
    assert ours.get_seq_length() == ref.get_seq_length() == 8
    # DynamicCache's constructor rebuilds a cache from what iteration yields (its DDP path)
    assert_caches_agree(ours, DynamicCache(ddp_cache_data=ours), "tail")
    # indexing and unpacking pairs behave as they do on DynamicCache in the installed version
    for probe in (lambda c: c[0][0], lambda c: [k for k, v in c]):
        outcomes = []
        for cache in (ref, ours):
            try:
                outcomes.append(("value", probe(cache)))
            except (TypeError, ValueError, KeyError, IndexError) as e:
                outcomes.append(("error", type(e)))
        assert outcomes[0][0] == outcomes[1][0]
        if outcomes[0][0] == "error":
            assert outcomes[0][1] is outcomes[1][1]


@pytest.mark.parametrize("tier", list(TIERS))
def test_reorder_cache_as_legacy_reorder(tier):
    legacy, ref, ours = (), DynamicCache(), kvtier(tier)
    for layer_idx in range(10):
        k, v = rand_kv(4, 4, 8, 16, seed=layer_idx)
        ref.update(k, v, layer_idx)
        ours.update(k, v, layer_idx)
        legacy += ((k, v),)
    beam_idx = torch.tensor([3, 0, 0, 2])  # repeats and a dropped beam, as beam search makes them
    # the legacy ``_reorder_cache`` of ClvpForCausalLM and the other pre-Cache models
    reordered = tuple(tuple(t.index_select(0, beam_idx) for t in kv) for kv in legacy)
    ref.reorder_cache(beam_idx)
    ours.reorder_cache(beam_idx)
    for layer_idx in range(10):
        assert_kv_equal(ours.layers[layer_idx].keys, reordered[layer_idx][0], tier)
        assert_kv_equal(ours.layers[layer_idx].values, reordered[layer_idx][1], tier)
    assert_caches_agree(ours, ref, tier)


# -- crop: DynamicLayer.crop's behaviour in the installed version ---------------------------------
CROPS = [-3, -8, -9, -100, 0, 3, 8, 100, True, False, torch.tensor(-2)]


def crop_outcome(cache, n):
    try:
        cache.crop(n)
    except ValueError as e:
        return ("ValueError", "negative integer" in str(e))
    return ("ok",)


@pytest.mark.parametrize("n", CROPS, ids=repr)
@pytest.mark.parametrize("tier", list(TIERS))
def test_crop_as_dynamic_cache(tier, n):
    ref, ours = DynamicCache(), kvtier(tier)
    for cache in (ref, ours):
        for step in (5, 3):  # 8 tokens in two writes
            for layer_idx in range(2):
                cache.update(*rand_kv(2, 2, step, 8, seed=10 * step + layer_idx), layer_idx)
    outcome = crop_outcome(ref, n)
    assert crop_outcome(ours, n) == outcome
    assert_caches_agree(ours, ref, tier)  # what was cropped, or unchanged after an error
    for layer_idx in range(2):  # and the next write lands at the same place
        kv = rand_kv(2, 2, 2, 8, seed=99 + layer_idx)
        ref.update(*kv, layer_idx)
        ours.update(*kv, layer_idx)
    assert_caches_agree(ours, ref, tier)


@pytest.mark.parametrize("tier", ["tail", "paged"])
def test_crop_of_a_non_integer_is_refused_and_changes_nothing(tier):
    ours = kvtier(tier)
    ours.update(*rand_kv(1, 2, 5, 8, seed=0), 0)
    before = ours.layers[0].keys.clone()
    for bad in (1.5, -1.5, "2", None, torch.tensor(-1.0)):
        with pytest.raises(ValueError, match="integer"):
            ours.crop(bad)
        ref = DynamicCache()
        ref.update(*rand_kv(1, 2, 5, 8, seed=0), 0)
        with pytest.raises((ValueError, TypeError)):  # DynamicCache refuses them too
            ref.crop(bad)
    assert ours.get_seq_length() == 5 and torch.equal(ours.layers[0].keys, before)


@pytest.mark.parametrize("n", [-2, 0, 3], ids=repr)
def test_crop_before_any_update_as_dynamic_cache(n):
    # no layer yet: nothing to crop, no check, as DynamicCache(); layers built from a model
    # config but not written: DynamicLayer's positive check still runs
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    for kwargs, ref in (({}, DynamicCache()), ({"model_config": config}, DynamicCache(config=config))):
        ours = kvtier("paged", **kwargs)
        assert crop_outcome(ours, n) == crop_outcome(ref, n)
        assert len(ours) == len(ref) and ours.get_seq_length() == ref.get_seq_length() == 0


# -- rows: batch_repeat_interleave, batch_select_indices -------------------------------------------
@pytest.mark.parametrize("tier", list(TIERS))
def test_row_selection_as_dynamic_cache(tier):
    ref, ours = DynamicCache(), kvtier(tier)
    for cache in (ref, ours):
        for layer_idx in range(2):
            cache.update(*rand_kv(3, 2, 6, 8, seed=layer_idx), layer_idx)
    for op, arg in (("batch_repeat_interleave", 2), ("batch_select_indices", torch.tensor([5, 0, 2, 1]))):
        getattr(ref, op)(arg)
        getattr(ours, op)(arg)
        assert_caches_agree(ours, ref, tier)
    for layer_idx in range(2):
        kv = rand_kv(4, 2, 1, 8, seed=7 + layer_idx)
        ref.update(*kv, layer_idx)
        ours.update(*kv, layer_idx)
    assert_caches_agree(ours, ref, tier)


@pytest.mark.parametrize("call", ["batch_select_indices", "reorder_cache", "batch_repeat_interleave"])
@pytest.mark.parametrize("tier", list(TIERS))
def test_keeping_no_row_is_refused_in_a_transformers_users_terms_and_changes_nothing(tier, call):
    """DynamicCache keeps a batch of 0 rows; a tier holds at least one, so the cache refuses, naming
    the call and cache.reset() (not the tiers' own filter()/release()), before any layer changes."""
    ours = kvtier(tier)
    for layer_idx in range(2):
        ours.update(*rand_kv(2, 2, 3, 8, seed=layer_idx), layer_idx)
    before = [layer.keys.clone() for layer in ours.layers]
    arg = 0 if call == "batch_repeat_interleave" else torch.tensor([], dtype=torch.long)
    with pytest.raises(ValueError, match=rf"^{call}\(.*\) keeps none of the cache's 2 rows; .*cache\.reset\(\)") as e:
        getattr(ours, call)(arg)
    assert "filter()" not in str(e.value) and "release()" not in str(e.value)
    assert ours.batch_size == 2
    assert all(torch.equal(layer.keys, k) for layer, k in zip(ours.layers, before))


# -- reset, flags, deep copies ---------------------------------------------------------------------
@pytest.mark.parametrize("tier", list(TIERS))
def test_reset_and_flags_as_dynamic_cache(tier):
    ref, ours = DynamicCache(), kvtier(tier)
    assert ours.is_initialized == ref.is_initialized
    assert ours.is_croppable == ref.is_croppable and ours.is_compileable == ref.is_compileable
    for cache in (ref, ours):
        cache.update(*rand_kv(1, 2, 4, 8, seed=1), 0)
    assert ours.is_initialized == ref.is_initialized
    assert ours.is_croppable == ref.is_croppable and ours.is_compileable == ref.is_compileable
    config = TIERS[tier]  # a fixed paged pool has a maximum, the positions its one row reaches
    fixed = config.paged_num_blocks * config.paged_block_size if config.tier == "paged" else -1
    assert ours.get_max_length() == fixed and ref.get_max_length() == -1
    ref.reset()
    ours.reset()
    assert ours.layers[0].keys is None and ref.layers[0].keys is None
    assert_caches_agree(ours, ref, tier)
    for cache in (ref, ours):  # reusable after reset
        cache.update(*rand_kv(1, 2, 3, 8, seed=2), 0)
    assert_caches_agree(ours, ref, tier)


@pytest.mark.parametrize("tier", list(TIERS))
def test_reset_forgets_the_batch_size_as_dynamic_cache(tier):
    """After reset() the next update may bring another batch size, layer 0 first."""
    ref, ours = DynamicCache(), kvtier(tier)
    for cache in (ref, ours):
        for layer_idx in range(2):
            cache.update(*rand_kv(2, 2, 3, 8, seed=layer_idx), layer_idx)
        cache.reset()
        assert cache.batch_size == -1
        cache.update(*rand_kv(3, 2, 3, 8, seed=5), 0)
        assert cache.batch_size == (-1 if cache is ref else 3)  # not "... not consistent across layers"
        cache.update(*rand_kv(3, 2, 3, 8, seed=6), 1)
    assert ours.batch_size == 3
    assert_caches_agree(ours, ref, tier)


@pytest.mark.parametrize("tier", list(TIERS))
def test_an_update_of_no_tokens_returns_the_layer_as_dynamic_cache(tier):
    ref, ours = DynamicCache(), kvtier(tier)
    empty = rand_kv(2, 2, 0, 8, seed=0)
    for cache in (ref, ours):
        first = cache.update(*empty, 0)  # before any token, as the first update
        assert [tuple(t.shape) for t in first] == [(2, 2, 0, 8)] * 2
        cache.update(*rand_kv(2, 2, 3, 8, seed=1), 0)
    got, want = ours.update(*empty, 0), ref.update(*empty, 0)
    for g, w in zip(got, want):
        assert_kv_equal(g, w, tier)
    assert_caches_agree(ours, ref, tier)


@pytest.mark.parametrize("shape", [(2, 5, 8), (2, 2, 3, 5, 8)])
def test_keys_that_are_not_4d_are_refused_by_name_and_change_nothing(shape):
    ours = kvtier("paged")
    with pytest.raises(ValueError, match=r"^keys must be 4-D \[batch, kv_heads, tokens, head_dim\]"):
        ours.update(torch.rand(shape), torch.rand(shape), 0)
    assert not ours.layers[0].is_initialized and ours.layers[0].tier is None
    ours.update(*rand_kv(2, 2, 3, 8, seed=0), 0)  # and takes 4-D keys after it
    assert ours.get_seq_length() == 3


def test_a_fixed_paged_pool_reports_the_positions_each_row_reaches():
    """2 blocks of 4 tokens: 8 positions for one row, 4 each for two; a pool that grows, and the
    other tiers, have no maximum (-1)."""
    pool = KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=2)
    config = transformers.LlamaConfig(num_hidden_layers=2)
    assert KVTierCache(pool, model_config=config).get_max_length() == 8  # no update yet: one row's
    assert KVTierCache(pool).get_max_length() == -1  # no layer yet, as DynamicCache()
    one = KVTierCache(pool)
    one.update(*rand_kv(1, 2, 8, 4, seed=0), 0)
    assert one.get_max_length() == one.get_max_cache_shape() == 8 == one.get_seq_length()
    with pytest.raises(MemoryError):
        one.update(*rand_kv(1, 2, 1, 4, seed=1), 0)  # the 9th token
    two = KVTierCache(pool)
    two.update(*rand_kv(2, 2, 4, 4, seed=0), 0)
    assert two.get_max_length() == 4
    with pytest.raises(MemoryError):
        two.update(*rand_kv(2, 2, 1, 4, seed=1), 0)
    grows = KVTierCache(pool.replace(dynamic_paged=True))
    grows.update(*rand_kv(1, 2, 8, 4, seed=0), 0)
    assert grows.get_max_length() == -1
    grows.update(*rand_kv(1, 2, 1, 4, seed=1), 0)
    for tier in ("tail", "block", "ragged"):
        assert kvtier(tier).get_max_length() == -1


@pytest.mark.parametrize("tier", list(TIERS))
def test_deepcopy_is_an_independent_cache(tier):
    ref, ours = DynamicCache(), kvtier(tier)
    for cache in (ref, ours):
        cache.update(*rand_kv(2, 2, 5, 8, seed=3), 0)
    ref_copy, ours_copy = copy.deepcopy(ref), copy.deepcopy(ours)
    for cache in (ref_copy, ours_copy):
        cache.update(*rand_kv(2, 2, 2, 8, seed=4), 0)
        cache.crop(-1)
    assert_caches_agree(ours_copy, ref_copy, tier)
    assert_caches_agree(ours, ref, tier)  # the originals are untouched
    assert ours.get_seq_length() == 5 and ours_copy.get_seq_length() == 6


# -- keys and values are read from the tier -------------------------------------------------------
def test_keys_are_views_where_the_tier_has_a_buffer_and_copies_where_it_gathers():
    kv = rand_kv(2, 2, 6, 8, seed=5)
    for tier, view in (("tail", True), ("ragged", True), ("block", False), ("paged", False)):
        cache = kvtier(tier)
        cache.update(*kv, 0)
        keys = cache.layers[0].keys
        storage = cache.layers[0].tier.fetch()[0]
        assert (keys.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()) == view, tier
        # on the block tier, 6 tokens span two blocks of 4: the keys are a concatenation
        assert torch.equal(keys, kv[0])


def test_assigning_keys_or_values_is_refused_and_changes_nothing():
    cache = kvtier("tail")
    cache.update(*rand_kv(1, 2, 3, 8, seed=6), 0)
    layer, before = cache.layers[0], cache.layers[0].keys.clone()
    for name in ("keys", "values"):
        with pytest.raises(ValueError, match=r"cache\.update"):
            setattr(layer, name, torch.zeros(1, 2, 3, 8))
        with pytest.raises(ValueError, match="cannot be assigned"):
            setattr(layer, name, None)
    assert torch.equal(layer.keys, before) and layer.get_seq_length() == 3


@pytest.mark.parametrize("tier", list(TIERS))
def test_keys_of_a_layer_cropped_to_nothing_are_empty_and_shaped(tier):
    ref, ours = DynamicCache(), kvtier(tier)
    for cache in (ref, ours):
        cache.update(*rand_kv(2, 3, 2, 8, seed=0), 0)
        cache.crop(-2)
    assert ours.layers[0].keys.shape == ref.layers[0].keys.shape == (2, 3, 0, 8)
    assert_caches_agree(ours, ref, tier)


# -- with a model: generate's caches, layer by layer ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                      max_position_embeddings=256, initializer_range=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield transformers.LlamaForCausalLM(config).eval()
    torch.set_num_threads(threads)


def padded(rows: list[list[int]], width: int) -> dict:
    """Left-padded ``input_ids`` and ``attention_mask`` ``[B, width]``."""
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    return {"input_ids": ids, "attention_mask": mask}


ROWS = [[5, 17, 33, 9, 100, 42, 7], [81, 3, 64], [11, 12]]


def run(model, inputs, cache, in_place=False, **kw):
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME if in_place else "sdpa")
    try:
        return model.generate(**inputs, **{cache_kwarg(model): cache}, do_sample=False,
                              pad_token_id=0, **kw)
    finally:
        model.set_attn_implementation(before)


@pytest.mark.parametrize("tier", list(TIERS))
def test_generate_leaves_the_keys_and_values_of_dynamic_cache(tiny, tier):
    """Gathered path: every layer's keys and values after a padded batch's generate are
    DynamicCache's (the exportability tests' layer by layer check)."""
    inputs = padded(ROWS, 7)
    ref, ours = DynamicCache(), kvtier(tier, model_config=tiny.config)
    out_ref = run(tiny, inputs, ref, max_new_tokens=6)
    out = run(tiny, inputs, ours, max_new_tokens=6)
    if tier != "paged-q8":
        assert out.tolist() == out_ref.tolist()
        assert_caches_agree(ours, ref, tier)
    else:  # generate fed q8's own tokens back: compare the caches over the prompt only
        assert ours.get_seq_length() == ref.get_seq_length()
        for i, ((k, v, _), (rk, rv, _)) in enumerate(zip(ours, ref)):
            assert_model_kv(k[:, :, :7], rk[:, :, :7], i)
            assert_model_kv(v[:, :, :7], rv[:, :, :7], i)


def assert_model_kv(got: torch.Tensor, want: torch.Tensor, layer_idx: int) -> None:
    """q8 inside a model: layer 0's K/V come from the embeddings alone, so they are within
    the codec's rounding; later layers' inputs went through q8 attention before them."""
    if layer_idx == 0:
        assert_kv_equal(got, want, "paged-q8")
    else:
        torch.testing.assert_close(got, want, atol=0.05 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("tier", ["ragged", "paged", "paged-q8"])
def test_in_place_rows_hold_dynamic_cache_real_tokens_then_zeros(tiny, tier):
    """In place, the row tiers store only each row's real tokens: row ``r`` of ``.keys`` is
    DynamicCache's keys at the positions its attention mask marks real, then zeros."""
    inputs = padded(ROWS, 7)
    ref, ours = DynamicCache(), kvtier(tier, model_config=tiny.config)
    out_ref = run(tiny, inputs, ref, max_new_tokens=4)
    out = run(tiny, inputs, ours, in_place=True, max_new_tokens=4)
    if tier != "paged-q8":
        assert out.tolist() == out_ref.tolist()
    real = torch.cat([inputs["attention_mask"], torch.ones(3, 3, dtype=torch.long)], 1).bool()  # (B, 10)
    lengths = real.sum(1).tolist()
    for i, (layer, theirs) in enumerate(zip(ours.layers, ref.layers)):
        assert layer.tier.lengths == lengths
        for mine, want in ((layer.keys, theirs.keys), (layer.values, theirs.values)):
            assert mine.shape == (3, 2, max(lengths), 16)
            for r, n in enumerate(lengths):
                row = want[r][:, real[r]]  # (H_kv, n, D)
                if tier == "paged-q8":  # generate fed q8's own tokens: compare the prompt's
                    p = len(ROWS[r])
                    assert_model_kv(mine[r:r + 1, :, :p], row[None, :, :p], i)
                elif i == 0:  # from the embeddings alone: the same bits
                    assert_kv_equal(mine[r:r + 1, :, :n], row[None], tier)
                else:  # after attention over the row's own tokens instead of a masked padded batch:
                    # the same values up to float32 summation order, which the CPU's kernels choose
                    torch.testing.assert_close(mine[r:r + 1, :, :n], row[None], rtol=1e-5, atol=1e-5)
                assert not mine[r, :, n:].any()


@pytest.mark.parametrize("tier", ["tail", "block", "ragged", "paged"])
@pytest.mark.parametrize("in_place", [False, True], ids=["gathered", "in-place"])
def test_a_deep_copied_prompt_cache_serves_two_prompts_as_dynamic_cache(tiny, tier, in_place):
    """test_cache_copy: prefill a shared prefix once, deep-copy the cache for each prompt."""
    prefix = [[5, 17, 33, 9, 100]]
    prompts = [prefix[0] + [42, 7, 8], prefix[0] + [61, 2]]
    outs = []
    for make in (DynamicCache, lambda: kvtier(tier, model_config=tiny.config)):
        prompt_cache = make()
        name = ATTENTION_NAME if in_place and not isinstance(prompt_cache, DynamicCache) else "sdpa"
        before = tiny.config._attn_implementation
        tiny.set_attn_implementation(name)
        try:
            with torch.no_grad():
                tiny(**padded(prefix, 5), **{cache_kwarg(tiny): prompt_cache})
        finally:
            tiny.set_attn_implementation(before)
        got = []
        for p in prompts:
            cache = copy.deepcopy(prompt_cache)
            out = run(tiny, padded([p], len(p)), cache, in_place=name == ATTENTION_NAME, max_new_tokens=6)
            got.append(out.tolist())
        assert prompt_cache.get_seq_length() == 5  # the copies left it as it was
        outs.append(got)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("tier", list(TIERS))
def test_extra_left_padding_changes_nothing(tiny, tier):
    """test_cache_extra_left_padding: padding the prompt further gives the same tokens."""
    rows = [[5, 17, 33, 9]]
    ref = run(tiny, padded(rows, 4), DynamicCache(), max_new_tokens=8)[:, 4:]
    for width in (4, 12):
        for in_place in (False, True):
            out = run(tiny, padded(rows, width), kvtier(tier, model_config=tiny.config), in_place=in_place,
                      max_new_tokens=8)
            if tier == "paged-q8":
                assert out[0, width:width + 4].tolist() == ref[0, :4].tolist()
            else:
                assert out[:, width:].tolist() == ref.tolist(), (width, in_place)
