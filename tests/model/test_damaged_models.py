"""Damaged or mismatched model files: each refused with one line that names the file, the
tensor or key, and the fix, before any output (a ``ValueError``, which the command line
prints as ``kvtier: error: ...``), never a traceback from the libraries underneath; or, where
transformers reads a file one way (a head of its own beside a tied config, keys a config
leaves out), read that way. None loads silently into other logits."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_loading import hf_tiny, write_gguf

from kvtier import cli
from kvtier.model import load_model
from kvtier.model.architectures import get_args
from kvtier.model.llama import Transformer
from kvtier.model.weights import args_from_hf_config, expected_shapes

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf():
    return hf_tiny("llama")


def folder(tmp_path, hf, name="model", **config):
    """``hf`` saved as a Hugging Face folder, its config.json's keys ``config`` changed."""
    path = tmp_path / name
    hf.save_pretrained(path)
    if config:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config}))
    return path


def refused(path, match: str) -> str:
    with pytest.raises(ValueError, match=match) as e:
        load_model(path, device="cpu", progress=False)
    assert "\n" not in str(e.value)  # one line
    return str(e.value)


def test_a_cut_or_garbage_safetensors_file_is_named_with_its_size(tmp_path, hf):
    path = folder(tmp_path, hf)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # before: SafetensorError's traceback
    refused(path, rf"model.safetensors cannot be read as safetensors \(.*\); it holds {len(data) // 2:,} "
                  "bytes: a file cut short or damaged")
    weights.write_bytes(b"")
    refused(path, r"model.safetensors cannot be read as safetensors .* holds 0 bytes")


def test_a_missing_tensor_is_named_as_the_checkpoint_names_it(tmp_path, hf):
    path = folder(tmp_path, hf)
    weights = path / "model.safetensors"
    state = safetensors_torch.load_file(str(weights))
    del state["model.layers.1.mlp.gate_proj.weight"]  # before: KeyError 'layers.1.feed_forward.w1.weight'
    safetensors_torch.save_file(state, str(weights), metadata={"format": "pt"})
    message = refused(path, r"lacks 1 of the 21 tensors a 2-layer model needs: "
                            r"model.layers.1.mlp.gate_proj.weight; a shard is missing")
    assert str(path) in message


def test_a_config_with_more_layers_than_the_weights_is_refused(tmp_path, hf):
    path = folder(tmp_path, hf, num_hidden_layers=3)
    refused(path, r"lacks 9 of the 30 tensors a 3-layer model needs: model.layers.2.input_layernorm.weight, "
                  r"model.layers.2.post_attention_layernorm.weight, model.layers.2.self_attn.q_proj.weight "
                  r"and 6 more")


def test_weights_of_another_shape_are_named_as_the_checkpoint_names_them(tmp_path, hf):
    path = folder(tmp_path, hf, intermediate_size=128)  # before: torch's names of the fused tensors
    refused(path, rf"^{path} holds 6 tensor\(s\) whose shape \(as \[rows, columns\]\) is not the one the "
                  r"config gives \(2 layers, dim 256, .*hidden 128, .*\): "
                  r"model.layers.0.mlp.down_proj.weight is \[256, 256\], not \[256, 128\]; "
                  r"model.layers.0.mlp.gate_proj.weight is \[256, 256\], not \[128, 256\]; "
                  r"model.layers.0.mlp.up_proj.weight is \[256, 256\], not \[128, 256\]; and 3 more; "
                  r"the config does not describe")


def test_a_damaged_tensor_is_named_before_it_is_fused(tmp_path, hf):
    path = folder(tmp_path, hf)
    weights = path / "model.safetensors"
    state = safetensors_torch.load_file(str(weights))
    k = state["model.layers.1.self_attn.k_proj.weight"]
    state["model.layers.1.self_attn.k_proj.weight"] = k[:, :-1].contiguous()  # before: torch.cat's RuntimeError
    safetensors_torch.save_file(state, str(weights), metadata={"format": "pt"})
    refused(path, rf"^{path} holds 1 tensor\(s\) .*: model.layers.1.self_attn.k_proj.weight is "
                  rf"\[{k.shape[0]}, {k.shape[1] - 1}\], not \[{k.shape[0]}, {k.shape[1]}\]; the config")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3",
                                  "smollm2-135m"])
