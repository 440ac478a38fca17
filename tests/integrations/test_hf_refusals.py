"""KVTierCache under autograd, and the refusals that must leave the cache as it was.

Gradients through the gathered read path equal ``DynamicCache``'s; the in-place path
(``kvtier_paged``, for inference) refuses keys that require grad. A refusal (of a
crop, of the attention function, of a full paged pool) changes no layer, kvtier's or
transformers' own, and names what a ``KVTierCache`` user sets.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import attention  # noqa: E402
from test_hf_cache_contract import TIERS as CONTRACT_TIERS  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvtier.caches.paged import PagedKVGrowthRefused  # noqa: E402
from kvtier.caches.paged_pool import BlockPool  # noqa: E402
from kvtier.config import KVCacheConfig  # noqa: E402
from kvtier.integrations.hf import ATTENTION_NAME, KVTierCache, KVTierLayer, cache_kwarg  # noqa: E402
from kvtier.integrations.hf_attention import kvtier_attention_forward  # noqa: E402

TIERS = {name: CONTRACT_TIERS[name] for name in ("tail", "block", "ragged", "paged")}
FIXED_POOL = KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=2)  # 8 tokens


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def llama(**extra):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                      max_position_embeddings=256, **extra)
    return transformers.LlamaForCausalLM(config).eval()


def gemma2():
    """Two layers: a sliding layer (transformers' own) first, then a full one (kvtier's)."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_hidden_layers=2, max_position_embeddings=256,
                                       sliding_window=64, pad_token_id=0)
    return transformers.Gemma2ForCausalLM(config).eval()


def forward(model, cache, ids: torch.Tensor, **kw):
    return model(input_ids=ids, **{cache_kwarg(model): cache}, **kw)


def lengths(cache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


IDS = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(1))


