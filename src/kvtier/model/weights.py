"""Weight formats -> (:class:`ModelArgs`, state dict in :class:`Transformer`'s names).

Two sources:

- GGUF files, read with the ``gguf`` package: every tensor is dequantised
  (Q4_0, Q4_1, Q8_0, F16, BF16, F32 and the K-quants ``gguf.quants`` supports)
  to float32; hyperparameters come from the ``{arch}.*`` metadata keys. llama.cpp
  stores the Q and K projections of Llama-family models permuted for its RoPE
  layout; :func:`unpermute_qk` undoes that (as ``transformers``' GGUF loader does).
- Hugging Face folders: ``config.json`` plus ``*.safetensors`` (sharded or not),
  for ``model_type`` llama, mistral, qwen2, qwen3 and phi3 (whose fused ``qkv_proj`` and
  ``gate_up_proj`` are split into the projections: :func:`kvtier.model.phi3.split_phi3`).

Both are first renamed to per-projection names (``wq``, ``wk``, ``wv``, ``w1``
gate, ``w3`` up, ``w2`` down), then :func:`fuse` concatenates Q/K/V into
``wqkv`` and gate/up into ``w13``, the layout the model runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.model.llama import ModelArgs, rope_inv_freq
from kvtier.model.phi3 import longrope_context, phi3_source, split_phi3

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
GGUF_ARCHES = ("llama", "mistral", "qwen2", "qwen3")
# llama.cpp permutes Q/K rows only for the architectures it rotates in GPT-J pair layout
_PERMUTED_ARCHES = ("llama", "mistral")

_GGUF_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "attention_norm",
    "ffn_norm": "ffn_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "attn_q_norm": "attention.q_norm",
    "attn_k_norm": "attention.k_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
_HF_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER_NAMES = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)$")


def rename(name: str, table: dict[str, str], layer_table: dict[str, str], pattern) -> str:
    """Our unfused name for a source tensor name; ValueError for one we do not know."""
    if name in table:
        return table[name]
    m = pattern.match(name)
    if m and m.group(2) in layer_table:
        return f"layers.{m.group(1)}.{layer_table[m.group(2)]}.{m.group(3)}"
    raise ValueError(
        f"tensor {name!r} has no place in a Llama-family decoder; this architecture "
        "is not supported"
    )


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model ``args`` describe, with its shape, by our unfused names (torch's
    ``[out, in]``): q/k/v biases only with ``qkv_bias``, q/k norms only with ``qk_norm``."""
    D, hd, H = args.dim, args.head_dim, args.hidden_dim
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    per_layer = {"attention_norm.weight": (D,), "ffn_norm.weight": (D,), "attention.wq.weight": (q, D),
                 "attention.wk.weight": (kv, D), "attention.wv.weight": (kv, D), "attention.wo.weight": (D, q),
                 "feed_forward.w1.weight": (H, D), "feed_forward.w2.weight": (D, H),
                 "feed_forward.w3.weight": (H, D)}
    if args.qk_norm:
        per_layer.update({"attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,)})
    if args.qkv_bias:
        per_layer.update({"attention.wq.bias": (q,), "attention.wk.bias": (kv,), "attention.wv.bias": (kv,)})
    shapes = {"tok_embeddings.weight": (args.vocab_size, D), "norm.weight": (D,),
              "output.weight": (args.vocab_size, D)}
    shapes.update({f"layers.{i}.{n}": s for i in range(args.n_layers) for n, s in per_layer.items()})
    return shapes


def _checkpoint_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """:func:`expected_shapes` of the tensors a checkpoint holds (a tied model's output is its
    embedding, whatever the checkpoint holds)."""
    shapes = expected_shapes(args)
    if args.tie_embeddings:
        del shapes["output.weight"]
    return shapes


def check_complete(tensors: Mapping[str, torch.Tensor], args: ModelArgs, source: Callable[[str], str],
                   where: str, fix: str) -> None:
    """Refuse (``ValueError``) a checkpoint that lacks a weight ``args`` need (biases may be left
    out), naming it as the checkpoint names it (``source``) and ``where`` it was read from."""
    need = [n for n in _checkpoint_shapes(args) if n.endswith(".weight")]
    missing = [source(n) for n in need if n not in tensors]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"{where} lacks {len(missing)} of the {len(need)} tensors a {args.n_layers}-layer "
                         f"model needs: {shown}; {fix}")


def check_shapes(tensors: Mapping[str, torch.Tensor], args: ModelArgs, source: Callable[[str], str],
                 where: str) -> None:
    """Refuse (``ValueError``) a tensor whose shape is not the one ``args`` give it, naming it as
    the checkpoint names it (``source``), before any is fused: the config and the weights
    disagree, or a tensor is damaged."""
    want = _checkpoint_shapes(args)
    wrong = [f"{source(n)} is {list(t.shape)}, not {list(want[n])}" for n, t in tensors.items()
             if n in want and tuple(t.shape) != want[n]]
    if wrong:
        shown = "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        raise ValueError(f"{where} holds {len(wrong)} tensor(s) whose shape (as [rows, columns]) is not the "
                         f"one the config gives ({shape_summary(args)}): {shown}; {SHAPE_FIX}")