def test_the_expected_shapes_are_the_models_own(name):
    """``expected_shapes`` (unfused) against the state dict of the model itself (fused)."""
    want = expected_shapes(get_args(name, n_layers=2))
    got = {k: tuple(v.shape) for k, v in Transformer(get_args(name, n_layers=2), device="meta").state_dict().items()}
    assert got  # fused: wq/wk/wv rows and w1/w3 rows stacked
    for k, shape in got.items():
        if k.endswith(("wqkv.weight", "wqkv.bias")):
            parts = [want[k.replace("wqkv", w)] for w in ("wq", "wk", "wv")]
            assert shape == (sum(p[0] for p in parts), *parts[0][1:]), k
        elif k.endswith("w13.weight"):
            w1, w3 = want[k.replace("w13", "w1")], want[k.replace("w13", "w3")]
            assert shape == (w1[0] + w3[0], w1[1]), k
        else:
            assert shape == want[k], k


def test_a_tokenizer_that_is_not_json_is_named(tmp_path, hf):
    path = folder(tmp_path, hf)
    (path / "tokenizer.json").write_text("{1: 2}")  # before: the tokenizers library's bare Exception
    refused(path, r"tokenizer.json cannot be read as a tokenizer \(.*\); download the model's "
                  "tokenizer.json again")


