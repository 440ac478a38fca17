"""Choosing a tier at run time: the module that reads the caches' settings from the environment.

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
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.caches.base import KVCache
from kvtier.kernels.dispatch import BACKENDS as ATTENTION_BACKENDS
from kvtier.quant.modes import (
    FULL_PRECISION,
    KV_QUANT_MODES,
    TURBOQUANT_KEY_CODES,
    TURBOQUANT_VALUE_CODES,
    TurboQuantConfig,
    check_kv_quant,
    check_turboquant,
    parse_kv_quant,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "ENV_VARS",
    "KV_QUANT_MODES",
    "TIERS",
    "TURBOQUANT_KEY_CODES",
    "TURBOQUANT_VALUE_CODES",
    "MAX_TOKENS",
    "EnvVar",
    "KVCacheConfig",
    "KVCacheTooLarge",
    "TurboQuantConfig",
    "configure_kv_cache",
    "env_settings",
    "make_caches",
    "user_cache_dir",
]

TIERS = ("tail", "block", "ragged", "paged")
#: what kv_dtype accepts: the tail tier's buffers narrower than the model's float32
KV_DTYPE_NAMES = ("float16", "bfloat16")
#: the most tokens any size of a config may name (a step, a block, a whole paged pool):
#: 16M, past every model's context, so 10**12 is refused before anything is allocated
MAX_TOKENS = 2**24


class KVCacheTooLarge(MemoryError):
    """The caches a config asks for could not be used or would not fit in memory; raised
    by :meth:`KVCacheConfig.check_fits` before anything is allocated."""


@dataclass(frozen=True)
class KVCacheConfig:
    """Which tier to build and with what parameters. Defaults and variables: docs/tiers.md, "Configuration by environment".

    ``kv_quant`` and ``turboquant`` name the paged tier's storage (``None``: full
    precision); their vocabulary is :mod:`kvtier.quant.modes`.
    """

    tier: str = "tail"
    step: int = 256
    #: the tail tier's stored dtype where it is narrower than the model's ("float16",
    #: "bfloat16"); None stores keys and values as the model computes them
    kv_dtype: str | None = None
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
        if self.tier not in TIERS:
            raise ValueError(
                f"tier {self.tier!r} is unknown; accepted: {', '.join(TIERS)}"
            )
        for name in ("step", "owned_block_size", "paged_block_size", "paged_num_blocks",
                     "dynamic_paged_tokens", "dynamic_paged_margin", "previous_high_water"):
            _check_size(name, getattr(self, name), 0 if name.startswith(("dynamic", "prev")) else 1)
        pool = self.paged_num_blocks * self.paged_block_size
        if pool > MAX_TOKENS:
            raise ValueError(
                f"paged_num_blocks * paged_block_size = {self.paged_num_blocks} * "
                f"{self.paged_block_size} = {pool} tokens, more than {MAX_TOKENS}; lower "
                f"{_setting('paged_block_size')} to at most {MAX_TOKENS // self.paged_num_blocks} "
                f"(with {self.paged_num_blocks} blocks), or {_setting('paged_num_blocks')} to at "
                f"most {MAX_TOKENS // self.paged_block_size} (with blocks of {self.paged_block_size} "
                "tokens)"
            )
        if self.kv_dtype is not None:
            if self.kv_dtype not in KV_DTYPE_NAMES:
                raise ValueError(
                    f"kv_dtype {self.kv_dtype!r} is unknown; accepted: {', '.join(KV_DTYPE_NAMES)}, or "
                    f"None to store what the model computes; set {_setting('kv_dtype')}"
                )
            if self.tier != "tail":
                raise ValueError(
                    f"kv_dtype={self.kv_dtype} applies to the tail tier, not {self.tier}; the paged "
                    f"tier stores narrower keys and values through {_setting('kv_quant')}"
                )
        check_kv_quant(self.kv_quant)
        check_turboquant(self.turboquant)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} is unknown; accepted: "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        for name in ("dynamic_paged_min_blocks", "context_window_tokens"):
            if getattr(self, name) is not None:
                _check_size(name, getattr(self, name), 1, "or None")
        for name in ("dynamic_paged", "enabled"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def replace(self, **changes: Any) -> KVCacheConfig:
        return dataclasses.replace(self, **changes)

    def unused_storage(self) -> str | None:
        """Why ``kv_quant`` / ``turboquant`` store nothing here (set with another tier than
        paged, as an environment that switches ``KVTIER_PAGED_ATTN`` may leave them), or
        ``None``; :func:`make_caches` and :func:`configure_kv_cache` warn with it."""
        field = "turboquant" if self.turboquant is not None else "kv_quant" if self.kv_quant else None
        if field is None or self.tier == "paged" or not self.enabled:
            return None
        return (f"{_setting(field)} stores the paged tier's pages, but the tier is {self.tier}: keys and "
                "values stay in full precision; set KVTIER_PAGED_ATTN=1 (tier='paged') to store them so")

    @property
    def per_row(self) -> bool:
        """Whether the tier keeps a length per row (ragged, paged: a
        :class:`~kvtier.caches.base.RowKVCache`), asked before any cache is built."""
        return self.tier in ("ragged", "paged")

    # -- the environment ---------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KVCacheConfig:
        """Build a config from ``env`` (default ``os.environ``): the variables of
        :data:`ENV_VARS`, listed in docs/tiers.md.

        Each ``KVTIER_*`` variable wins over its MTPLX alias; a variable that is
        unset or empty leaves the field's default. ``KVTIER_PAGED_ATTN`` truthy
        selects the paged tier whatever ``KVTIER_OWNED_ATTN_KV`` says; the latter
        set to ``0``/``false``/``off``/``no``/``none`` gives ``enabled=False``:
        :func:`configure_kv_cache` then leaves the caches it is given as they are.
        A value that cannot be parsed raises ``ValueError`` naming the variable and
        what it accepts; the TurboQuant codes are checked even while TurboQuant is
        off, so a typo never waits.

        Example::

            >>> KVCacheConfig.from_env({"MTPLX_VLLM_METAL_PAGED_ATTN": "1",
            ...                         "KVTIER_PAGED_KV_QUANT": "int8"}).kv_quant
            'q8'
        """
        got = _read_env(os.environ if env is None else env)
        tq_fields = {k.split(".", 1)[1]: got.pop(k) for k in list(got) if k.startswith("turboquant.")}
        if got.pop("turboquant", False):
            got["turboquant"] = TurboQuantConfig(**tq_fields)
        paged, owned = got.pop("paged", False), got.pop("owned", None)
        if paged:
            got["tier"] = "paged"
        elif owned == _OWNED_OFF:
            got["enabled"] = False
        elif owned is not None:
            got["tier"] = owned
        return cls(**got)

    # -- what each tier is built with -------------------------------------------------
    def tier_params(self) -> dict[str, Any]:
        """Constructor arguments of the chosen tier (also reported by configure_kv_cache)."""
        if self.tier == "tail":
            if self.kv_dtype is not None:
                return {"step": self.step, "kv_dtype": getattr(torch, self.kv_dtype)}
            return {"step": self.step}
        if self.tier == "ragged":
            return {"step": self.step, "attention_backend": self.attention_backend}
        if self.tier == "block":
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

    def first_allocation_tokens(self, batch_size: int = 1) -> int:
        """Token slots per layer (each for K and V) that a cache of this config allocates at
        its first write of one token: a step (tail, ragged), a block (block), the start-up
        pool (paged); ``batch_size`` rows of it for the per-row tiers."""
        if self.tier == "paged":
            return self.initial_paged_blocks() * self.paged_block_size
        unit = self.owned_block_size if self.tier == "block" else self.step
        return unit * batch_size

    def check_fits(self, *, context_tokens: int, bytes_per_token: int, memory_bytes: int | None,
                   batch_size: int = 1) -> None:
        """Refuse, before anything is allocated, caches that could never be used or never fit.

        ``context_tokens``: the model's context (a step or block longer than it is never
        filled); ``bytes_per_token``: K and V bytes of one token over every layer;
        ``memory_bytes``: the device's memory (``None``: unknown, not checked). Raises
        :class:`KVCacheTooLarge` naming the setting to change.

        Example::

            >>> KVCacheConfig(step=100_000).check_fits(context_tokens=8192, bytes_per_token=1,
            ...                                        memory_bytes=None)
            Traceback (most recent call last):
            kvtier.config.KVCacheTooLarge: step=100000 tokens passes the model's context of 8192 ...
        """
        unit = {"tail": "step", "ragged": "step", "block": "owned_block_size",
                "paged": "paged_block_size"}[self.tier]
        if getattr(self, unit) > context_tokens:
            raise KVCacheTooLarge(
                f"{unit}={getattr(self, unit)} tokens passes the model's context of "
                f"{context_tokens} tokens and would never be filled; set {_setting(unit)} to at "
                f"most {context_tokens} (default {_default(unit)})"
            )
        tokens = self.first_allocation_tokens(batch_size)
        need = tokens * bytes_per_token
        if memory_bytes is not None and need > memory_bytes:
            raise KVCacheTooLarge(
                f"the {self.tier} tier would allocate {tokens} tokens of keys and values "
                f"({need / 2**30:.1f} GiB) at once, more than the device's "
                f"{memory_bytes / 2**30:.1f} GiB; lower {self._first_allocation_settings(unit)}"
            )

    def _first_allocation_settings(self, unit: str) -> str:
        """The settings that size the first allocation, as a message names them."""
        if self.tier != "paged":
            return _setting(unit)
        if not self.dynamic_paged:
            return _setting("paged_num_blocks")
        return ", ".join(_setting(f) for f in ("paged_num_blocks", "dynamic_paged_min_blocks",
                                               "previous_high_water", "dynamic_paged_margin",
                                               "dynamic_paged_tokens"))

    def initial_paged_blocks(self) -> int:
        """Start-up pool size: the configured count, or dynamic sizing when enabled."""
        if not self.dynamic_paged:
            return self.paged_num_blocks
        from kvtier.caches.paged import dynamic_paged_num_blocks

        blocks = dynamic_paged_num_blocks(
            self.paged_block_size,
            self.paged_num_blocks,
            request_tokens=self.dynamic_paged_tokens or None,
            previous_high_water=self.previous_high_water,
            margin=self.dynamic_paged_margin,
            min_blocks=self.dynamic_paged_min_blocks,
        )
        if blocks * self.paged_block_size > MAX_TOKENS:
            raise ValueError(f"the dynamic pool would start at {blocks} blocks of {self.paged_block_size} "
                             f"tokens, more than {MAX_TOKENS} tokens; lower "
                             f"{self._first_allocation_settings('paged_block_size')}")
        return blocks


# -- the environment, as a table -----------------------------------------------------------------

#: a variable's parser: (variable name, its stripped non-empty text) -> value; a
#: ValueError names the variable and what it accepts
Parser = Callable[[str, str], Any]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_OWNED_OFF = "off"  # KVTIER_OWNED_ATTN_KV's "leave the caches alone"
# MTPLX's spellings of a kv_quant setting, translated to ours before parse_kv_quant
_MTPLX_KV_QUANT = {"int8": "q8", "int4": "q4", "0": FULL_PRECISION, "false": FULL_PRECISION,
                   "none": FULL_PRECISION}


def _flag(name: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use one of 1/true/yes/on or 0/false/no/off")


def switched_off(var: str) -> bool:
    """Whether the environment variable ``var`` (a switch that is on unless set) turns its
    path off: ``0``/``false``/``no``/``off``; ``ValueError`` naming it for a value that is
    not a boolean. The model's switches (``KVTIER_FUSED``, ``KVTIER_DECODE_STEP``) read here."""
    raw = os.environ.get(var)
    return raw is not None and not _flag(var, raw.strip())


