"""Damaged or mismatched model files: each refused with one line that names the file, the
tensor or key, and the fix, before any output (a ``ValueError``, which the command line
prints as ``kvtier: error: ...``), never a traceback from the libraries underneath."""

from __future__ import annotations

import json

import pytest
from test_loading import hf_tiny, write_gguf

from kvtier import cli
from kvtier.model import load_model
from kvtier.model.architectures import get_args
from kvtier.model.llama import Transformer
from kvtier.model.weights import expected_shapes

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