def test_generate_without_a_tokenizer_says_so(tmp_path, hf, capsys):
    path = folder(tmp_path, hf)  # config and weights, no tokenizer.json
    capsys.readouterr()
    assert cli.main(["generate", "Hi", "--model", str(path), "--device", "cpu", "--max-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # before: AttributeError 'NoneType' object has no attribute 'encode'
    assert err == (f"kvtier: error: {path} has no tokenizer (tokenizer.json beside the weights, or a "
                   "GGUF's tokenizer.ggml.* keys); kvtier generate needs one to read text: add the "
                   "model's tokenizer.json to its folder\n")


def damaged_gguf(tmp_path, hf, *, skip_key=None, skip_tensor=None):
    """``hf`` written as a GGUF without one metadata key writer or one tensor (patched for the
    writing only: the test's own settings, the conversion cache's folder, stay)."""
    with pytest.MonkeyPatch.context() as mp:
        if skip_key:
            mp.setattr(gguf.GGUFWriter, skip_key, lambda self, *a, **k: None)
        if skip_tensor:
            add = gguf.GGUFWriter.add_tensor
            mp.setattr(gguf.GGUFWriter, "add_tensor", lambda self, name, *a, **k:
                       None if name == skip_tensor else add(self, name, *a, **k))
        return write_gguf(tmp_path / "m.gguf", hf, "llama")


@pytest.mark.parametrize("writer, key", [("add_head_count", "llama.attention.head_count"),
                                         ("add_block_count", "llama.block_count")])
def test_a_gguf_without_a_shape_key_names_the_key(tmp_path, hf, writer, key):
    # before: a TypeError from // with None, or "ModelArgs.n_layers must be a positive int, got None"
    path = damaged_gguf(tmp_path, hf, skip_key=writer)
    refused(path, rf"^{path}: the GGUF lacks the metadata key {key}, which the model's shape needs; the file "
                  "is incomplete")


def test_a_gguf_whose_kv_heads_do_not_match_its_tensors(tmp_path, hf):
    # without head_count_kv the KV heads default to the 4 query heads; the weights hold 2
    path = damaged_gguf(tmp_path, hf, skip_key="add_head_count_kv")
    refused(path, rf"^{path}: blk.0.attn_k.weight has 128 rows, but the metadata give 4 KV heads "
                  r"\(llama.attention.head_count_kv\) of 64 channels = 256")


def test_a_gguf_without_a_tensor_names_it(tmp_path, hf):
    path = damaged_gguf(tmp_path, hf, skip_tensor="blk.1.ffn_gate.weight")
    refused(path, rf"^{path}: the GGUF lacks 1 of the 21 tensors a 2-layer model needs: blk.1.ffn_gate.weight; "
                  "the file is incomplete or its block count wrong: download or convert it again$")


@pytest.mark.parametrize("name, text, problem", [
    ("tokenizer_config.json", "{not json", "is not valid JSON text"),
    ("tokenizer_config.json", "[1, 2]", "holds a JSON list, not an object"),
    ("generation_config.json", "", "is not valid JSON text"),
])
def test_a_damaged_tokenizer_side_file_is_named(tmp_path, hf, name, text, problem):
    from test_loading import VOCAB
    from tokenizers import Tokenizer, models

    path = folder(tmp_path, hf)
    Tokenizer(models.BPE({t: i for i, t in enumerate(VOCAB)}, [])).save(str(path / "tokenizer.json"))
    (path / name).write_text(text)  # before: "Expecting value ..." naming no file, or tokenizer.json blamed
    refused(path, rf"{path / name} {problem}")


def test_generate_with_a_gguf_without_a_tokenizer_gives_the_gguf_fix(tmp_path, hf, capsys):
    # before: "add the model's tokenizer.json to its folder", which a GGUF never reads
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", vocab=False)
    assert cli.main(["generate", "Hi", "--model", str(path), "--device", "cpu", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier: error: {path} has no tokenizer") and err.endswith(
        "kvtier generate needs one to read text: use a GGUF that carries its tokenizer (llama.cpp's "
        "converter writes it)\n")


# -- checkpoints that are not quite the model's: settings the decoder cannot honour, files
# beside the weights, quantised or adapter tensors, configs that leave keys to transformers'
# defaults: refused with one line, or read as transformers reads them --------------------------


def logits(path, ids):
    lm = load_model(path, device="cpu", progress=False, pack=False)
    with torch.no_grad():
        return lm.model(torch.tensor([ids]), lm.model.make_caches())[0]


IDS = [5, 9, 14, 3, 27, 11]


def gguf_with(tmp_path, hf, **extra):
    """``hf`` as a GGUF with extra metadata written after the rope base (``scaling``: a rope
    scaling type and factor; ``window``: a sliding window)."""
    add = gguf.GGUFWriter.add_rope_freq_base

    def add_more(self, base):
        add(self, base)
        if "scaling" in extra:
            self.add_rope_scaling_type(extra["scaling"])
            self.add_rope_scaling_factor(4.0)
        if "window" in extra:
            self.add_sliding_window(extra["window"])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_rope_freq_base", add_more)
        return write_gguf(tmp_path / "m.gguf", hf, "llama")


@pytest.mark.parametrize("kind", [gguf.RopeScalingType.YARN, gguf.RopeScalingType.LONGROPE])
def test_a_gguf_of_yarn_or_longrope_scaling_is_refused(tmp_path, hf, kind):
    # before: loaded without the scaling, logits 5.45 from transformers' YaRN model
    path = gguf_with(tmp_path, hf, scaling=kind)
    refused(path, rf"^{path}: llama.rope.scaling.type '{kind.value}' is not supported; accepted: none, "
                  r"linear \(and Llama 3's rope_freqs\)$")


def test_a_gguf_of_linear_scaling_still_loads_it(tmp_path, hf):
    path = gguf_with(tmp_path, hf, scaling=gguf.RopeScalingType.LINEAR)
    lm = load_model(path, device="cpu", progress=False, pack=False)
    assert lm.args.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_a_gguf_sliding_window_is_applied_in_every_layer(tmp_path, hf):
    (tmp_path / "w").mkdir()
    windowed = load_model(gguf_with(tmp_path / "w", hf, window=8), device="cpu", progress=False, pack=False)
    plain = load_model(write_gguf(tmp_path / "p.gguf", hf, "llama"), device="cpu", progress=False, pack=False)
    assert (windowed.args.sliding_window, windowed.args.sliding_layers) == (8, None)
    assert plain.args.sliding_window is None
    ids = torch.tensor([list(range(3, 23))])
    with torch.no_grad():
        a, b = (lm.model(ids, lm.model.make_caches())[0] for lm in (windowed, plain))
    assert torch.equal(a[:8], b[:8])  # positions 0-7 see every key either way
    assert (a[8:] - b[8:]).abs().amax(-1).min() > 1e-3  # each later one lost its oldest keys


def test_a_tied_config_beside_a_head_of_its_own_uses_the_head_as_transformers_does(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = hf_tiny("qwen2")
    path = folder(tmp_path, hf, tie_word_embeddings=True)  # the saved lm_head differs from the embedding
    with pytest.warns(UserWarning, match="ties the output head to the embedding .* holds an lm_head.weight "
                                         "of its own; it is used, as transformers does"):
        ours = logits(path, IDS)
    theirs = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        want = theirs(torch.tensor([IDS])).logits[0].float()
    assert (ours - want).abs().max() < 1e-4  # before: 29.6 apart (the embedding used as the head)


def test_a_stray_safetensors_file_beside_model_safetensors_is_not_read(tmp_path, hf):
    path = folder(tmp_path, hf)
    want = logits(path, IDS)
    junk = {k: torch.randn_like(v) for k, v in hf.state_dict().items() if "layers.0." in k}
    safetensors_torch.save_file(junk, str(path / "model_old.safetensors"))
    assert torch.equal(logits(path, IDS), want)  # before: model_old's tensors overrode, 36.6 off


def test_several_safetensors_files_without_an_index_are_refused(tmp_path, hf):
    path = folder(tmp_path, hf)
    (path / "model.safetensors").rename(path / "weights.safetensors")
    safetensors_torch.save_file({"x": torch.zeros(1)}, str(path / "adapter_model.safetensors"))
    refused(path, rf"^{path} holds 2 .safetensors files \(adapter_model.safetensors, weights.safetensors\) but "
                  r"neither model.safetensors nor model.safetensors.index.json \(which names the shards\)")
    (path / "adapter_model.safetensors").unlink()  # one file of another name is the model's
    load_model(path, device="cpu", progress=False, pack=False)


@pytest.mark.parametrize("name, hint", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "LoRA adapter's tensor: merge"),
    ("model.layers.0.self_attn.q_proj.weight_scale_inv", "quantised checkpoint's tensor"),
    ("model.layers.0.self_attn.foo.weight", ""),
])
def test_a_tensor_of_no_place_names_its_file_and_what_it_likely_is(tmp_path, hf, name, hint):
    path = folder(tmp_path, hf)
    state = safetensors_torch.load_file(str(path / "model.safetensors"))
    safetensors_torch.save_file({**state, name: torch.zeros(2)}, str(path / "model.safetensors"))
    message = refused(path, rf"^{path / 'model.safetensors'}: tensor '{name}' has no place in a Llama-family "
                            "decoder")
    assert (f"(a {hint}" if hint else "this architecture is not supported") in message


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.bool])
def test_a_tensor_of_codes_is_refused_by_its_dtype(tmp_path, hf, dtype):
    path = folder(tmp_path, hf)
    state = safetensors_torch.load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    state[name] = state[name].clamp(-1, 1).to(dtype)  # before: float8 a RuntimeError traceback from fuse
    safetensors_torch.save_file(state, str(path / "model.safetensors"))
    refused(path, rf"model.safetensors: tensor '{name}' is {str(dtype).removeprefix('torch.')}; the weights "
                  r"must be float32, float16 or bfloat16 \(quantised checkpoints are not supported\)")


