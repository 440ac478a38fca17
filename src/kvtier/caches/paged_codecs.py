"""Which codecs the paged tier stores with, and the fallback when a mode cannot serve.

The order is TurboQuant, then the KV-Quant mode (``kv_quant``), then full
precision. A mode is skipped when :func:`kvtier.quant.make_codecs` raises
:class:`~kvtier.quant.codec.CodecUnsupported` (say, TurboQuant at head_dim 96)
or cannot be imported; the reason is kept in the :class:`CodecChoice`.
"""

from __future__ import annotations

import dataclasses

import torch

from kvtier.quant.codec import Codec, CodecUnsupported, IdentityCodec
from kvtier.quant.modes import TurboQuantConfig


@dataclasses.dataclass(frozen=True)
class CodecChoice:
    """The codecs a paged cache stores with, and why a requested mode was dropped."""

    k_codec: Codec
    v_codec: Codec
    mode: str  # "turboquant", "q8", "q4", "q4_g32", "fp8" or "fp"
    turboquant_disabled_reason: str | None = None
    kv_quant_disabled_reason: str | None = None


def mode_codecs(
    mode: str, head_dim: int, dtype: torch.dtype, turboquant: TurboQuantConfig | None = None
) -> tuple[Codec, Codec]:
    """The (key, value) codecs of one storage ``mode``; raises ``CodecUnsupported`` if it cannot serve."""
    if mode == "fp":
        codec = IdentityCodec(head_dim, dtype)
        return codec, codec
    try:
        from kvtier.quant import make_codecs
    except ImportError as e:
        raise CodecUnsupported(f"kvtier.quant.make_codecs is not available ({e})") from e
    if mode == "turboquant":
        assert turboquant is not None, "mode 'turboquant' needs its TurboQuantConfig"
        return make_codecs(head_dim, dtype, turboquant=turboquant)
    return make_codecs(head_dim, dtype, kv_quant=mode)


def select_codecs(
    head_dim: int,
    dtype: torch.dtype,
    kv_quant: str | None = None,
    turboquant: TurboQuantConfig | None = None,
) -> CodecChoice:
    """Pick the storage codecs for ``head_dim``/``dtype``: TurboQuant, else ``kv_quant``, else fp.

    >>> select_codecs(64, torch.float16).mode
    'fp'
    """
    reasons: dict[str, str] = {}
    for mode, wanted in (("turboquant", turboquant is not None), (kv_quant, kv_quant is not None)):
        if not wanted:
            continue
        try:
            k, v = mode_codecs(mode, head_dim, dtype, turboquant)
        except CodecUnsupported as e:
            reasons["turboquant" if mode == "turboquant" else "kv_quant"] = str(e)
            continue
        return CodecChoice(k, v, mode, reasons.get("turboquant"))
    k, v = mode_codecs("fp", head_dim, dtype)
    return CodecChoice(k, v, "fp", reasons.get("turboquant"), reasons.get("kv_quant"))


def storage_mismatch(mine, other) -> str | None:
    """Why paged cache ``other``'s blocks cannot be copied into ``mine`` as they are (block size,
    storage, KV heads, key centre), else ``None``."""
    if other.block_size != mine.block_size:
        return f"block_size {other.block_size} differs from {mine.block_size}"
    if mine.codecs is None or other.codecs is None:
        return None
    a, b = mine.codecs, other.codecs
    if (a.mode, a.k_codec.head_dim, a.k_codec.dtype) != (b.mode, b.k_codec.head_dim, b.k_codec.dtype):
        return (f"storage {b.mode}/{b.k_codec.head_dim}/{b.k_codec.dtype} differs from "
                f"{a.mode}/{a.k_codec.head_dim}/{a.k_codec.dtype}")
    if other.pool.key_cache.shape[2] != mine.pool.key_cache.shape[2]:
        return f"kv_heads {other.pool.key_cache.shape[2]} differs from {mine.pool.key_cache.shape[2]}"
    ca, cb = a.k_codec.centre, b.k_codec.centre
    if (ca is None) != (cb is None) or (ca is not None and not torch.equal(ca, cb.to(ca.device))):
        return (f"its {b.mode} keys are coded against another key centre (each cache takes its own "
                "from its first keys); copy the rows through fetch() and update() instead")
    return None
