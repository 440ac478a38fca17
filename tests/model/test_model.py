"""The Llama-family model against Hugging Face transformers on the same weights."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from kvtier import TailOwnedKVCache
from kvtier.model import ModelArgs, Transformer, build_random, load_model
from kvtier.model.architectures import ARCHITECTURES, get_args

transformers = pytest.importorskip("transformers")

PROMPT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Although initially criticised by some of France's leading artists and "
    "intellectuals for its design, it has since become a global cultural icon of France and one "
    "of the most recognisable structures in the world. Locally nicknamed"
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # one conversion cache for the whole session (test_loading checks conversion itself)
    path = tmp_path_factory.getbasetemp() / "kvtier-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTIER_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def smollm(cache_dir):
    return load_model(device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def hf_smollm(smollm):
    from transformers import AutoModelForCausalLM

    src = smollm.source
    return AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    ).eval()


def greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decode through the tail cache: one prefill, then one token per forward."""
    caches = [TailOwnedKVCache(step=16) for _ in range(model.args.n_layers)]
    logits = model(torch.tensor([prompt]), caches, last_only=True)
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[out[-1]]]), caches)
    return out


def greedy_matches_transformers(model: Transformer, hf, prompt: list[int], n: int) -> bool:
    """Our greedy tokens equal ``generate``'s (which stops early at its EOS token)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    theirs = out[0, len(prompt):].tolist()
    eos = hf.generation_config.eos_token_id
    assert len(theirs) == n or theirs[-1] in (eos if isinstance(eos, list) else [eos])
    return greedy(model, prompt, len(theirs)) == theirs


# -- the default model ---------------------------------------------------------------------------
@pytest.mark.slow
@torch.no_grad()
def test_smollm_logits_and_greedy_match_transformers(smollm, hf_smollm):
    prompt = smollm.tokenizer.encode(PROMPT)[-64:]  # ends mid-sentence: a clear next token
    assert len(prompt) == 64
    ours = smollm.model(torch.tensor([prompt]), smollm.model.make_caches())
    ref = hf_smollm(torch.tensor([prompt])).logits
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (1, 64, 49152)
    assert (ours - ref).abs().max().item() <= 1e-3
    assert greedy_matches_transformers(smollm.model, hf_smollm, prompt, 32)


@pytest.mark.slow
def test_smollm_second_load_comes_from_the_conversion_cache(smollm):
    again = load_model(device="cpu", dtype=torch.float32, progress=False)
    assert again.from_cache and again.args == smollm.args
    for (name, a), (_, b) in zip(smollm.model.state_dict().items(),
                                 again.model.state_dict().items()):
        assert torch.equal(a, b), name


# -- tiny random models built in both libraries ----------------------------------------------------
def hf_tiny(kind: str):
    """A tiny transformers model of ``kind`` with seeded random weights."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  max_position_embeddings=512, rms_norm_eps=1e-6)
    cfg, cls = {
        "llama": (LlamaConfig(**common, tie_word_embeddings=True), LlamaForCausalLM),
        "llama3": (LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), LlamaForCausalLM),
        "mistral": (MistralConfig(**{**common, "num_key_value_heads": 1}, sliding_window=None),
                    MistralForCausalLM),
        "qwen2": (Qwen2Config(**common), Qwen2ForCausalLM),
        "qwen3": (Qwen3Config(**common, head_dim=32), Qwen3ForCausalLM),
        # fused Q/K/V and gate/up tensors; a window of 64 keys in every layer (Phi-3-mini's 2,047)
        "phi3": (Phi3Config(**common, sliding_window=64, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                 Phi3ForCausalLM),
        # LongRoPE (Phi-3.5, Phi-3-128k; "su" in older configs): factor lists, an original context of 64
        "phi3-longrope": (Phi3Config(**{**common, "max_position_embeddings": 256}, original_max_position_embeddings=64,
                                     rope_scaling={"type": "su", "short_factor": [1 + i / 10 for i in range(8)],
                                                   "long_factor": [2 + i / 2 for i in range(8)]},
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2), Phi3ForCausalLM),
    }[kind]
    torch.manual_seed(1234)
    model = cls(cfg).eval()
    with torch.no_grad():  # make norms and biases non-trivial so a missing one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def tiny_pairs(tmp_path_factory):
    """``get(kind) -> (hf_model, LoadedModel)``: saved by transformers, loaded by us; built once."""
    from hf_pairs import loaded_pairs

    return loaded_pairs(tmp_path_factory, hf_tiny, "hf")


