"""The codec vocabulary: storage modes, TurboQuant codes, and the one parser of each spelling.

Everything that names a storage mode reads these names: the paged tier, the
codecs, :mod:`kvtier.config` (which re-exports them), the command line and the
eval. This module imports nothing of kvtier, so caches and codecs never need
the configuration module.

Full precision has one spelling per medium: ``None`` in Python (``kv_quant=None``,
``turboquant=None``), :data:`FULL_PRECISION` (``"off"``) in text (``--kv-quant off``,
``KVTIER_PAGED_KV_QUANT=off``); where users type mode names (``kvtier eval --modes``,
:func:`parse_mode`) ``"fp"`` (:data:`FULL_PRECISION_ALIAS`) is accepted as well.

Grammar of a mode name (case-insensitive)::

    mode   := "off" | "fp" | "q8" | "q4" | "q4_g32" | "fp8" | turbo
    turbo  := "turboquant" [ ":" codes ]
    codes  := KEY ["r"] "," VALUE              (parse_turboquant; "r" rotates the keys)
    KEY    := q8_0 | int8 | uint8 | q5_0 | q4_0 | int4 | uint4 | int2 | uint2
    VALUE  := q2_0 | q3_0 | q4_0 | q5_0 | q8_0

Bare ``turboquant`` means ``turboquant:q8_0,q3_0``.

Example::

    >>> parse_mode("turboquant:q5_0r,q4_0")
    (None, TurboQuantConfig(key_quant='q5_0', value_quant='q4_0', rotate_keys=True, seed=0))
    >>> parse_kv_quant("off"), parse_kv_quant("Q4_G32"), mode_name("q8")
    (None, 'q4_g32', 'q8')
"""

from __future__ import annotations

from dataclasses import dataclass

#: full precision in text (command line, environment, mode names)
FULL_PRECISION = "off"
#: the other spelling accepted where users type mode names
FULL_PRECISION_ALIAS = "fp"
#: KV-Quant storage modes of the paged tier (``kv_quant``)
KV_QUANT_MODES = ("q8", "q4", "q4_g32", "fp8")
#: the mode name of TurboQuant storage
TURBOQUANT = "turboquant"
TURBOQUANT_KEY_CODES = ("q8_0", "int8", "uint8", "q5_0", "q4_0", "int4", "uint4", "int2", "uint2")
TURBOQUANT_VALUE_CODES = ("q2_0", "q3_0", "q4_0", "q5_0", "q8_0")

_ROTATED = "r"  # suffix of a key code: rotate the keys