def _whole(minimum: int) -> Parser:
    """A whole number of tokens or blocks in ``[minimum, MAX_TOKENS]``."""
    wanted = f"a whole number in [{minimum}, {MAX_TOKENS}]"

    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer; set it to {wanted}") from None
        if value < minimum:
            raise ValueError(f"{name}={raw!r} is too small; set it to {wanted}")
        if value > MAX_TOKENS:
            raise ValueError(f"{name}={raw!r} is too large; set it to {wanted}")
        return value

    return parse


def _check_size(name: str, v: Any, minimum: int, alternative: str = "") -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= MAX_TOKENS:
        raise ValueError(
            f"{name} must be an int in [{minimum}, {MAX_TOKENS}]{' ' + alternative if alternative else ''}, "
            f"got {v!r}; set {_setting(name)}"
        )


#: the command-line flag of a field, where there is one
_FLAGS = {"tier": "--tier", "paged_num_blocks": "--num-blocks", "dynamic_paged": "--dynamic",
          "kv_quant": "--kv-quant", "turboquant": "--turboquant", "kv_dtype": "--kv-dtype"}


def _setting(field: str) -> str:
    """How a user sets ``field``: ``"paged_num_blocks (--num-blocks, KVTIER_PAGED_NUM_BLOCKS)"``."""
    where = [_FLAGS[field]] if field in _FLAGS else []
    where += [v.names[0] for v in ENV_VARS if v.key == field]
    return f"{field} ({', '.join(where)})" if where else field