@pytest.mark.parametrize("kind", ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3"])
@torch.no_grad()
def test_tiny_models_match_transformers(tiny_pairs, kind):
    hf, ours = tiny_pairs(kind)
    args = ours.args
    assert args.qkv_bias == (kind == "qwen2") and args.qk_norm == (kind == "qwen3")
    assert args.tie_embeddings == (kind == "llama")
    assert args.sliding_window == (64 if kind == "phi3" else None)  # (its 150-token prompt passes the window)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (2, 150), generator=g)  # past llama3's original 64 positions
    ref = hf(prompt).logits
    got = ours.model(prompt, ours.model.make_caches())
    assert (got - ref).abs().max().item() <= 1e-4
    for row in prompt[:, :40].tolist():
        assert greedy_matches_transformers(ours.model, hf, row, 16)


@torch.no_grad()
def test_llama3_rope_scaling_matches_transformers(tiny_pairs):
    hf, ours = tiny_pairs("llama3")
    assert ours.args.rope_scaling["rope_type"] == "llama3"
    plain = ModelArgs.from_dict({**ours.args.to_dict(), "rope_scaling": None})
    from kvtier.model.llama import rope_inv_freq

    scaled, base = rope_inv_freq(ours.args), rope_inv_freq(plain)
    assert torch.equal(scaled, hf.model.rotary_emb.inv_freq)
    assert not torch.allclose(scaled, base)  # the test above would catch a dropped scaling
    assert torch.equal(scaled[0], base[0])  # the highest frequency is kept


@pytest.mark.parametrize("tier", ["tail", "ragged", "paged"])
@torch.no_grad()
def test_longrope_runs_within_its_original_context_as_transformers(tiny_pairs, tier):
    """LongRoPE (Phi-3.5, Phi-3-128k) divides the frequencies by its short factors and scales cos
    and sin by sqrt(1 + ln 4 / ln 64) (a context of 256 over an original one of 64). Past the
    original context transformers turns every position with the long factors and computes the
    cached keys again, which is not done here: the loader fits the context to 64 tokens, with a
    warning, and within it the logits and greedy tokens are transformers'."""
    from kvtier.config import KVCacheConfig
    from kvtier.generate import generate_step

    with warnings.catch_warnings():  # (the fitted context's warning: test_longrope_s_context_is_fitted_with_a_warning)
        warnings.simplefilter("ignore")
        hf, ours = tiny_pairs("phi3-longrope")
    rs = ours.args.rope_scaling
    assert (rs["rope_type"], rs["factor"], ours.args.max_position_embeddings) == ("longrope", 4.0, 64)
    assert ours.model.rope.scale == pytest.approx((1 + math.log(4) / math.log(64)) ** 0.5)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(ours.model.rope.scale)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (1, 64), generator=g)
    assert (ours.model(ids, ours.model.make_caches()) - hf(ids).logits).abs().max().item() <= 1e-4
    hf.generation_config.eos_token_id = None
    prompt = ids[:, :40]
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=25, do_sample=False)
    caches = ours.model.make_caches(KVCacheConfig(tier=tier, paged_block_size=4, paged_num_blocks=64))
    steps = generate_step(ours.model, [prompt[0].tolist()], caches)
    got = [int(next(steps)[0]) for _ in range(25)]  # (positions up to 63: the whole context)
    steps.close()
    assert got == want[0, 40:].tolist()


def test_longrope_s_context_is_fitted_with_a_warning(tmp_path):
    hf_tiny("phi3-longrope").save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="LongRoPE past the original 64 positions .* the context is 64 tokens, not "
                                         "the config's max_position_embeddings 256"):
        args = load_model(tmp_path, device="cpu", progress=False).args
    with pytest.raises(ValueError, match=r"a context of 65 positions \(max_position_embeddings\) passes "
                                         r"original_max_position_embeddings 64, .* pass max_position_embeddings <= 64"):
        ModelArgs.from_dict({**args.to_dict(), "max_position_embeddings": 65})


# -- forward contract --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return build_random("tiny-qwen3", seed=3)


@torch.no_grad()
def test_chunked_prefill_and_decode_equal_one_full_forward(tiny):
    tokens = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(1))
    full = tiny(tokens, tiny.make_caches())
    caches = tiny.make_caches()
    parts = [tiny(tokens[:, s:e], caches) for s, e in ((0, 10), (10, 20), (20, 21), (21, 23))]
    assert caches[0].offset == 23 and all(c.offset == 23 for c in caches)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rope_is_relative_per_row(tiny):
    """Shifting every position of a row by a constant leaves its logits unchanged, row by row."""
    tokens = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(2))
    ref = tiny(tokens, tiny.make_caches())
    shifts = torch.tensor([[0], [57], [300]])
    shifted = tiny(tokens, tiny.make_caches(), positions=torch.arange(12) + shifts)
    torch.testing.assert_close(shifted, ref, atol=1e-4, rtol=1e-4)
    # and positions are not ignored: a permutation inside a row changes the result
    perm = torch.arange(12).flip(0).expand(3, 12)
    assert not torch.allclose(tiny(tokens, tiny.make_caches(), positions=perm), ref, atol=1e-3)