@dataclass(frozen=True)
class TurboQuantConfig:
    """TurboQuant storage: integer-coded keys and Hadamard-rotated Lloyd-Max values.

    ``key_quant`` is one of :data:`TURBOQUANT_KEY_CODES`, ``value_quant`` one of
    :data:`TURBOQUANT_VALUE_CODES`; ``rotate_keys`` rotates the keys as well;
    ``seed`` seeds the rotations (see :func:`kvtier.quant.make_codecs`).

    Example::

        >>> TurboQuantConfig("q5_0", "q4_0", rotate_keys=True) == parse_turboquant("q5_0r,q4_0")
        True
    """

    key_quant: str = "q8_0"
    value_quant: str = "q3_0"
    rotate_keys: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.key_quant not in TURBOQUANT_KEY_CODES:
            raise ValueError(
                f"TurboQuant key code {self.key_quant!r} is unknown; accepted: "
                f"{', '.join(TURBOQUANT_KEY_CODES)}"
            )
        if self.value_quant not in TURBOQUANT_VALUE_CODES:
            raise ValueError(
                f"TurboQuant value code {self.value_quant!r} is unknown; accepted: "
                f"{', '.join(TURBOQUANT_VALUE_CODES)}"
            )
        if not isinstance(self.rotate_keys, bool):
            raise ValueError(f"TurboQuant rotate_keys must be a bool, got {self.rotate_keys!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"TurboQuant seed must be an int, got {self.seed!r}")


def check_kv_quant(kv_quant: object) -> str | None:
    """The one check of a ``kv_quant`` setting: ``None`` (full precision) or one of
    :data:`KV_QUANT_MODES`. Returns it; raises ``ValueError`` naming the accepted values.

    Used by :class:`~kvtier.config.KVCacheConfig`, the paged tier, the codecs and
    (through :func:`parse_kv_quant` and :func:`parse_mode`) the command line and the eval.
    """
    if kv_quant is not None and kv_quant not in KV_QUANT_MODES:
        raise ValueError(
            f"kv_quant {kv_quant!r} is unknown; accepted: {', '.join(KV_QUANT_MODES)}, or full "
            f"precision (None in Python, {FULL_PRECISION!r} in text)"
        )
    return kv_quant


def check_turboquant(turboquant: object) -> TurboQuantConfig | None:
    """``turboquant`` if it is a :class:`TurboQuantConfig` or ``None``, else ``ValueError``."""
    if turboquant is not None and not isinstance(turboquant, TurboQuantConfig):
        raise ValueError(
            f"turboquant must be a TurboQuantConfig or None, got {type(turboquant).__name__} "
            f"{turboquant!r} (parse_turboquant('KEY[r],VALUE') builds one from text)"
        )
    return turboquant


def parse_kv_quant(text: str) -> str | None:
    """A ``kv_quant`` setting as text (``"off"``, ``"q8"``, ``"q4"``, ``"q4_g32"``,
    case-insensitive) -> ``None`` or the mode; ``ValueError`` otherwise.

    Example::

        >>> parse_kv_quant(" Q8 "), parse_kv_quant("off")
        ('q8', None)
    """
    if not isinstance(text, str):
        raise ValueError(f"kv_quant text must be a str, got {text!r}")
    key = text.strip().lower()
    return check_kv_quant(None if key == FULL_PRECISION else key)


def parse_turboquant(spec: str) -> TurboQuantConfig:
    """TurboQuant codes ``"KEY[r],VALUE"`` (e.g. ``"q8_0,q3_0"``, ``"q5_0r,q4_0"``;
    case-insensitive) -> :class:`TurboQuantConfig`. The one parser of these codes:
    the ``--turboquant`` flag and the ``turboquant:...`` mode names both use it.

    Raises ``ValueError`` for a malformed spec or an unknown code.
    """
    if not isinstance(spec, str):
        raise ValueError(f"TurboQuant codes must be a str such as 'q8_0,q3_0', got {spec!r}")
    parts = [p.strip() for p in spec.strip().lower().split(",")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(
            f"TurboQuant codes {spec!r} must read KEY,VALUE (e.g. q8_0,q3_0; append r to the key "
            "code for rotated keys: q5_0r,q4_0)"
        )
    key, value = parts
    rotate = key.endswith(_ROTATED) and key[: -len(_ROTATED)] in TURBOQUANT_KEY_CODES
    key = key[: -len(_ROTATED)] if rotate else key
    return TurboQuantConfig(key_quant=key, value_quant=value, rotate_keys=rotate)


def parse_storage_flags(kv_quant: str | None, turboquant: str | None) -> dict:
    """The pages' storage from the ``--kv-quant`` and ``--turboquant`` flags as text (``None``:
    not given): ``{}`` when neither is given, else both fields, since a flag names the whole
    storage and wins over the environment (``--kv-quant q8`` clears ``KVTIER_PAGED_TURBOQUANT``).
    Both naming a codec is a ``ValueError``: TurboQuant is its own codec."""
    if kv_quant is None and turboquant is None:
        return {}
    out: dict = {"kv_quant": None if kv_quant is None else parse_kv_quant(kv_quant), "turboquant": None}
    if turboquant is not None:
        if out["kv_quant"] is not None:
            raise ValueError(
                f"--kv-quant {kv_quant} and --turboquant {turboquant} each name the paged tier's "
                "storage, and TurboQuant is its own codec; drop one of them"
            )
        out["turboquant"] = parse_turboquant(turboquant)
    return out


def parse_mode(name: str) -> tuple[str | None, TurboQuantConfig | None]:
    """A mode name (grammar in the module docstring) -> ``(kv_quant, turboquant)``,
    the arguments :func:`kvtier.quant.make_codecs` and the paged tier take;
    ``(None, None)`` is full precision.

    Example::

        >>> parse_mode("fp"), parse_mode("q4")
        ((None, None), ('q4', None))
    """
    if not isinstance(name, str):
        raise ValueError(f"mode name must be a str, got {name!r}")
    mode = name.strip().lower()
    if mode in (FULL_PRECISION, FULL_PRECISION_ALIAS):
        return None, None
    if mode in KV_QUANT_MODES:
        return mode, None
    if mode == TURBOQUANT:
        return None, TurboQuantConfig()
    head, sep, codes = mode.partition(":")
    if head == TURBOQUANT and sep:
        try:
            return None, parse_turboquant(codes)
        except ValueError as e:
            raise ValueError(f"mode {name!r} is not understood: {e}") from None
    raise ValueError(
        f"mode {name!r} is not understood; use {FULL_PRECISION} (or {FULL_PRECISION_ALIAS}), "
        f"{', '.join(KV_QUANT_MODES)}, {TURBOQUANT} or {TURBOQUANT}:KEY[r],VALUE with KEY in "
        f"{', '.join(TURBOQUANT_KEY_CODES)} and VALUE in {', '.join(TURBOQUANT_VALUE_CODES)} "
        f"(e.g. {TURBOQUANT}:q5_0r,q4_0)"
    )


def mode_name(kv_quant: str | None = None, turboquant: TurboQuantConfig | None = None) -> str:
    """The canonical mode name of ``(kv_quant, turboquant)``; inverse of :func:`parse_mode`
    (the TurboQuant seed is not part of the name). Full precision is ``"off"``."""
    check_kv_quant(kv_quant)
    if check_turboquant(turboquant) is not None:
        r = _ROTATED if turboquant.rotate_keys else ""
        return f"{TURBOQUANT}:{turboquant.key_quant}{r},{turboquant.value_quant}"
    return FULL_PRECISION if kv_quant is None else kv_quant


def is_full_precision(name: str) -> bool:
    """Whether a mode name means full precision (``"off"`` or ``"fp"``); ``ValueError`` if
    it is no mode name at all."""
    return parse_mode(name) == (None, None)