def _default(field: str) -> Any:
    return next(f.default for f in dataclasses.fields(KVCacheConfig) if f.name == field)


def _choice(mapping: Mapping[str, Any]) -> Parser:
    def parse(name: str, raw: str) -> Any:
        if raw.lower() not in mapping:
            raise ValueError(f"{name}={raw!r} is not accepted; use one of: {', '.join(sorted(mapping))}")
        return mapping[raw.lower()]

    return parse


def _kv_quant(name: str, raw: str) -> str | None:
    try:
        return parse_kv_quant(_MTPLX_KV_QUANT.get(raw.lower(), raw))
    except ValueError:
        accepted = ", ".join((FULL_PRECISION, *KV_QUANT_MODES, *_MTPLX_KV_QUANT))
        raise ValueError(f"{name}={raw!r} is not accepted; use one of: {accepted}") from None


_OWNED = _choice({
    "tail": "tail", "tail_owned": "tail", "block": "block", "block_owned": "block",
    "ragged": "ragged", "ragged_batch": "ragged", "paged": "paged",
    **dict.fromkeys(_TRUE, "tail"), **dict.fromkeys(_FALSE | {"none"}, _OWNED_OFF),
})


@dataclass(frozen=True)
class EnvVar:
    """One row of :data:`ENV_VARS`: the variable that sets ``key``, its MTPLX aliases, its parser.

    ``key`` is a :class:`KVCacheConfig` field, ``turboquant.FIELD`` (a field of
    :class:`TurboQuantConfig`), or ``paged`` / ``owned`` / ``turboquant``, the
    switches :meth:`KVCacheConfig.from_env` turns into ``tier``, ``enabled``
    and ``turboquant``.
    """

    key: str
    names: tuple[str, ...]  # the KVTIER_* name first: it wins over the aliases after it
    parse: Parser