def test_a_quantization_config_is_refused(tmp_path, hf):
    path = folder(tmp_path, hf, quantization_config={"quant_method": "gptq", "bits": 4})
    refused(path, r"config.json: quantization_config \(quant_method 'gptq'\): quantised checkpoints are not "
                  "supported; use the model's unquantised weights")


@pytest.mark.parametrize("rope, problem", [
    ({"rope_type": "linear", "factor": "2"}, "factor must be a positive number, got '2'"),
    ({"rope_type": "linear", "factor": 0}, "factor must be a positive number, got 0"),
    ({"rope_type": "linear", "factor": math.nan}, "factor must be a positive number, got nan"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 64}, "low_freq_factor 4.0 must be below high_freq_factor 1.0"),
])
def test_rope_scaling_values_are_checked(tmp_path, hf, rope, problem):
    # before: a TypeError traceback ("2"), or NaN logits printed as <unk> with exit 0 (factor 0)
    path = folder(tmp_path, hf, rope_scaling=rope, rope_parameters={**rope, "rope_theta": 10000.0})
    refused(path, rf"config.json: rope_scaling '{rope['rope_type']}': {problem}")


def test_a_partial_set_of_qkv_biases_is_named_as_the_checkpoint_names_it(tmp_path):
    hf = hf_tiny("qwen2")
    path = folder(tmp_path, hf)
    state = safetensors_torch.load_file(str(path / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.bias"]
    safetensors_torch.save_file(state, str(path / "model.safetensors"))
    # before: "layer 1 has only some of the q/k/v biass"
    refused(path, r"layer 1 holds model.layers.1.self_attn.q_proj.bias, model.layers.1.self_attn.v_proj.bias "
                  r"but not model.layers.1.self_attn.k_proj.bias: the q, k and v projections have a bias each "
                  r"or none \(qwen2: all three\)")


def test_one_safetensors_file_given_for_its_folder_says_so(tmp_path, hf):
    path = folder(tmp_path, hf) / "model.safetensors"
    with pytest.raises(ValueError, match=rf"^'{path}' is one safetensors file; pass the folder that holds it "
                                         rf"with its config.json \('{path.parent}'\)$"):
        load_model(path, device="cpu", progress=False)  # before: "cannot be read as a GGUF file"


BASE = {"hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 32, "intermediate_size": 64,
        "vocab_size": 100}


def test_a_qwen2_gguf_window_is_named_as_not_applied(tmp_path):
    with pytest.MonkeyPatch.context() as mp:  # (as gguf_with, for a qwen2 file)
        add = gguf.GGUFWriter.add_rope_freq_base
        mp.setattr(gguf.GGUFWriter, "add_rope_freq_base", lambda self, base: (add(self, base),
                                                                             self.add_sliding_window(8)))
        path = write_gguf(tmp_path / "w.gguf", hf_tiny("qwen2"), "qwen2")
    with pytest.warns(UserWarning, match=r"qwen2 sliding_window=8 \(qwen2.attention.sliding_window\) is not "
                                         "applied: a GGUF does not say whether the model uses it"):
        lm = load_model(path, device="cpu", progress=False, pack=False)
    assert lm.args.sliding_window is None


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_keys_a_config_leaves_out_take_transformers_defaults(model_type):
    from transformers import AutoConfig

    theirs = AutoConfig.for_model(model_type, **BASE)
    ours = args_from_hf_config({"model_type": model_type, **BASE})
    assert ours.n_kv_heads == theirs.num_key_value_heads
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 1024 // 32)
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.sliding_window == getattr(theirs, "sliding_window", None)  # Mistral's 4096; none by default else
    assert ours.norm_eps == theirs.rms_norm_eps  # (Phi-3's 1e-5, the others' 1e-6)


@pytest.mark.parametrize("model_type, extra", [
    ("mistral", {"sliding_window": 16}), ("mistral", {"sliding_window": None}),
    ("mistral", {"sliding_window": 16, "layer_types": ["full_attention", "full_attention"]}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 0}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16,
               "layer_types": ["sliding_attention", "full_attention"]}),
    ("llama", {"sliding_window": 16}),
    ("phi3", {"sliding_window": 16, "pad_token_id": 0}), ("phi3", {"pad_token_id": 0}),
])
def test_a_config_window_reaches_the_layers_transformers_applies_it_to(model_type, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {"model_type": model_type, **BASE, "num_key_value_heads": 8, **extra}
    ours = args_from_hf_config(cfg)
    theirs = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):  # each attention layer's own window, as transformers built it
        layers = AutoModelForCausalLM.from_config(theirs).model.layers
    # (Mistral's layers read the config's at each call; Llama's have none)
    want = [theirs.sliding_window if model_type in ("mistral", "phi3") else getattr(ly.self_attn, "sliding_window", None)
            for ly in layers]
    assert [ours.window_of(i) for i in range(2)] == want


