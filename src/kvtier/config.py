"""Choosing a tier at run time. The only module that reads the environment.

``KVCacheConfig.from_env()`` turns the ``KVTIER_*`` variables (and their MTPLX
aliases) into a frozen :class:`KVCacheConfig`; :func:`make_caches` builds fresh
per-layer caches from it; :func:`configure_kv_cache` converts an existing list in
place.

Example::

    >>> import os
    >>> os.environ["KVTIER_OWNED_ATTN_KV"] = "block"
    >>> cfg = KVCacheConfig.from_env()
    >>> caches = make_caches(30, cfg)
    >>> type(caches[0]).__name__
    'BlockOwnedKVCache'
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.caches.base import KVCache

STRATEGIES = ("tail", "block", "ragged", "paged")
KV_QUANT_MODES = ("q8", "q4", "q4_g32")
TURBOQUANT_KEY_CODES = ("q8_0", "int8", "uint8", "q5_0", "q4_0", "int4", "uint4", "int2", "uint2")
TURBOQUANT_VALUE_CODES = ("q2_0", "q3_0", "q4_0", "q5_0", "q8_0")
ATTENTION_BACKENDS = ("auto", "torch", "triton")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class TurboQuantConfig:
    """TurboQuant storage: integer-coded keys and Hadamard-rotated Lloyd-Max values."""

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


@dataclass(frozen=True)
class KVCacheConfig:
    """Which tier to build and with what parameters. Defaults match DESIGN.md section 4."""

    strategy: str = "tail"
    step: int = 256
    owned_block_size: int = 1024
    # paged tier
    paged_block_size: int = 16
    paged_num_blocks: int = 1024
    dynamic_paged: bool = False
    dynamic_paged_tokens: int = 0
    dynamic_paged_min_blocks: int | None = None
    dynamic_paged_margin: int = 128
    previous_high_water: int = 0
    context_window_tokens: int | None = None
    kv_quant: str | None = None
    turboquant: TurboQuantConfig | None = None
    attention_backend: str = "auto"
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy {self.strategy!r} is unknown; accepted: {', '.join(STRATEGIES)}"
            )
        for name in ("step", "owned_block_size", "paged_block_size", "paged_num_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("dynamic_paged_tokens", "dynamic_paged_margin", "previous_high_water"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.kv_quant is not None and self.kv_quant not in KV_QUANT_MODES:
            raise ValueError(
                f"kv_quant {self.kv_quant!r} is unknown; accepted: off, {', '.join(KV_QUANT_MODES)}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} is unknown; accepted: "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        for name in ("dynamic_paged_min_blocks", "context_window_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if self.turboquant is not None and not isinstance(self.turboquant, TurboQuantConfig):
            raise ValueError(
                f"turboquant must be a TurboQuantConfig or None, got {type(self.turboquant).__name__}"
            )
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")

    def replace(self, **changes: Any) -> KVCacheConfig:
        return dataclasses.replace(self, **changes)

    # -- the environment ---------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KVCacheConfig:
        """Build a config from ``env`` (default ``os.environ``); see DESIGN.md section 4.

        Each ``KVTIER_*`` variable wins over its MTPLX alias. ``KVTIER_OWNED_ATTN_KV``
        set to ``0``/``false``/``off``/``no``/``none`` gives ``enabled=False``:
        :func:`configure_kv_cache` then leaves the caches it is given as they are.
        A value that cannot be parsed raises ``ValueError`` naming the variable and
        what it accepts.
        """
        env = os.environ if env is None else env
        r = _EnvReader(env)
        paged = r.flag("KVTIER_PAGED_ATTN", "MTPLX_VLLM_METAL_PAGED_ATTN")
        # "off" keeps the tier's default but disables configure_kv_cache's conversion
        owned = r.choice(
            "KVTIER_OWNED_ATTN_KV",
            "MTPLX_OWNED_ATTN_KV",
            mapping={
                "tail": "tail", "tail_owned": "tail", "1": "tail", "true": "tail",
                "on": "tail", "yes": "tail", "": "tail",
                "block": "block", "block_owned": "block",
                "ragged": "ragged", "ragged_batch": "ragged",
                "paged": "paged",
                "0": "off", "false": "off", "off": "off", "no": "off", "none": "off",
            },
            default="tail",
        )
        kv_quant = r.choice(
            "KVTIER_PAGED_KV_QUANT",
            "MTPLX_VLLM_METAL_PAGED_KV_QUANT",
            "MTPLX_PAGED_KV_QUANT",
            mapping={"off": None, "": None, "0": None, "none": None, "false": None,
                     "q8": "q8", "int8": "q8", "q4": "q4", "int4": "q4", "q4_g32": "q4_g32"},
            default=None,
        )
        # the codes are checked even while TurboQuant is off, so a typo never waits
        key_quant = r.choice(
            "KVTIER_PAGED_TURBOQUANT_K_QUANT", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_K_QUANT",
            mapping={c: c for c in TURBOQUANT_KEY_CODES}, default="q8_0",
        )
        value_quant = r.choice(
            "KVTIER_PAGED_TURBOQUANT_V_QUANT", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_V_QUANT",
            mapping={c: c for c in TURBOQUANT_VALUE_CODES}, default="q3_0",
        )
        rotate_keys = r.flag(
            "KVTIER_PAGED_TURBOQUANT_ROTATE_KEYS", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_ROTATE_KEYS"
        )
        tq = None
        if r.flag("KVTIER_PAGED_TURBOQUANT", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT"):
            tq = TurboQuantConfig(
                key_quant=key_quant, value_quant=value_quant, rotate_keys=rotate_keys
            )
        return cls(
            strategy="paged" if paged else ("tail" if owned == "off" else owned),
            enabled=paged or owned != "off",
            step=r.integer(
                "KVTIER_OWNED_ATTN_KV_STEP", "MTPLX_OWNED_ATTN_KV_STEP", default=256, minimum=1
            ),
            owned_block_size=r.integer(
                "KVTIER_OWNED_ATTN_KV_BLOCK_SIZE", "MTPLX_OWNED_ATTN_KV_BLOCK_SIZE",
                default=1024, minimum=1,
            ),
            paged_block_size=r.integer(
                "KVTIER_PAGED_BLOCK_SIZE", "MTPLX_VLLM_METAL_PAGED_BLOCK_SIZE",
                default=16, minimum=1,
            ),
            paged_num_blocks=r.integer(
                "KVTIER_PAGED_NUM_BLOCKS", "MTPLX_VLLM_METAL_PAGED_NUM_BLOCKS",
                default=1024, minimum=1,
            ),
            dynamic_paged=r.flag("KVTIER_DYNAMIC_PAGED_KV", "MTPLX_DYNAMIC_PAGED_KV"),
            dynamic_paged_tokens=r.integer(
                "KVTIER_DYNAMIC_PAGED_KV_TOKENS", "MTPLX_DYNAMIC_PAGED_KV_TOKENS",
                default=0, minimum=0,
            ),
            dynamic_paged_min_blocks=r.integer(
                "KVTIER_DYNAMIC_PAGED_KV_MIN_BLOCKS", "MTPLX_DYNAMIC_PAGED_KV_MIN_BLOCKS",
                default=None, minimum=1,
            ),
            dynamic_paged_margin=r.integer(
                "KVTIER_DYNAMIC_PAGED_KV_MARGIN", "MTPLX_DYNAMIC_PAGED_KV_MARGIN",
                default=128, minimum=0,
            ),
            previous_high_water=r.integer(
                "KVTIER_DYNAMIC_PAGED_KV_PREVIOUS_HIGH_WATER",
                "MTPLX_DYNAMIC_PAGED_KV_PREVIOUS_HIGH_WATER",
                default=0, minimum=0,
            ),
            context_window_tokens=r.integer(
                "KVTIER_CONTEXT_WINDOW_TOKENS", "MTPLX_CONTEXT_WINDOW_TOKENS",
                default=None, minimum=1,
            ),
            kv_quant=kv_quant,
            turboquant=tq,
            attention_backend=r.choice(
                "KVTIER_ATTENTION_BACKEND",
                mapping={b: b for b in ATTENTION_BACKENDS} | {"": "auto"},
                default="auto",
            ),
        )

    # -- what each tier is built with -------------------------------------------------
    def tier_params(self) -> dict[str, Any]:
        """Constructor arguments of the chosen tier (also reported by configure_kv_cache)."""
        if self.strategy == "tail":
            return {"step": self.step}
        if self.strategy == "ragged":
            return {"step": self.step, "attention_backend": self.attention_backend}
        if self.strategy == "block":
            return {"block_size": self.owned_block_size}
        return {
            "block_size": self.paged_block_size,
            "num_blocks": self.initial_paged_blocks(),
            "dynamic": self.dynamic_paged,
            "context_window_tokens": self.context_window_tokens,
            "kv_quant": self.kv_quant,
            "turboquant": self.turboquant,
            "attention_backend": self.attention_backend,
        }

    def initial_paged_blocks(self) -> int:
        """Start-up pool size: the configured count, or dynamic sizing when enabled."""
        if not self.dynamic_paged:
            return self.paged_num_blocks
        from kvtier.caches.paged import dynamic_paged_num_blocks

        return dynamic_paged_num_blocks(
            self.paged_block_size,
            self.paged_num_blocks,
            request_tokens=self.dynamic_paged_tokens or None,
            previous_high_water=self.previous_high_water,
            margin=self.dynamic_paged_margin,
            min_blocks=self.dynamic_paged_min_blocks,
        )


class _EnvReader:
    """Reads a variable or the first of its aliases that is set; errors name the variable."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def _get(self, names: tuple[str, ...]) -> tuple[str, str] | None:
        for name in names:
            if name in self.env:
                return name, self.env[name].strip()
        return None

    def flag(self, *names: str) -> bool:
        got = self._get(names)
        if got is None:
            return False
        name, raw = got
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean; use one of 1/true/yes/on or 0/false/no/off")

    def integer(self, *names: str, default: int | None, minimum: int) -> int | None:
        got = self._get(names)
        if got is None or got[1] == "":
            return default
        name, raw = got
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(
                f"{name}={raw!r} is not an integer; set it to a whole number >= {minimum}"
            ) from None
        if value < minimum:
            raise ValueError(f"{name}={raw!r} is too small; set it to a whole number >= {minimum}")
        return value

    def choice(self, *names: str, mapping: Mapping[str, Any], default: Any) -> Any:
        got = self._get(names)
        if got is None:
            return default
        name, raw = got
        key = raw.lower()
        if key not in mapping:
            accepted = ", ".join(sorted(k for k in mapping if k))
            raise ValueError(f"{name}={raw!r} is not accepted; use one of: {accepted}")
        return mapping[key]


