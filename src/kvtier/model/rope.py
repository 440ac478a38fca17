"""Rotary position embeddings (RoPE) of the decoder (:mod:`kvtier.model.llama`), rotate-half layout.

The frequencies follow ``ModelArgs.rope_scaling`` as transformers reads it:

- ``None`` / ``"default"``: ``theta ** (-2 i / head_dim)``;
- ``"linear"``: divided by ``factor``;
- ``"llama3"``: Llama 3.1's bands (long wavelengths divided by ``factor``, short ones kept, the
  middle interpolated);
- ``"longrope"`` (Phi-3-128k, Phi-3.5; ``"su"`` in older configs) within its original context:
  the ``short_factor`` list divides the frequencies, and cos and sin are scaled by
  ``attention_factor`` (by default ``sqrt(1 + ln(factor) / ln(original))``, ``factor`` the
  config's context over the original one). Past the original context transformers switches to
  the ``long_factor`` list for every position of the sequence, recomputing the keys cached
  before; kvtier does not, so such a model runs within ``original_max_position_embeddings``
  (``ModelArgs`` checks it; the loader fits the context to it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from kvtier.model.llama import ModelArgs

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def check_rope_scaling(rs: dict[str, Any], head_dim: int | None = None, context: int | None = None) -> None:
    """``ValueError`` naming what is wrong with a ``rope_scaling`` dict (``head_dim``: the
    length LongRoPE's factor lists must have twice; ``context``: the model's positions, within
    LongRoPE's original ones)."""
    if not isinstance(rs, dict):
        raise ValueError(f"rope_scaling must be a dict or None, got {type(rs).__name__}")
    rope_type = _rope_type(rs)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; accepted: {', '.join(ROPE_TYPES)}"
        )
    needed = {
        "default": (),
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                   "original_max_position_embeddings"),
        "longrope": ("original_max_position_embeddings",),
    }[rope_type]
    lists = ("short_factor", "long_factor") if rope_type == "longrope" else ()
    missing = [k for k in needed + lists if k not in rs]
    if missing:
        raise ValueError(f"rope_scaling {rope_type!r} needs keys {missing}; got {sorted(rs)}")
    optional = [k for k in ("factor", "attention_factor") if rope_type == "longrope" and rs.get(k) is not None]
    for k in needed + tuple(optional):  # a string, a zero or a NaN would load and give NaN logits later
        v = rs[k]
        if not _positive(v):
            raise ValueError(f"rope_scaling {rope_type!r}: {k} must be a positive number, got {v!r}")
    for k in lists:
        v = rs[k]
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not all(map(_positive, v)):
            raise ValueError(f"rope_scaling {rope_type!r}: {k} must be a list of positive numbers, got {v!r}")
        if head_dim is not None and len(v) != head_dim // 2:
            raise ValueError(f"rope_scaling {rope_type!r}: {k} holds {len(v)} numbers; a head of {head_dim} "
                             f"channels turns {head_dim // 2} frequencies")
    original = rs.get("original_max_position_embeddings")
    if rope_type == "longrope" and context is not None and context > original:
        raise ValueError(f"rope_scaling 'longrope': a context of {context} positions (max_position_embeddings) "
                         f"passes original_max_position_embeddings {original}, past which transformers turns every "
                         "position with the long factors and computes the cached keys again, which is not done "
                         f"here; pass max_position_embeddings <= {original} (the Hugging Face loader fits a "
                         "config's context so)")
    if rope_type == "llama3" and not rs["low_freq_factor"] < rs["high_freq_factor"]:
        raise ValueError(f"rope_scaling 'llama3': low_freq_factor {rs['low_freq_factor']!r} must be below "
                         f"high_freq_factor {rs['high_freq_factor']!r} (the band between them is "
                         "interpolated; Llama 3.1 uses 1.0 and 4.0)")


def _positive(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _rope_type(rs: dict[str, Any] | None) -> str:
    """A ``rope_scaling`` dict's type (``"type"`` in older configs; ``None``: ``"default"``)."""
    rs = rs or {}
    return rs.get("rope_type", rs.get("type", "default"))


class RotaryEmbedding(nn.Module):
    """cos/sin ``[B, T, 1, D]`` for per-row positions ``[B, T]`` (rotate-half layout)."""

    def __init__(self, args: ModelArgs, device=None):
        super().__init__()
        self.args = args
        self.register_buffer("inv_freq", rope_inv_freq(args, device), persistent=False)
        self.scale = rope_scale(args)  # cos and sin times this (1.0 but for LongRoPE)

    def reset(self, device: torch.device | str | None = None) -> None:
        """Recompute ``inv_freq`` on ``device`` (after building the model on the meta device)."""
        self.inv_freq = rope_inv_freq(self.args, device=device)
        self.scale = rope_scale(self.args)

    def _apply(self, fn, recurse=True):
        # Module.to()/to_empty() would cast inv_freq with the weights (bf16 loses
        # the low frequencies) or leave it on the meta device: recompute it in
        # float32 wherever it lands.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.args, device=self.inv_freq.device)
        return self

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, D/2), float32
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # (B, T, 1, D)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def rope_inv_freq(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32), with linear, Llama-3 or LongRoPE's short
    scaling. Computed on the CPU, then moved to ``device``."""
    return _rope_inv_freq_cpu(args).to(device)


def rope_scale(args: ModelArgs) -> float:
    """What cos and sin are scaled by: LongRoPE's ``attention_factor``, else transformers' default
    ``sqrt(1 + ln(factor) / ln(original))`` with ``factor`` (by default the context over the
    original one) above 1; 1.0 for other RoPE."""
    if _rope_type(args.rope_scaling) != "longrope":
        return 1.0
    rs = args.rope_scaling
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    original = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or args.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _factored(args: ModelArgs, factors: list[float] | None) -> torch.Tensor:
    """``1 / (factors theta^(2 i / D))`` as transformers computes it (``None``: no factors). On the
    CPU: math on the meta device would import torch._dynamo, which takes seconds."""
    D = args.head_dim
    powers = args.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)
    return 1.0 / (powers if factors is None else torch.tensor(factors, dtype=torch.float32) * powers)


def _rope_inv_freq_cpu(args: ModelArgs) -> torch.Tensor:
    rs = args.rope_scaling or {}
    rope_type = _rope_type(rs)
    if rope_type == "longrope":
        return _factored(args, rs["short_factor"])
    inv_freq = _factored(args, None)
    if rope_type == "linear":
        return inv_freq / rs["factor"]
    if rope_type != "llama3":
        return inv_freq
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the middle band interpolated
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, H, D]`` by cos/sin ``[B, T, 1, D]`` (every head alike)."""
    return x * cos + rotate_half(x) * sin
