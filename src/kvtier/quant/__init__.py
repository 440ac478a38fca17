"""Storage codecs for the paged tier: KV-Quant (q8, q4, q4_g32) and TurboQuant.

:func:`make_codecs` builds the (key, value) codec pair of one storage mode;
:func:`codec_for_mode` does the same from a mode name, whose grammar is::

    mode   := "fp" | "q8" | "q4" | "q4_g32" | turbo
    turbo  := "turboquant" [ ":" KEY ["r"] "," VALUE ]
    KEY    := q8_0 | int8 | uint8 | q5_0 | q4_0 | int4 | uint4 | int2 | uint2
    VALUE  := q2_0 | q3_0 | q4_0 | q5_0 | q8_0

``r`` after the key code rotates the keys; bare ``turboquant`` means
``turboquant:q8_0,q3_0``. Names are case-insensitive. Examples: ``"q4_g32"``,
``"turboquant:q8_0,q3_0"``, ``"turboquant:q5_0r,q4_0"``.

Example::

    >>> import torch
    >>> k_codec, v_codec = codec_for_mode("turboquant:q5_0r,q4_0", 64, torch.float16)
    >>> k_codec.name, v_codec.name, k_codec.bits_per_element(), v_codec.bits_per_element()
    ('turboquant-key:q5_0r', 'turboquant-value:q4_0', 6.0, 4.5)

Byte layouts and measured distortion: ``docs/quantization.md``.
"""

from __future__ import annotations

import torch

from kvtier.config import (
    KV_QUANT_MODES,
    TURBOQUANT_KEY_CODES,
    TURBOQUANT_VALUE_CODES,
    TurboQuantConfig,
)
from kvtier.quant.codec import Codec, CodecUnsupported, IdentityCodec, SidecarSpec
from kvtier.quant.hadamard import HadamardRotation
from kvtier.quant.kv_quant import GroupQ4Codec, Q4Codec, Q8Codec
from kvtier.quant.lloyd_max import LloydMaxQuantizer, lloyd_max_quantizer
from kvtier.quant.turboquant import TurboKeyCodec, TurboValueCodec

__all__ = [
    "Codec",
    "CodecUnsupported",
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
    "codec_for_mode",
    "lloyd_max_quantizer",
    "make_codecs",
    "mode_name",
    "parse_mode",
]

_KV_QUANT_CODECS: dict[str, type[Codec]] = {"q8": Q8Codec, "q4": Q4Codec, "q4_g32": GroupQ4Codec}
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
    if turboquant is not None:
        if not isinstance(turboquant, TurboQuantConfig):
            raise ValueError(f"turboquant must be a TurboQuantConfig, got {turboquant!r}")
        s = turboquant.seed + seed
        key = TurboKeyCodec(
            head_dim, dtype, turboquant.key_quant, rotate=turboquant.rotate_keys, seed=2 * s
        )
        value = TurboValueCodec(head_dim, dtype, turboquant.value_quant, seed=2 * s + 1)
        return key, value
    if kv_quant is None:
        return IdentityCodec(head_dim, dtype), IdentityCodec(head_dim, dtype)
    if kv_quant not in _KV_QUANT_CODECS:
        raise ValueError(
            f"kv_quant {kv_quant!r} is unknown; accepted: None, {', '.join(_KV_QUANT_CODECS)}"
        )
    cls = _KV_QUANT_CODECS[kv_quant]
    return cls(head_dim, dtype), cls(head_dim, dtype)


def parse_mode(name: str) -> tuple[str | None, TurboQuantConfig | None]:
    """A mode name (grammar in the module docstring) -> ``(kv_quant, turboquant)``,
    the arguments :func:`make_codecs` and the paged tier take.

    Example::

        >>> parse_mode("turboquant:q5_0r,q4_0")
        (None, TurboQuantConfig(key_quant='q5_0', value_quant='q4_0', rotate_keys=True, seed=0))
    """
    if not isinstance(name, str):
        raise ValueError(f"mode name must be a str, got {name!r}")
    mode = name.strip().lower()
    if mode == "fp":
        return None, None
    if mode in _KV_QUANT_CODECS:
        return mode, None
    if mode == "turboquant":
        return None, TurboQuantConfig()
    head, sep, codes = mode.partition(":")
    key, comma, value = codes.partition(",")
    rotate = key.endswith("r") and key[:-1] in TURBOQUANT_KEY_CODES
    key = key[:-1] if rotate else key
    if head != "turboquant" or not sep or not comma or key not in TURBOQUANT_KEY_CODES \
            or value not in TURBOQUANT_VALUE_CODES:
        raise ValueError(
            f"mode {name!r} is not understood; use fp, {', '.join(_KV_QUANT_CODECS)}, turboquant or "
            f"turboquant:KEY[r],VALUE with KEY in {', '.join(TURBOQUANT_KEY_CODES)} and VALUE in "
            f"{', '.join(TURBOQUANT_VALUE_CODES)} (e.g. turboquant:q5_0r,q4_0)"
        )
    return None, TurboQuantConfig(key_quant=key, value_quant=value, rotate_keys=rotate)


def mode_name(kv_quant: str | None = None, turboquant: TurboQuantConfig | None = None) -> str:
    """The canonical mode name of ``(kv_quant, turboquant)``; inverse of :func:`parse_mode`
    (the TurboQuant seed is not part of the name)."""
    if turboquant is not None:
        r = "r" if turboquant.rotate_keys else ""
        return f"turboquant:{turboquant.key_quant}{r},{turboquant.value_quant}"
    return "fp" if kv_quant is None else kv_quant


def codec_for_mode(
    mode_name: str, head_dim: int, dtype: torch.dtype, *, seed: int = 0
) -> tuple[Codec, Codec]:
    """The (key_codec, value_codec) of a mode name such as ``"q4_g32"`` or
    ``"turboquant:q5_0r,q4_0"``; see :func:`make_codecs` for errors and seeds."""
    kv_quant, turboquant = parse_mode(mode_name)
    return make_codecs(head_dim, dtype, kv_quant=kv_quant, turboquant=turboquant, seed=seed)
