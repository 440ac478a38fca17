"""Checkpoints that are not quite the model's: settings the decoder cannot honour, files beside the
weights, quantised or adapter tensors, configs that leave keys to transformers' defaults. Each is
refused with one line naming the file or setting and the fix, or read as transformers reads it;
none loads silently into other logits."""

from __future__ import annotations

import math

import pytest
import torch
from test_damaged_models import folder, refused
from test_loading import hf_tiny, write_gguf

from kvtier import cli
from kvtier.model import load_model
from kvtier.model.llama import ModelArgs
from kvtier.model.weights import args_from_hf_config

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf():
    return hf_tiny("llama")


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


def test_a_gguf_sliding_window_is_named_as_not_applied(tmp_path, hf):
    path = gguf_with(tmp_path, hf, window=8)  # before: dropped without a word (the folder warned)
    with pytest.warns(UserWarning, match=r"llama sliding_window=8 \(llama.attention.sliding_window\) is not "
                                         "applied: attention sees the whole context"):
        load_model(path, device="cpu", progress=False, pack=False)


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


@pytest.mark.filterwarnings("ignore:mistral sliding_window")
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_keys_a_config_leaves_out_take_transformers_defaults(model_type):
    from transformers import AutoConfig

    theirs = AutoConfig.for_model(model_type, **BASE)
    ours = args_from_hf_config({"model_type": model_type, **BASE})
    assert ours.n_kv_heads == theirs.num_key_value_heads
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 1024 // 32)
    assert ours.max_position_embeddings == theirs.max_position_embeddings


@pytest.mark.parametrize("max_window_layers, warned", [(2, False), (1, True)])
def test_a_qwen2_window_no_layer_uses_is_not_warned_of(max_window_layers, warned, recwarn):
    cfg = {"model_type": "qwen2", **BASE, "num_key_value_heads": 8, "use_sliding_window": True,
           "sliding_window": 16, "max_window_layers": max_window_layers, "max_position_embeddings": 64}
    assert isinstance(args_from_hf_config(cfg), ModelArgs)
    assert any("sliding_window=16 is not applied" in str(w.message) for w in recwarn) == warned


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