def shape_summary(args: ModelArgs) -> str:
    """The shape ``args`` give, in words, for errors."""
    return (f"{args.n_layers} layers, dim {args.dim}, {args.n_heads} heads, {args.n_kv_heads} KV heads, "
            f"head dim {args.head_dim}, hidden {args.hidden_dim}, vocabulary {args.vocab_size}")


#: what to do about weights that do not fit their config
SHAPE_FIX = ("the config does not describe these weights (use the config.json they came with), or a tensor is "
             "damaged (download the model again)")


def source_name(ours: str, table: dict[str, str], layer_table: dict[str, str], layer_format: str) -> str:
    """The checkpoint's name for one of ours (the inverse of :func:`rename`)."""
    for theirs, mine in table.items():
        if mine == ours:
            return theirs
    m = re.match(r"^layers\.(\d+)\.(.+)\.(weight|bias)$", ours)
    if m:
        for theirs, mine in layer_table.items():
            if mine == m.group(2):
                return layer_format.format(m.group(1), theirs, m.group(3))
    return ours


def fuse(tensors: Mapping[str, torch.Tensor], args: ModelArgs,
         source: Callable[[str], str] = str) -> dict[str, torch.Tensor]:
    """Concatenate per-projection tensors into the model's fused ``wqkv`` and ``w13``;
    ``source`` names a tensor as the checkpoint does, for errors."""
    out = dict(tensors)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{p}attention.{w}.{kind}" for w in ("wq", "wk", "wv")]
            parts = [out.pop(n, None) for n in names]
            if all(t is not None for t in parts):
                out[f"{p}attention.wqkv.{kind}"] = torch.cat(parts, dim=0)  # (Hq+2Hkv)*D rows
            elif any(t is not None for t in parts):
                have = [source(n) for n, t in zip(names, parts, strict=True) if t is not None]
                lack = [source(n) for n, t in zip(names, parts, strict=True) if t is None]
                raise ValueError(f"layer {i} holds {', '.join(have)} but not {', '.join(lack)}: the q, k and v "
                                 f"projections have a {kind} each or none ({args.arch}: "
                                 f"{'all three' if args.qkv_bias or kind == 'weight' else 'none'}); the "
                                 "checkpoint does not match its config")
        gate, up = out.pop(f"{p}feed_forward.w1.weight"), out.pop(f"{p}feed_forward.w3.weight")
        out[f"{p}feed_forward.w13.weight"] = torch.cat([gate, up], dim=0)  # (2*hidden, dim)
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: ``[n_heads * D, ...]`` -> the same shape."""
    half = w.shape[0] // n_heads // 2
    # (H, D/2, 2, ...) -> (H, 2, D/2, ...): pairs (x0, x1) back to halves [x0.., x1..]
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# -- GGUF ----------------------------------------------------------------------------------------
def gguf_meta(reader) -> dict[str, Any]:
    """Every metadata field except the large tokenizer arrays, as Python values."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores"}
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def args_from_gguf(meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]],
                   rope_freqs: torch.Tensor | None = None) -> ModelArgs:
    """:class:`ModelArgs` from GGUF metadata and the tensor shapes (numpy order)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; accepted: {', '.join(GGUF_ARCHES)}"
            + ("; load a phi3 model from its Hugging Face folder (config.json and *.safetensors)"
               if arch in HF_MODEL_TYPES else "")
        )

    def key(name: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{name}", default)
        if isinstance(v, list):
            raise ValueError(f"GGUF key {arch}.{name} varies per layer; this is not supported")
        return v

    for name in ("embedding_length", "attention.head_count", "block_count", "feed_forward_length"):
        if key(name) is None:
            raise ValueError(f"the GGUF lacks the metadata key {arch}.{name}, which the model's shape "
                             "needs; the file is incomplete: download or convert it again")
    dim, n_heads = key("embedding_length"), key("attention.head_count")
    n_kv_heads = key("attention.head_count_kv", n_heads)
    q_rows = tensor_shapes["blk.0.attn_q.weight"][0]
    k_rows = tensor_shapes.get("blk.0.attn_k.weight", (None,))[0]
    head_dim = key("attention.key_length", q_rows // n_heads)
    if k_rows is not None and k_rows != n_kv_heads * head_dim:
        raise ValueError(
            f"blk.0.attn_k.weight has {k_rows} rows, but the metadata give {n_kv_heads} KV heads "
            f"({arch}.attention.head_count_kv) of {head_dim} channels = {n_kv_heads * head_dim}; "
            "the file's metadata do not match its tensors: download or convert it again")
    rope_scaling = None
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling != "none":  # yarn, longrope: other frequencies than these weights were trained on
        raise ValueError(f"{arch}.rope.scaling.type {scaling!r} is not supported; accepted: none, linear "
                         "(and Llama 3's rope_freqs)")
    window = key("attention.sliding_window") or None  # (every layer's, as Mistral's)
    if window and arch not in ("llama", "mistral"):  # Qwen2/3: only with use_sliding_window, which GGUFs lack
        if window < key("context_length", 4096):
            warnings.warn(f"{arch} sliding_window={window} ({arch}.attention.sliding_window) is not applied: a GGUF "
                          "does not say whether the model uses it (transformers applies it only with "
                          "use_sliding_window); load the Hugging Face folder to have it", stacklevel=3)
        window = None
    base = float(key("rope.freq_base", 10000.0))
    if rope_freqs is not None:
        rope_scaling = fit_llama3_scaling(rope_freqs, head_dim, base)
    return ModelArgs(
        dim=dim,
        n_layers=key("block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_dim=key("feed_forward_length"),
        vocab_size=tensor_shapes["token_embd.weight"][0],
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=base,
        rope_scaling=rope_scaling,
        tie_embeddings="output.weight" not in tensor_shapes,
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        max_position_embeddings=key("context_length", 4096),
        arch=arch,
        sliding_window=window,
    )


def fit_llama3_scaling(rope_freqs: torch.Tensor, head_dim: int, base: float) -> dict[str, Any]:
    """The Llama-3 ``rope_scaling`` whose frequency factors equal llama.cpp's ``rope_freqs``.

    llama.cpp stores Llama 3.1/3.2 scaling as a tensor of per-frequency divisors,
    not as parameters; the known published settings are tried.
    """
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        rs = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        args = ModelArgs(dim=head_dim, n_layers=1, n_heads=1, n_kv_heads=1, hidden_dim=1,
                         vocab_size=1, rope_theta=base, rope_scaling=rs)
        plain = ModelArgs.from_dict({**args.to_dict(), "rope_scaling": None})
        factors = rope_inv_freq(plain) / rope_inv_freq(args)
        if torch.allclose(factors, rope_freqs.float(), rtol=1e-3):
            return rs
    raise ValueError("the GGUF rope_freqs tensor matches no known Llama-3 rope scaling")


def _gguf_shape(t) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch's order (GGUF lists the fastest dimension first)."""
    return tuple(reversed([int(x) for x in t.shape]))