# -- gradients -------------------------------------------------------------------------------------
def gradients(model, cache, prefix: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of ``logits.sum()`` over ``IDS[:, prefix:]``, the first
    ``prefix`` tokens written before under ``torch.no_grad()``."""
    model.zero_grad()
    if prefix:
        with torch.no_grad():
            forward(model, cache, IDS[:, :prefix])
    forward(model, cache, IDS[:, prefix:]).logits.sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prefix", [0, 6], ids=["one-forward", "after-a-no-grad-prefix"])
@pytest.mark.parametrize("tier", list(TIERS))
def test_gradients_through_the_gathered_path_equal_dynamic_cache(tier, prefix):
    model = llama()
    want = gradients(model, DynamicCache(config=model.config), prefix)
    got = gradients(model, KVTierCache(TIERS[tier], model_config=model.config), prefix)
    assert sorted(got) == sorted(want)  # k_proj and v_proj included
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_quantised_tier_reads_its_stored_values_with_gradients_on():
    """With autograd on, the forward reads what the tier stores (q8 pages), as without it;
    the gradient reaches the projections that made the keys and values."""
    model = llama()
    q8 = KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=64, kv_quant="q8")
    with torch.no_grad():
        want = forward(model, KVTierCache(q8, model_config=model.config), IDS).logits
    model.zero_grad()
    got = forward(model, KVTierCache(q8, model_config=model.config), IDS).logits
    got.sum().backward()
    assert torch.equal(got.detach(), want)
    assert model.model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("tier", ["tail", "paged"])
def test_in_place_refuses_keys_that_require_grad_and_changes_nothing(tier):
    model = llama()
    cache = KVTierCache(TIERS[tier], model_config=model.config)
    with attention(model, ATTENTION_NAME):
        with pytest.raises(ValueError, match=r"require grad .* torch\.no_grad\(\)"):
            forward(model, cache, IDS)
        assert lengths(cache) == [0, 0] and not any(layer.is_initialized for layer in cache.layers)
        with torch.no_grad():
            got = forward(model, cache, IDS).logits
    with torch.no_grad():
        want = forward(model, DynamicCache(config=model.config), IDS).logits
    torch.testing.assert_close(got, want)


def test_in_place_refusal_of_gradients_comes_before_a_sliding_layer_is_written():
    model = gemma2()
    cache = KVTierCache(TIERS["paged"], model_config=model.config)
    with attention(model, ATTENTION_NAME), pytest.raises(ValueError, match="require grad"):
        forward(model, cache, IDS)
    assert lengths(cache) == [0, 0]


# -- crop ------------------------------------------------------------------------------------------
def test_a_refused_crop_changes_no_layer_of_a_hybrid_model():
    """In place, right padding: the kvtier layer refuses crop(-3); the sliding layer, which
    comes first, must not have been cropped before it."""
    model = gemma2()
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, -2:], mask[1, -2:] = 0, 0  # row 1 ends in 2 padding tokens
    cache = KVTierCache(TIERS["paged"], model_config=model.config)
    with attention(model, ATTENTION_NAME), torch.no_grad():
        forward(model, cache, ids, attention_mask=mask)
    before = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(ValueError, match="crop at most 0 here"):
        cache.crop(-3)
    assert lengths(cache) == [8, 8]
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, before))


# -- the attention function's refusals ---------------------------------------------------------------
def in_place_layer(tier: str) -> KVTierLayer:
    """A layer that reads in place, holding 3 tokens."""
    layer = KVTierLayer(TIERS[tier], lambda: True)
    layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    layer.attend(torch.randn(1, 4, 3, 8), None)
    return layer


class Module(torch.nn.Module):
    pass


REFUSALS = {
    "dropout": (dict(dropout=0.1), "dropout=0.1 in training mode"),
    "s_aux": (dict(s_aux=torch.zeros(4)), "attention sinks"),
    "float mask": (dict(attention_mask=torch.zeros(1, 1, 1, 4)), "boolean masks"),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
@pytest.mark.parametrize("tier", ["tail", "block", "ragged", "paged"])
def test_a_refused_attention_takes_its_update_back(tier, refusal):
    layer = in_place_layer(tier)
    keys_before = layer.keys.clone()
    kwargs, message = REFUSALS[refusal]
    kwargs = {"attention_mask": None, **kwargs}
    module = Module().train()
    k, v = layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    with pytest.raises(ValueError, match=message):
        kvtier_attention_forward(module, torch.randn(1, 4, 1, 8), k, v, **kwargs)
    assert layer.get_seq_length() == 3 and layer.tier.size() == 3
    assert torch.equal(layer.keys, keys_before)
    k, v = layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))  # usable again
    kvtier_attention_forward(module.eval(), torch.randn(1, 4, 1, 8), k, v, None)
    assert layer.get_seq_length() == 4 and layer.tier.size() == 4


def test_dropout_in_training_mode_leaves_the_cache_usable():
    model = llama(attention_dropout=0.1)
    cache = KVTierCache(TIERS["paged"], model_config=model.config)
    with attention(model, ATTENTION_NAME), torch.no_grad():
        model.train()
        try:
            with pytest.raises(ValueError, match="training mode"):
                forward(model, cache, IDS)
        finally:
            model.eval()
        assert lengths(cache) == [0, 0] and cache.layers[0].tier.size() == 0
        got = forward(model, cache, IDS).logits
        assert lengths(cache) == [9, 9]
        want = forward(model, DynamicCache(config=model.config), IDS).logits
    torch.testing.assert_close(got, want)


# -- a full paged pool -------------------------------------------------------------------------------
def assert_in_kvtier_cache_terms(error: pytest.ExceptionInfo) -> None:
    text = str(error.value)
    assert "KVCacheConfig(paged_num_blocks=...)" in text
    assert "num_blocks=" not in text.replace("paged_num_blocks=", "")  # no PagedKVCache keyword
    assert "dynamic=True" not in text.replace("dynamic_paged=True", "")
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_a_full_pool_is_worded_for_a_kvtier_cache_user():
    cache = KVTierCache(FIXED_POOL)
    cache.update(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), 0)
    with pytest.raises(PagedKVGrowthRefused) as e:
        cache.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), 0)
    assert_in_kvtier_cache_terms(e)
    assert "its 2 blocks of 4 tokens" in str(e.value) and "dynamic_paged=True" in str(e.value)
    assert cache.get_seq_length() == 8 and cache.layers[0].tier.size() == 8


@pytest.mark.parametrize("in_place", [False, True], ids=["gathered", "in_place"])
def test_generate_past_a_full_pool_is_worded_for_a_kvtier_cache_user(in_place):
    model = llama()
    cache = KVTierCache(FIXED_POOL, model_config=model.config)
    with attention(model, ATTENTION_NAME if in_place else "sdpa"), pytest.raises(PagedKVGrowthRefused) as e:
        model.generate(input_ids=IDS[:, :5], **{cache_kwarg(model): cache}, max_new_tokens=8,
                       do_sample=False, pad_token_id=0)
    assert_in_kvtier_cache_terms(e)
    assert lengths(cache) == [8, 8]


def test_repeating_rows_past_a_full_pool_is_worded_for_a_kvtier_cache_user():
    cache = KVTierCache(FIXED_POOL)
    cache.update(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), 0)
    with pytest.raises(PagedKVGrowthRefused) as e:
        cache.batch_repeat_interleave(2)  # two rows of 5 tokens: 4 blocks
    assert_in_kvtier_cache_terms(e)
    assert cache.batch_size == 1 and cache.get_seq_length() == 5


def test_a_failed_pool_allocation_is_worded_for_a_kvtier_cache_user(monkeypatch):
    def no_memory(*args, **kwargs):
        raise RuntimeError("out of memory (test)")

    monkeypatch.setattr(BlockPool, "resize", no_memory)
    cache = KVTierCache(FIXED_POOL)
    with pytest.raises(PagedKVGrowthRefused) as e:
        cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 0)
    assert_in_kvtier_cache_terms(e)
    assert "allocating the paged pool" in str(e.value) and "out of memory (test)" in str(e.value)
    assert cache.get_seq_length() == 0
