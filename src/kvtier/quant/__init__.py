"""Storage codecs for the paged tier: KV-Quant (q8, q4, q4_g32) and TurboQuant.

:func:`make_codecs` builds the (key, value) codec pair of one storage mode;
:func:`codec_for_mode` does the same from a mode name. The names themselves
(``KV_QUANT_MODES``, the TurboQuant codes, :class:`TurboQuantConfig`,
:func:`parse_mode`, :func:`parse_turboquant`, :func:`parse_kv_quant`) live in
:mod:`kvtier.quant.modes`, with the grammar of a mode name; for example
``"q4_g32"``, ``"turboquant:q8_0,q3_0"``, ``"turboquant:q5_0r,q4_0"``.

Example::

    >>> import torch
    >>> k_codec, v_codec = codec_for_mode("turboquant:q5_0r,q4_0", 64, torch.float16)
    >>> k_codec.name, v_codec.name, k_codec.bits_per_element(), v_codec.bits_per_element()
    ('turboquant-key:q5_0r', 'turboquant-value:q4_0', 6.0, 4.5)

Byte layouts and measured distortion: ``docs/quantization.md``.
"""

from __future__ import annotations

import torch

from kvtier.quant.codec import Codec, CodecUnsupported, IdentityCodec, SidecarSpec
from kvtier.quant.fp8 import Fp8Codec
from kvtier.quant.hadamard import HadamardRotation
from kvtier.quant.kv_quant import GroupQ4Codec, Q4Codec, Q8Codec
from kvtier.quant.lloyd_max import LloydMaxQuantizer, lloyd_max_quantizer
from kvtier.quant.modes import (
    FULL_PRECISION,
    KV_QUANT_MODES,
    TURBOQUANT_KEY_CODES,
    TURBOQUANT_VALUE_CODES,
    TurboQuantConfig,
    check_kv_quant,
    check_turboquant,
    mode_name,
    parse_kv_quant,
    parse_mode,
    parse_turboquant,
)
from kvtier.quant.turboquant import TurboKeyCodec, TurboValueCodec

__all__ = [
    "FULL_PRECISION",
    "KV_QUANT_MODES",
    "TURBOQUANT_KEY_CODES",
    "TURBOQUANT_VALUE_CODES",
    "Codec",
    "CodecUnsupported",
    "Fp8Codec",
    "GroupQ4Codec",
    "HadamardRotation",
    "IdentityCodec",
    "LloydMaxQuantizer",
    "Q4Codec",
    "Q8Codec",
    "SidecarSpec",
    "TurboKeyCodec",
    "TurboQuantConfig",
    "TurboValueCodec",
    "check_kv_quant",
    "check_turboquant",
    "codec_for_mode",
    "lloyd_max_quantizer",
    "make_codecs",
    "mode_name",
    "parse_kv_quant",
    "parse_mode",
    "parse_turboquant",
]

_KV_QUANT_CODECS: dict[str, type[Codec]] = {
    "q8": Q8Codec, "q4": Q4Codec, "q4_g32": GroupQ4Codec, "fp8": Fp8Codec,
}
assert set(_KV_QUANT_CODECS) == set(KV_QUANT_MODES)


def make_codecs(
    head_dim: int,
    dtype: torch.dtype,
    *,
    kv_quant: str | None = None,
    turboquant: TurboQuantConfig | None = None,
    seed: int = 0,
) -> tuple[Codec, Codec]:
    """The (key_codec, value_codec) of one storage mode for vectors of ``head_dim``.

    Give at most one of ``kv_quant`` (``"q8"``, ``"q4"``, ``"q4_g32"``) and
    ``turboquant``; neither gives full precision (:class:`IdentityCodec`). Both
    at once is a ``ValueError``: the paged tier tries modes one at a time and
    owns the fallback order. Raises :class:`CodecUnsupported` (a ``ValueError``)
    with the reason when the mode cannot serve ``head_dim``.

    TurboQuant rotation seeds: with ``s = turboquant.seed + seed`` (``seed`` is an
    offset, e.g. a layer index), keys rotate with seed ``2*s`` and values with
    ``2*s + 1``, so K and V never share a rotation.

    Example::

        >>> k, v = make_codecs(128, torch.bfloat16, kv_quant="q8")
        >>> k.name, v.bits_per_element()
        ('q8', 8.25)
    """
    if kv_quant is not None and turboquant is not None:
        raise ValueError(
            f"make_codecs() takes one mode, got kv_quant={kv_quant!r} and turboquant={turboquant!r}; "
            "call it once per mode (the paged tier tries TurboQuant first, then kv_quant)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if check_turboquant(turboquant) is not None:
        s = turboquant.seed + seed
        key = TurboKeyCodec(
            head_dim, dtype, turboquant.key_quant, rotate=turboquant.rotate_keys, seed=2 * s
        )
        value = TurboValueCodec(head_dim, dtype, turboquant.value_quant, seed=2 * s + 1)
        return key, value
    if check_kv_quant(kv_quant) is None:
        return IdentityCodec(head_dim, dtype), IdentityCodec(head_dim, dtype)
    cls = _KV_QUANT_CODECS[kv_quant]
    return cls(head_dim, dtype), cls(head_dim, dtype)


def codec_for_mode(
    name: str, head_dim: int, dtype: torch.dtype, *, seed: int = 0
) -> tuple[Codec, Codec]:
    """The (key_codec, value_codec) of a mode name such as ``"q4_g32"`` or
    ``"turboquant:q5_0r,q4_0"`` (grammar: :mod:`kvtier.quant.modes`); see
    :func:`make_codecs` for errors and seeds."""
    kv_quant, turboquant = parse_mode(name)
    return make_codecs(head_dim, dtype, kv_quant=kv_quant, turboquant=turboquant, seed=seed)