def gguf_args(reader) -> ModelArgs:
    """The model's shape from an open ``gguf.GGUFReader``: its metadata and tensor shapes
    (its tensors stay memory-mapped, unread, but for ``rope_freqs``)."""
    meta = gguf_meta(reader)
    shapes = {t.name: _gguf_shape(t) for t in reader.tensors}
    if "blk.0.attn_q.weight" not in shapes or "token_embd.weight" not in shapes:
        raise ValueError("the GGUF file holds no Llama-family attention/embedding tensors")
    rope_freqs = next((torch.from_numpy(np.array(t.data, np.float32)) for t in reader.tensors
                       if t.name == "rope_freqs.weight"), None)
    return args_from_gguf(meta, shapes, rope_freqs)


def read_gguf(reader, progress: Callable[[Iterable], Iterable] = iter
              ) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Dequantise every tensor of an open ``gguf.GGUFReader`` into the fused float32 state dict."""
    import gguf

    args = gguf_args(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in progress([t for t in reader.tensors if t.name != "rope_freqs.weight"]):
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(_gguf_shape(t))
        w = torch.from_numpy(np.array(w, dtype=np.float32))  # own, writable copy
        if args.arch in _PERMUTED_ARCHES and ".attn_q." in t.name:
            w = unpermute_qk(w, args.n_heads)
        elif args.arch in _PERMUTED_ARCHES and ".attn_k." in t.name:
            w = unpermute_qk(w, args.n_kv_heads)
        tensors[rename(t.name, _GGUF_NAMES, _GGUF_LAYER_NAMES, _GGUF_LAYER)] = w
    theirs = functools.partial(source_name, table=_GGUF_NAMES, layer_table=_GGUF_LAYER_NAMES,
                               layer_format="blk.{}.{}.{}")
    check_complete(tensors, args, theirs, "the GGUF",
                   "the file is incomplete or its block count wrong: download or convert it again")
    check_shapes(tensors, args, theirs, "the GGUF")
    return args, fuse(tensors, args, theirs)


# -- Hugging Face folders --------------------------------------------------------------------------
#: transformers' defaults (its config classes') of the keys a ``config.json`` may leave out, by
#: ``model_type``; ``None``: from the other keys (KV heads = heads, head dim = hidden / heads)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
              "sliding_window": None, "max_window_layers": 0, "rms_norm_eps": 1e-6},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072,
                "sliding_window": 4096, "max_window_layers": 0, "rms_norm_eps": 1e-6},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768,
              "sliding_window": 4096, "max_window_layers": 28, "rms_norm_eps": 1e-6},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "sliding_window": 4096, "max_window_layers": 28, "rms_norm_eps": 1e-6},
    "phi3": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 4096,
             "sliding_window": None, "max_window_layers": 0, "rms_norm_eps": 1e-5},
}

#: keys a Hugging Face ``config.json`` must have (the others have defaults)
HF_REQUIRED_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "vocab_size")


def args_from_hf_config(cfg: Mapping[str, Any]) -> ModelArgs:
    """:class:`ModelArgs` from a ``config.json`` dict (transformers 4.x or 5.x layout).

    A missing key of :data:`HF_REQUIRED_KEYS` or a value of the wrong type raises
    ``ValueError`` naming it.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"the config must be a JSON object, got {type(cfg).__name__}")
    missing = [k for k in HF_REQUIRED_KEYS if k not in cfg]
    if missing:
        also = f" (and {', '.join(map(repr, missing[1:]))})" if missing[1:] else ""
        raise ValueError(f"the key {missing[0]!r}{also} is missing; re-download the model or "
                         "add the key")
    model_type = cfg["model_type"]
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; accepted: {', '.join(HF_MODEL_TYPES)}"
        )
    if cfg.get("attention_bias") and model_type != "qwen2":
        raise ValueError(f"attention_bias=True is not supported for {model_type}")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported (the MLP has no biases here)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; only 'silu'")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else None
        raise ValueError(f"quantization_config (quant_method {method!r}): quantised checkpoints are not "
                         "supported; use the model's unquantised weights (float32, float16 or bfloat16)")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # (Phi-4-mini's 0.75)
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported: RoPE turns every channel of a "
                         "head here (1.0)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    defaults = _HF_DEFAULTS[model_type]
    context = cfg.get("max_position_embeddings", defaults["max_position_embeddings"])
    if model_type == "phi3" and rope_type in ("su", "yarn"):  # (Phi-3's older names, as transformers reads them)
        rope_type = "longrope"
    if rope_type == "longrope":
        context = longrope_context(rope, cfg, context, model_type)
    window, window_layers = _hf_window(cfg, model_type, defaults)
    n_heads = cfg["num_attention_heads"]
    return ModelArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", defaults["num_key_value_heads"]) or n_heads,
        head_dim=cfg.get("head_dim", defaults["head_dim"]),
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=float(cfg.get("rms_norm_eps", defaults["rms_norm_eps"])),
        rope_theta=float(theta),
        rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        max_position_embeddings=context,
        arch=model_type,
        sliding_window=window,
        sliding_layers=window_layers,
    )