def test_generate_on_a_model_of_short_context_fits_the_block_tier_to_it(tmp_path, hf, capsys):
    from test_loading import VOCAB
    from tokenizers import Tokenizer, models

    path = folder(tmp_path, hf)  # a context of 256 tokens: the default block of 1024 passed it
    Tokenizer(models.BPE({t: i for i, t in enumerate(VOCAB)}, [])).save(str(path / "tokenizer.json"))
    code = cli.main(["generate", "ab", "--raw", "--model", str(path), "--device", "cpu", "--max-tokens", "3",
                     "--tier", "block"])
    err = capsys.readouterr().err
    assert code == 0, err  # before: "owned_block_size=1024 tokens passes the model's context of 256"
    assert "kvtier: error" not in err


@pytest.mark.parametrize("extra, field", [
    ({"layer_types": ["sliding_attention"]}, "layer_types"),  # one layer of two: meant layer 0, not 1
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"layer_types": "sliding_attention"}, "layer_types"),
    ({"max_window_layers": None}, "max_window_layers"),
])
def test_a_window_s_layers_that_transformers_refuses_are_refused_naming_the_key(extra, field):
    """A Qwen2 config whose ``layer_types`` does not name a kind for each layer, or whose
    ``max_window_layers`` is not a number where it decides: transformers refuses it, and so does
    the loader, naming the key (before: a wrong-length list fell back to ``max_window_layers``,
    so ``["sliding_attention"]`` put the window on layer 1; ``null`` failed on a comparison)."""
    from transformers import AutoConfig

    cfg = {"model_type": "qwen2", **BASE, "num_key_value_heads": 8, "use_sliding_window": True, "sliding_window": 16,
           "max_window_layers": 1, **extra}
    with pytest.raises(Exception):  # noqa: B017 - transformers' own error types differ by key
        AutoConfig.for_model("qwen2", **{k: v for k, v in cfg.items() if k != "model_type"})
    with pytest.raises(ValueError, match=rf"^{field} must "):
        args_from_hf_config(cfg)


