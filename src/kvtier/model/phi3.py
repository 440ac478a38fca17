"""Phi-3 checkpoints for the Hugging Face loader (:mod:`kvtier.model.weights`): its fused
projections split into the per-projection tensors of a Llama checkpoint, and the context a
LongRoPE model runs here."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvtier.model.llama import ModelArgs

#: Phi-3's fused projections: Q, K and V rows in one, the MLP's gate then up rows in one
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def split_phi3(name: str, t: torch.Tensor, args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """A Phi-3 checkpoint tensor as the per-projection tensors of a Llama checkpoint: ``qkv_proj``
    into ``q_proj``, ``k_proj`` and ``v_proj`` (rows of ``n_heads``, ``n_kv_heads`` and
    ``n_kv_heads`` heads), ``gate_up_proj`` into ``gate_proj`` and ``up_proj`` (its halves, as
    transformers' ``chunk(2)``); any other tensor as it is. A fused tensor of another shape
    raises ``ValueError`` naming it and the shape the config wants."""
    fused = next((f for f in _FUSED if name.startswith("model.layers.") and name.endswith(f".{f}.weight")), None)
    if fused is None:
        return [(name, t)]
    parts = _FUSED[fused]
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    rows = (q, kv, kv) if len(parts) == 3 else (args.hidden_dim, args.hidden_dim)
    if tuple(t.shape) != (sum(rows), args.dim):
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, but the config gives "
                         f"{(sum(rows), args.dim)} ({' + '.join(map(str, rows))} rows of the "
                         f"{', '.join(parts)} projections); the config does not describe these weights")
    prefix = name[: -len(f"{fused}.weight")]  # ("model.layers.N.")
    return [(f"{prefix}{part}.weight", w) for part, w in zip(parts, t.split(rows), strict=True)]


def phi3_source(ours: str, theirs: Callable[[str], str]) -> str:
    """The Phi-3 checkpoint's name for one of ours: its fused tensor for a projection."""
    m = re.match(r"^layers\.(\d+)\.(attention\.w[qkv]|feed_forward\.w[13])\.weight$", ours)
    if not m:
        return theirs(ours)
    fused = "self_attn.qkv_proj" if m.group(2).startswith("attention") else "mlp.gate_up_proj"
    return f"model.layers.{m.group(1)}.{fused}.weight"


def longrope_context(rope: dict, cfg: Mapping[str, Any], context: Any, model_type: str) -> Any:
    """The context a LongRoPE model runs here: its original one (a warning says so where the config
    gives more), its ``factor`` (the config's context over the original one) kept in ``rope`` for
    the cos/sin scale (:func:`~kvtier.model.rope.rope_scale`). Phi-3's original context is the
    config's top-level key (4,096 without one), over any in ``rope``, as transformers reads it."""
    if model_type == "phi3" or "original_max_position_embeddings" not in rope:
        rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings", 4096)
    original = rope["original_max_position_embeddings"]
    if isinstance(original, float) and original.is_integer():
        original = rope["original_max_position_embeddings"] = int(original)
    if not isinstance(context, int) or not isinstance(original, int) or context <= original:
        return context  # (ModelArgs names a value of the wrong type)
    if rope.get("factor") is None:
        rope["factor"] = context / original
    warnings.warn(f"LongRoPE past the original {original} positions turns every position with its long factors "
                  f"and computes the cached keys again (transformers' generate), which is not done here: the "
                  f"context is {original} tokens, not the config's max_position_embeddings {context}",
                  UserWarning, stacklevel=4)
    return original