def _hf_window(cfg: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any]) -> tuple[Any, Any]:
    """``(sliding_window, sliding_layers)`` as transformers applies them: Mistral's and Phi-3's
    window in every layer; Qwen2/3's only with ``use_sliding_window``, in the layers ``layer_types`` names
    ``"sliding_attention"`` (by default those from ``max_window_layers`` on); Llama has none."""
    if model_type == "llama":
        return None, None
    window = cfg.get("sliding_window", defaults["sliding_window"])
    if model_type in ("mistral", "phi3") or window is None:
        return window, None
    if not cfg.get("use_sliding_window", False):
        return None, None
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", defaults["max_window_layers"])
        if isinstance(first, bool) or not isinstance(first, int):
            raise ValueError(f"max_window_layers must be an int (the first layer with the sliding window) where "
                             f"use_sliding_window is on and layer_types is not given, got {first!r}")
        types = ["full_attention" if i < first else "sliding_attention" for i in range(n)]
    # (a kind other than "sliding_attention", such as "chunked_attention", sees the whole context here)
    if not isinstance(types, list) or len(types) != n or not all(isinstance(t, str) for t in types):
        raise ValueError(f"layer_types must name the attention of each of the {n} layers (num_hidden_layers), "
                         f"such as \"sliding_attention\" or \"full_attention\", got {types!r}")
    return window, [i for i, t in enumerate(types) if t == "sliding_attention"]