def test_a_layer_of_another_attention_kind_sees_the_whole_context():
    """transformers takes any of its attention kinds in Qwen2's ``layer_types`` and runs a layer
    that is not ``"sliding_attention"`` over the whole context; so does the loader."""
    from transformers import AutoConfig

    cfg = {"model_type": "qwen2", **BASE, "num_key_value_heads": 8, "use_sliding_window": True, "sliding_window": 16,
           "layer_types": ["chunked_attention", "sliding_attention"]}
    AutoConfig.for_model("qwen2", **{k: v for k, v in cfg.items() if k != "model_type"})  # (taken)
    assert [args_from_hf_config(cfg).window_of(i) for i in range(2)] == [None, 16]


def test_phi3_fused_tensors_of_another_shape_are_refused_naming_them(tmp_path):
    """Phi-3's ``qkv_proj`` (Q, K and V rows) and ``gate_up_proj`` (gate then up) are split by the
    config's heads and MLP width; one of another shape is refused naming the tensor and the
    shape wanted, and a missing one names the fused tensor, not a projection the file lacks."""
    from safetensors.torch import load_file, save_file
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    Phi3ForCausalLM(cfg).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    good = load_file(weights)
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    assert good[qkv].shape == (64 + 2 * 32, 64)  # (4 heads and 2 of 16 channels each, twice)
    save_file({**good, qkv: good[qkv][:-16]}, weights)
    with pytest.raises(ValueError, match=rf"tensor '{qkv}' has shape \(112, 64\), but the config gives "
                                         r"\(128, 64\) \(64 \+ 32 \+ 32 rows of the self_attn.q_proj"):
        load_model(tmp_path, device="cpu", progress=False)
    up = "model.layers.0.mlp.gate_up_proj.weight"
    save_file({k: v for k, v in good.items() if k != up}, weights)
    with pytest.raises(ValueError, match=rf"{up}"):
        load_model(tmp_path, device="cpu", progress=False)


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_a_partial_rotary_factor_is_refused(where):
    """Phi-4-mini turns three quarters of each head's channels (``partial_rotary_factor`` 0.75);
    RoPE here turns them all, so such a config is refused, not loaded to give other logits."""
    cfg = {"model_type": "phi3", **BASE}
    if where == "top":
        cfg["partial_rotary_factor"] = 0.75
    else:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match=r"^partial_rotary_factor 0.75 is not supported"):
        args_from_hf_config(cfg)
    assert args_from_hf_config({**cfg, "partial_rotary_factor": 1.0, "rope_parameters": None}).arch == "phi3"