#: every variable :meth:`KVCacheConfig.from_env` reads; defaults live on the dataclasses
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("paged", ("KVTIER_PAGED_ATTN", "MTPLX_VLLM_METAL_PAGED_ATTN"), _flag),
    EnvVar("owned", ("KVTIER_OWNED_ATTN_KV", "MTPLX_OWNED_ATTN_KV"), _OWNED),
    EnvVar("step", ("KVTIER_OWNED_ATTN_KV_STEP", "MTPLX_OWNED_ATTN_KV_STEP"), _whole(1)),
    EnvVar("kv_dtype", ("KVTIER_OWNED_ATTN_KV_DTYPE",),
           _choice({"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16",
                    "bf16": "bfloat16", "auto": None, "none": None})),
    EnvVar("owned_block_size",
           ("KVTIER_OWNED_ATTN_KV_BLOCK_SIZE", "MTPLX_OWNED_ATTN_KV_BLOCK_SIZE"), _whole(1)),
    EnvVar("paged_block_size",
           ("KVTIER_PAGED_BLOCK_SIZE", "MTPLX_VLLM_METAL_PAGED_BLOCK_SIZE"), _whole(1)),
    EnvVar("paged_num_blocks",
           ("KVTIER_PAGED_NUM_BLOCKS", "MTPLX_VLLM_METAL_PAGED_NUM_BLOCKS"), _whole(1)),
    EnvVar("dynamic_paged", ("KVTIER_DYNAMIC_PAGED_KV", "MTPLX_DYNAMIC_PAGED_KV"), _flag),
    EnvVar("dynamic_paged_tokens",
           ("KVTIER_DYNAMIC_PAGED_KV_TOKENS", "MTPLX_DYNAMIC_PAGED_KV_TOKENS"), _whole(0)),
    EnvVar("dynamic_paged_min_blocks",
           ("KVTIER_DYNAMIC_PAGED_KV_MIN_BLOCKS", "MTPLX_DYNAMIC_PAGED_KV_MIN_BLOCKS"), _whole(1)),
    EnvVar("dynamic_paged_margin",
           ("KVTIER_DYNAMIC_PAGED_KV_MARGIN", "MTPLX_DYNAMIC_PAGED_KV_MARGIN"), _whole(0)),
    EnvVar("previous_high_water",
           ("KVTIER_DYNAMIC_PAGED_KV_PREVIOUS_HIGH_WATER",
            "MTPLX_DYNAMIC_PAGED_KV_PREVIOUS_HIGH_WATER"), _whole(0)),
    EnvVar("context_window_tokens",
           ("KVTIER_CONTEXT_WINDOW_TOKENS", "MTPLX_CONTEXT_WINDOW_TOKENS"), _whole(1)),
    EnvVar("kv_quant", ("KVTIER_PAGED_KV_QUANT", "MTPLX_VLLM_METAL_PAGED_KV_QUANT",
                        "MTPLX_PAGED_KV_QUANT"), _kv_quant),
    EnvVar("turboquant", ("KVTIER_PAGED_TURBOQUANT", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT"), _flag),
    EnvVar("turboquant.key_quant",
           ("KVTIER_PAGED_TURBOQUANT_K_QUANT", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_K_QUANT"),
           _choice({c: c for c in TURBOQUANT_KEY_CODES})),
    EnvVar("turboquant.value_quant",
           ("KVTIER_PAGED_TURBOQUANT_V_QUANT", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_V_QUANT"),
           _choice({c: c for c in TURBOQUANT_VALUE_CODES})),
    EnvVar("turboquant.rotate_keys",
           ("KVTIER_PAGED_TURBOQUANT_ROTATE_KEYS", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_ROTATE_KEYS"),
           _flag),
    EnvVar("attention_backend", ("KVTIER_ATTENTION_BACKEND",),
           _choice({b: b for b in ATTENTION_BACKENDS})),
)


def env_settings(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What the environment sets: ``{key: value}`` for each row of :data:`ENV_VARS` whose
    variable is set (keys as in :class:`EnvVar`), so a caller can tell a setting the user
    made from a default. ``env`` defaults to ``os.environ``.

    Example::

        >>> env_settings({"KVTIER_PAGED_NUM_BLOCKS": "64"})
        {'paged_num_blocks': 64}
    """
    return _read_env(os.environ if env is None else env)


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    """``{key: parsed value}`` for each row of :data:`ENV_VARS` whose first set name is not empty."""
    if not isinstance(env, Mapping):
        raise TypeError(f"from_env takes a mapping of variable names to strings (as os.environ), "
                        f"got {type(env).__name__}; pass dict(...) of it")
    got = {}
    for var in ENV_VARS:
        name = next((n for n in var.names if n in env), None)
        if name is not None and not isinstance(env[name], str):
            raise ValueError(f"{name}={env[name]!r} must be a string, as environment variables are; "
                             f"pass {str(env[name])!r}")
        raw = "" if name is None else env[name].strip()
        if raw:
            got[var.key] = var.parse(name, raw)
    return got


def _tier_class(tier: str) -> type[KVCache]:
    if tier == "tail":
        from kvtier.caches.tail_owned import TailOwnedKVCache

        return TailOwnedKVCache
    if tier == "block":
        from kvtier.caches.block_owned import BlockOwnedKVCache

        return BlockOwnedKVCache
    if tier == "ragged":
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
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    config = KVCacheConfig.from_env() if config is None else config
    if (why := config.unused_storage()) is not None:
        warnings.warn(why, UserWarning, stacklevel=2)
    cls = _tier_class(config.tier)
    params = config.tier_params()
    if config.tier in ("ragged", "paged"):
        params["batch_size"] = batch_size
    return [cls(**params) for _ in range(num_layers)]


def configure_kv_cache(caches: list, config: KVCacheConfig | None = None, *,
                       batch_size: int | None = None) -> dict[str, Any]:
    """Replace the entries of a per-layer cache list in place with the configured tier.

    Entries that are kvtier caches are converted with ``from_cache`` (their
    contents carry over); other entries (``None``, foreign caches) are left as
    they are and counted in ``skipped``. Returns a stats dict. ``batch_size``: the rows
    of a paged cache converted from one that never held any (a tail cache not yet
    written); an empty cache with buffers or rows keeps its own.
    """
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
    if not isinstance(caches, list):
        raise ValueError(
            f"caches must be a list (it is changed in place), got {type(caches).__name__}"
        )
    config = KVCacheConfig.from_env() if config is None else config
    stats: dict[str, Any] = {
        "enabled": config.enabled,
        "mode": config.tier,
        "entries": 0,
        "skipped": 0,
        **{k: v for k, v in config.tier_params().items() if k != "turboquant"},
    }
    if config.turboquant is not None:
        stats["turboquant"] = dataclasses.asdict(config.turboquant)
    if not config.enabled:
        stats["skipped"] = len(caches)
        return stats
    if (why := config.unused_storage()) is not None:
        warnings.warn(why, UserWarning, stacklevel=2)
    cls = _tier_class(config.tier)
    params = config.tier_params()
    if config.tier == "paged" and batch_size is not None:
        params["batch_size"] = batch_size
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