def _tier_class(strategy: str) -> type[KVCache]:
    if strategy == "tail":
        from kvtier.caches.tail_owned import TailOwnedKVCache

        return TailOwnedKVCache
    if strategy == "block":
        from kvtier.caches.block_owned import BlockOwnedKVCache

        return BlockOwnedKVCache
    if strategy == "ragged":
        from kvtier.caches.ragged import RaggedBatchKVCache

        return RaggedBatchKVCache
    from kvtier.caches.paged import PagedKVCache

    return PagedKVCache


def make_caches(
    num_layers: int, config: KVCacheConfig | None = None, *, batch_size: int = 1
) -> list[KVCache]:
    """Fresh per-layer caches of the configured tier (``config`` defaults to the environment).

    ``batch_size`` sizes the ragged and paged tiers, whose rows are tracked one by one.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")
    config = KVCacheConfig.from_env() if config is None else config
    cls = _tier_class(config.strategy)
    params = config.tier_params()
    if config.strategy in ("ragged", "paged"):
        params["batch_size"] = batch_size
    return [cls(**params) for _ in range(num_layers)]


def configure_kv_cache(caches: list, config: KVCacheConfig | None = None) -> dict[str, Any]:
    """Replace the entries of a per-layer cache list in place with the configured tier.

    Entries that are kvtier caches are converted with ``from_cache`` (their
    contents carry over); other entries (``None``, foreign caches) are left as
    they are and counted in ``skipped``. Returns a stats dict.
    """
    if not isinstance(caches, list):
        raise ValueError(
            f"caches must be a list (it is changed in place), got {type(caches).__name__}"
        )
    config = KVCacheConfig.from_env() if config is None else config
    stats: dict[str, Any] = {
        "enabled": config.enabled,
        "mode": config.strategy,
        "entries": 0,
        "skipped": 0,
        **{k: v for k, v in config.tier_params().items() if k != "turboquant"},
    }
    if config.turboquant is not None:
        stats["turboquant"] = dataclasses.asdict(config.turboquant)
    if not config.enabled:
        stats["skipped"] = len(caches)
        return stats
    cls = _tier_class(config.strategy)
    params = config.tier_params()
    converted = []
    for i, entry in enumerate(caches):
        if isinstance(entry, KVCache):
            converted.append((i, cls.from_cache(entry, **params)))
        else:
            stats["skipped"] += 1
    for i, cache in converted:  # all conversions succeeded: now mutate the list
        caches[i] = cache
    stats["entries"] = len(converted)
    return stats


def user_cache_dir() -> Path:
    """Where converted model weights are kept: ``$KVTIER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``."""
    if os.environ.get("KVTIER_CACHE_DIR"):
        return Path(os.environ["KVTIER_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "kvtier"