def hf_dir_args(path: Path) -> ModelArgs:
    """The model's shape from a Hugging Face folder's ``config.json`` (no weights read)."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found; a Hugging Face folder needs config.json")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e}); re-download the model") from None
    try:
        args = args_from_hf_config(cfg)
    except (TypeError, ValueError) as e:  # TypeError: a value of the wrong type
        raise ValueError(f"{cfg_path}: {e}") from None
    return args


def read_hf_dir(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Read ``config.json`` and every ``*.safetensors`` shard of a Hugging Face folder."""
    args = hf_dir_args(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index} is not valid JSON ({e}); re-download the model") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} lacks the key 'weight_map' (tensor name -> shard file); "
                             "re-download the model")
        files = [path / s for s in sorted(set(weight_map.values()))]
    else:
        files = _unsharded_file(path)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in _read_safetensors(f).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            _check_dtype(name, t, f)
            try:
                for part, w in split_phi3(name, t, args) if args.arch == "phi3" else [(name, t)]:
                    tensors[rename(part, _HF_NAMES, _HF_LAYER_NAMES, _HF_LAYER)] = w
            except ValueError as e:
                raise ValueError(f"{f}: {e}{_foreign_tensor_hint(name)}") from None
    theirs = functools.partial(source_name, table=_HF_NAMES, layer_table=_HF_LAYER_NAMES,
                               layer_format="model.layers.{}.{}.{}")
    if args.arch == "phi3":
        theirs = functools.partial(phi3_source, theirs=theirs)
    head, embedding = tensors.get("output.weight"), tensors.get("tok_embeddings.weight")
    if args.tie_embeddings and head is not None and embedding is not None and not torch.equal(head, embedding):
        warnings.warn(f"{path}: the config ties the output head to the embedding "
                      "(tie_word_embeddings), but the checkpoint holds an lm_head.weight of its own; it is "
                      "used, as transformers does", stacklevel=3)
        args = dataclasses.replace(args, tie_embeddings=False)
    check_complete(tensors, args, theirs, str(path), "a shard is missing or the config does not describe "
                   "these weights: download the model again")
    check_shapes(tensors, args, theirs, str(path))
    return args, fuse(tensors, args, theirs)


def _unsharded_file(path: Path) -> list[Path]:
    """A folder's weights without an index: ``model.safetensors``, or its one ``*.safetensors``
    (transformers reads the first alone; others beside it are adapters or stale copies)."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:4]) + (" ..." if len(found) > 4 else "")
        raise ValueError(f"{path} holds {len(found)} .safetensors files ({names}) but neither "
                         "model.safetensors nor model.safetensors.index.json (which names the shards); "
                         "add the index, or keep only the model's weights in the folder")
    return found


def _check_dtype(name: str, t: torch.Tensor, file: Path) -> None:
    """Refuse a tensor that is not of a float type the model computes in (float8, integers: the
    codes of a quantised checkpoint, whose scales would be dropped)."""
    if not t.dtype.is_floating_point or t.element_size() < 2:
        raise ValueError(f"{file}: tensor {name!r} is {str(t.dtype).removeprefix('torch.')}; the weights must "
                         "be float32, float16 or bfloat16 (quantised checkpoints are not supported): use the "
                         "model's unquantised weights")


#: tensor name endings of quantised checkpoints, and what they say
_QUANT_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "qweight", "qzeros", "scales",
                   "g_idx", "weight_packed", "absmax", "quant_map", "quant_state.bitsandbytes__nf4")


def _foreign_tensor_hint(name: str) -> str:
    """What a name the decoder has no place for most likely is."""
    if "lora_" in name or name.startswith("base_model.model."):
        return " (a LoRA adapter's tensor: merge the adapter into the base model first and load that)"
    if name.endswith(_QUANT_SUFFIXES):
        return " (a quantised checkpoint's tensor: quantised checkpoints are not supported; use the " \
               "model's unquantised weights)"
    return ""


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found (named by the folder's index); download the model "
                                "again") from None
    except (SafetensorError, OSError, ValueError) as e:
        size = path.stat().st_size if path.is_file() else 0
        raise ValueError(f"{path} cannot be read as safetensors ({e}); it holds {size:,} bytes: a file "
                         "cut short or damaged (download it again)") from None