@pytest.mark.parametrize("rope, words", [
    ({"type": "su", "short_factor": [1.0] * 16}, r"needs keys \['long_factor'\]"),
    ({"type": "longrope", "short_factor": [1.0] * 15, "long_factor": [2.0] * 16},
     "short_factor holds 15 numbers; a head of 32 channels turns 16 frequencies"),
    ({"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 15 + [0.0]},
     "long_factor must be a list of positive numbers"),
    ({"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16, "attention_factor": "x"},
     "attention_factor must be a positive number, got 'x'"),
])
def test_a_damaged_longrope_config_is_refused_naming_the_key(rope, words):
    """Phi-3's LongRoPE factor lists (one a frequency: half the head's channels), read as
    transformers reads them (``"su"`` an older name), checked by name before any weight loads."""
    cfg = {"model_type": "phi3", **BASE, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
           "rope_scaling": rope}
    with pytest.raises(ValueError, match=words):
        args_from_hf_config(cfg)
    good = {**cfg, "rope_scaling": {"type": "su", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}}
    assert args_from_hf_config(good).rope_scaling["rope_type"] == "longrope"


@pytest.mark.parametrize("rope_extra, top, want", [
    ({"factor": None}, {"original_max_position_embeddings": 64}, (64, 4.0)),  # null: the context's ratio
    ({"original_max_position_embeddings": 64}, {"original_max_position_embeddings": 128}, (128, 2.0)),  # top wins
    ({"original_max_position_embeddings": 64}, {}, (4096, None)),  # Phi-3's default 4,096, as transformers
])
def test_longrope_s_original_context_and_factor_are_read_as_transformers_reads_them(rope_extra, top, want):
    """A Phi-3 config's top-level original context wins over one inside ``rope_scaling`` (4,096
    without either), and a ``factor`` of null is the config's context over the original one: the
    cos/sin scale then equals transformers' (before: the inner value won, and a null factor gave a
    scale of 1.0 once the context was fitted)."""
    import warnings

    from transformers import AutoConfig

    from kvtier.model.rope import rope_scale

    rope = {"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16, **rope_extra}
    cfg = {"model_type": "phi3", **BASE, "max_position_embeddings": 256, **top, "rope_scaling": rope}
    theirs = AutoConfig.for_model("phi3", **{k: v for k, v in cfg.items() if k != "model_type"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = args_from_hf_config(cfg)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, scale = ROPE_INIT_FUNCTIONS["longrope"](theirs, "cpu")
    assert args.rope_scaling["original_max_position_embeddings"] == want[0]
    assert args.rope_scaling.get("factor") == want[1] and rope_scale(args) == pytest.approx(scale)