class _RowOffsetTail(TailOwnedKVCache):
    """A tail cache that reports its offset per row, as the ragged and paged tiers do."""

    @property
    def offset(self):
        return torch.full((self.keys.shape[0] if self.keys is not None else 2,), self._offset)


@torch.no_grad()
def test_positions_come_from_a_per_row_offset(tiny):
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    ref_caches, row_caches = tiny.make_caches(), [_RowOffsetTail() for _ in range(2)]
    for s, e in ((0, 5), (5, 9)):
        torch.testing.assert_close(tiny(tokens[:, s:e], row_caches),
                                   tiny(tokens[:, s:e], ref_caches), atol=0, rtol=0)


@torch.no_grad()
def test_last_only_and_early_exit(tiny):
    tokens = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    full = tiny(tokens, tiny.make_caches())
    last = tiny(tokens, tiny.make_caches(), last_only=True)
    assert last.shape == (2, 1, 256)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=1e-6)

    # num_layers=1 equals a one-layer model holding the same first layer, norm and head
    one = Transformer(ModelArgs.from_dict({**tiny.args.to_dict(), "n_layers": 1}))
    one.load_state_dict({k: v for k, v in tiny.state_dict().items()
                         if not k.startswith("layers.1.")})
    caches = tiny.make_caches()
    early = tiny(tokens, caches, num_layers=1)
    torch.testing.assert_close(early, one(tokens, one.make_caches()), atol=1e-6, rtol=1e-6)
    assert caches[0].offset == 7 and caches[1].empty()  # the skipped layer's cache is untouched


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, c: m(torch.ones(1, 3), c), "int64"),
        (lambda m, c: m(torch.ones(3, dtype=torch.long), c), "int64 tensor"),
        (lambda m, c: m(torch.ones(1, 0, dtype=torch.long), c), "0 positions"),
        (lambda m, c: m(torch.ones(1, 3, dtype=torch.long), c[:1]), "1 caches"),
        (lambda m, c: m(torch.ones(1, 3, dtype=torch.long), c, num_layers=0), "num_layers"),
        (lambda m, c: m(torch.ones(1, 3, dtype=torch.long), c, num_layers=3), "num_layers"),
        (lambda m, c: m(torch.ones(1, 3, dtype=torch.long), c,
                        positions=torch.arange(2)[None]), "positions"),
    ],
)
def test_bad_input_is_rejected_before_any_cache_changes(tiny, call, message):
    caches = tiny.make_caches()
    with pytest.raises(ValueError, match=message):
        call(tiny, caches)
    assert all(c.empty() for c in caches)


# -- config and named shapes ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"dim": 0}, "dim must be a positive int"),
        ({"dim": 66, "n_heads": 4}, "not divisible"),
        ({"head_dim": 15}, "even"),
        ({"arch": "gpt2"}, "arch"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs keys"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_model_args_are_checked(changes, message):
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=256)
    with pytest.raises(ValueError, match=message):
        ModelArgs(**{**base, **changes})


@pytest.mark.parametrize(
    "name, n_params",
    [  # published parameter counts
        ("smollm2-135m", 134_515_008),
        ("llama2-7b", 6_738_415_616),
        ("llama3-8b", 8_030_261_248),
        ("mistral-7b", 7_248_023_552),
        ("qwen2-7b", 7_615_616_512),
        ("qwen3-8b", 8_190_735_360),
    ],
)
def test_named_shapes_have_the_published_sizes(name, n_params):
    assert get_args(name).n_params == n_params


def test_build_random_is_seeded_and_counts_what_it_allocates():
    a = build_random("tiny-llama", seed=5)
    b = build_random("tiny-llama", seed=5)
    c = build_random("tiny-llama", seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wqkv.weight"], sc["layers.0.attention.wqkv.weight"])
    assert a.output.weight is a.tok_embeddings.weight  # tied
    n = sum(p.numel() for p in a.parameters())
    assert n == ARCHITECTURES["tiny-llama"].n_params
    half = build_random("tiny-qwen2", dtype=torch.bfloat16, n_layers=1)
    assert half.args.n_layers == 1 and len(half.layers) == 1
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.rope.inv_freq.dtype == torch.float32  # kept exact under bf16 weights
    logits = half(torch.tensor([[1, 2, 3]]), half.make_caches())
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="unknown"):
        build_random("gpt-5")
