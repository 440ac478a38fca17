"""Every kvtier tier as a Hugging Face ``transformers`` Cache (needs ``transformers>=5``).

:class:`KVTierCache` is a ``transformers.Cache`` whose full-attention layers are
:class:`KVTierLayer` objects holding one kvtier tier each, chosen by a
:class:`~kvtier.config.KVCacheConfig` or, without one, by the environment exactly
as :func:`~kvtier.config.configure_kv_cache` does. Layers that the model marks as
sliding-window, chunked or linear-attention stay transformers' own layer types
(``stats()`` lists them).

Two read paths:

- gathered (any attention implementation): ``update`` returns the K/V that
  transformers' attention expects, ``[B, H_kv, S, D]`` (views for the tail tier,
  a concatenation for the block tier, a gather for the ragged and paged tiers);
- in place (``attn_implementation="kvtier_paged"`` and ``model_config`` given):
  ``update`` returns a :class:`~kvtier.integrations.hf_attention.PendingKeys`
  and the attention function asks the layer to attend through its tier's own
  read path (pages read chunk by chunk, blocks with an online softmax). Rows of a
  padded batch store only their real tokens in the ragged and paged tiers.

Example::

    from transformers import AutoModelForCausalLM
    from kvtier.integrations.hf import KVTierCache

    model = AutoModelForCausalLM.from_pretrained(path)
    out = model.generate(input_ids, past_key_values=KVTierCache(model_config=model.config),
                         max_new_tokens=64, do_sample=False)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from kvtier.caches.base import KVCache, RowKVCache, check_kv
from kvtier.caches.step_plan import StepPlanner
from kvtier.config import KVCacheConfig, make_caches
from kvtier.integrations.hf_version import TransformersVersionError, require_transformers

require_transformers()  # before transformers' own imports, so an old version gets a clear error

try:
    from transformers.cache_utils import (
        DYNAMIC_LAYER_TYPE_MAPPING,
        Cache,
        CacheLayerMixin,
        DynamicLayer,
        get_layer_types_and_kwargs,
    )
except ImportError as e:  # a 5.x release older than the layer-type API
    raise TransformersVersionError(
        f"kvtier.integrations.hf needs transformers' layer-type cache API ({e}); "
        "upgrade with: pip install -U transformers"
    ) from e

from kvtier.integrations.hf_attention import (  # noqa: E402
    ATTENTION_NAME,
    PendingKeys,
    dense_attention,
    real_new_tokens,
    register_attention,
)

__all__ = ["ATTENTION_NAME", "KVTierCache", "KVTierLayer", "TransformersVersionError", "cache_kwarg"]

register_attention()

def cache_kwarg(model) -> str:
    """The keyword under which ``model.generate`` takes a cache: ``"cache"`` in recent
    transformers 5.x, ``"past_key_values"`` before (still accepted, with a warning, until 6.0)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _PaddingProbe:
    """Which new tokens of one forward are real; computed once per mask and shared by the layers."""

    def __init__(self) -> None:
        self._mask: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self._real: torch.Tensor | None = None

    def real_tokens(self, mask: torch.Tensor | None, past: int, new: int) -> torch.Tensor | None:
        if mask is None:
            return None
        if mask is not self._mask or self._key != (past, new):
            self._mask, self._key = mask, (past, new)
            self._real = real_new_tokens(mask, past, new)
        return self._real


class _DecodePlans:
    """One step plan per decode step, shared by the in-place ragged or paged layers of one cache.

    A decode step writes one token per row into every layer at the same positions,
    so the first layer books the step once (a
    :class:`~kvtier.caches.step_plan.StepPlanner`) and every layer writes and reads
    with the plan's device tensors: no per-layer host books, slots or copies to the
    device. Anything else (a prefill, a padded write, ``crop``, a row selection)
    is written unplanned and ends the plan; the next decode step plans anew.
    """

    def __init__(self, layers: Callable[[], list[KVTierLayer]]) -> None:
        self._layers = layers  # the in-place layers are fixed once a forward reaches them
        self._order: list[KVTierLayer] | None = None
        self.planner: StepPlanner | None = None
        self._kwargs: dict[str, Any] = {}
        self.planned_steps = 0

    def close(self) -> None:
        if self.planner is not None:
            self.planner.close()
        self.planner, self._kwargs = None, {}

    def kwargs(self, layer: KVTierLayer, new_tokens: int) -> dict[str, Any]:
        """The ``update`` keywords of ``layer``'s write of ``new_tokens`` real tokens per row."""
        if self._order is None:
            self._order = self._layers()
        layers = self._order
        if layer is layers[0]:  # the first layer of a forward plans the step for all
            self._kwargs = self._prepare(layers) if new_tokens == 1 else {}
            if not self._kwargs:
                self.close()
        return self._kwargs

    def _prepare(self, layers: list[KVTierLayer]) -> dict[str, Any]:
        tiers = [layer.tier for layer in layers]
        if any(not isinstance(t, RowKVCache) or t.empty() or not layer.in_place
               for t, layer in zip(tiers, layers)):
            return {}
        p = self.planner
        if p is not None and (p.plan is None or not p.plan.valid or len(p.caches) != len(tiers)
                              or any(a is not b for a, b in zip(p.caches, tiers))):
            self.close()  # a cache was changed outside the plan, or replaced
        if self.planner is None:
            view = tiers[0].block_table_view()
            ahead = 256 if view is None else view.block_size  # a pooled tier: one block at a time
            try:
                self.planner = StepPlanner(tiers, reserve_tokens=ahead)
            except ValueError:  # layers that were written differently: each books its own writes
                return {}
        self.planned_steps += 1
        return self.planner.prepare()


def _tokens_to_remove(n: int, length: int) -> int:
    """``crop`` argument to a count: ``-k`` removes ``k`` tokens, ``k > 0`` keeps the first ``k``."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"crop() takes an int, got {n!r}")
    if n < 0:
        return min(-n, length)
    return max(length - n, 0) if n > 0 else 0


class KVTierLayer(CacheLayerMixin):
    """One attention layer's keys and values, held by a kvtier tier built on the first update.

    ``length`` counts positions as transformers does (padding included); the
    tier is built by :func:`~kvtier.config.make_caches` with the batch size of
    the first update.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(
        self,
        config: KVCacheConfig,
        reads_in_place: Callable[[], bool],
        probe: _PaddingProbe | None = None,
        plans: _DecodePlans | None = None,
    ):
        super().__init__()
        self.config = config
        self._reads_in_place = reads_in_place
        self._probe = probe or _PaddingProbe()
        self._plans = plans or _DecodePlans(lambda: [self])
        self.tier: KVCache | None = None
        self.length = 0
        self.trimmed = 0  # tokens dropped by crop() (rejected drafts of assisted generation)
        self.in_place = False
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def rows(self) -> bool:
        """Whether the tier keeps a length per row (a :class:`~kvtier.caches.base.RowKVCache`)."""
        return isinstance(self.tier, RowKVCache)

    def _new_tier(self, batch_size: int) -> KVCache:
        return make_caches(1, self.config, batch_size=batch_size)[0]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size = key_states.shape[0]
        self.tier = self._new_tier(self.batch_size)
        self.in_place = self._reads_in_place()
        self.is_initialized = True

    # -- writes ---------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, H_kv, T, D]`` keys and values; return what the attention function reads.

        Gathered path: the layer's K/V ``[B, H_kv, length, D]``. In place: a
        :class:`PendingKeys` and the new values (the ragged and paged tiers write
        at attention time, when the mask tells real tokens from padding).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:
            raise ValueError(
                "a kvtier layer got a second update before its attention ran; the model's "
                "attention must be 'kvtier_paged' while the cache reads in place "
                "(call cache.reset() after changing attn_implementation)"
            )
        in_place = self._reads_in_place()
        if in_place != self.in_place:
            if self.length:
                raise ValueError(
                    f"the model's attention implementation changed (in place: {self.in_place} -> "
                    f"{in_place}) while the cache holds {self.length} tokens; call cache.reset() "
                    "or use a new KVTierCache"
                )
            self.in_place = in_place
        if self.in_place and self.rows:
            check_kv(key_states, value_states, batch=self.batch_size)
            self._pending = (key_states, value_states)
        else:
            self.tier.update(key_states, value_states)
        self.length += key_states.shape[2]
        if self.in_place:
            return PendingKeys.wrap(key_states, self), value_states
        return self._gathered()

    def _gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.tier.fetch()
        if self.rows:  # (B, H_kv, >= length, D): rows move in lock step on this path
            k, v = k[:, :, : self.length], v[:, :, : self.length]
        return k, v

    # -- in-place attention ---------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        scaling: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention ``[B, H_q, T, D]`` of ``query`` ``[B, H_q, T, D]`` through the tier's read path.

        ``mask`` is transformers' boolean ``[B, 1, T, length]`` mask or ``None``
        (plain causal). Without padding among the new tokens and without a
        softcap, the tier's own ``attention`` reads its storage in place; a padded
        prefill or a softcap model reads a gathered copy of the layer once.
        """
        if self._pending is None:  # scalar tiers stored the tokens in update()
            if mask is None and softcap is None:
                return self.tier.attention(query, scale=scaling)
            k, v = self.tier.fetch()
            return dense_attention(query, k, v, mask, scaling=scaling, softcap=softcap)
        keys, values = self._pending
        self._pending = None
        T = keys.shape[2]
        try:
            real = self._probe.real_tokens(mask, self.length - T, T)
            if real is None:
                self.tier.update(keys, values, **self._plans.kwargs(self, T))
                if softcap is None:
                    return self.tier.attention(query, scale=scaling)
                pos = self.tier.offset[:, None] - T + torch.arange(T, device=keys.device)
            else:
                self._plans.kwargs(self, 0)  # an unplanned write: the plan ends
                pos = self._write_real(keys, values, real)
        except Exception:
            self.length -= T  # nothing reached the tier (it validates before it writes)
            raise
        k, v = self.tier.fetch()  # (B, H_kv, max row length, D)
        visible = torch.arange(k.shape[2], device=k.device) <= pos[:, :, None]  # (B, T, S)
        return dense_attention(query, k, v, visible[:, None], scaling=scaling, softcap=softcap)

    def _write_real(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Store only the real new tokens of each row; return each query's last visible position.

        ``real`` is ``[B, T]``. Row ``r``'s real tokens are written in order at its
        own length; a real query sees up to itself, a padding query up to the real
        token before it (what transformers' padding mask shows it).
        """
        real = real.to(keys.device)
        # (B,) on the tokens' device; a clone, since the ragged tier updates its offsets in place
        start = self.tier.offset.to(keys.device).clone()
        order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real tokens first
        idx = order[:, None, :, None]  # (B, 1, T, 1)
        k = keys.gather(2, idx.expand(-1, keys.shape[1], -1, keys.shape[3]))
        v = values.gather(2, idx.expand(-1, values.shape[1], -1, values.shape[3]))
        self.tier.update(k, v, write_start=start, new_offsets=start + real.sum(1))
        return start[:, None] + real.cumsum(1) - 1  # (B, T)

    # -- lengths --------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens: ``crop(-k)`` removes ``k``; ``crop(k)``, ``k > 0``, keeps ``k``."""
        n = _tokens_to_remove(tokens_to_remove, self.length)
        if n and self.tier is not None:
            self.tier.trim(n)
            self.length -= n
            self.trimmed += n

    def reset(self) -> None:
        self.tier, self.length, self._pending = None, 0, None
        self.is_initialized = False

    # -- rows -------------------------------------------------------------------------------------
    def _select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows`` (int64 ``[B']``, repeats allowed) in that order."""
        if self.tier is None:
            return
        picked = rows.tolist()
        if self.rows and len(set(picked)) == len(picked) and self.length:
            self.tier.filter(picked)
        elif self.length == 0:
            self.tier = self._new_tier(len(picked))
        else:
            k, v = self.tier.fetch()
            rows = rows.to(k.device)
            tier = self._new_tier(len(picked))
            if self.rows:
                lengths = self.tier.offset.index_select(0, rows)
                n = int(lengths.max())
                tier.update(k[rows, :, :n], v[rows, :, :n], write_start=0, new_offsets=lengths)
            else:
                tier.update(k[rows], v[rows])
            self.tier = tier
        self.batch_size = len(picked)

    def _row_index(self, indices) -> torch.Tensor:
        return torch.arange(self.batch_size)[torch.as_tensor(indices).cpu()].reshape(-1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.tier is not None:
            self._select_rows(self._row_index(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.tier is not None:
            self._select_rows(self._row_index(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.tier is not None:
            self._select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    # -- figures --------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return 0 if self.tier is None else self.tier.nbytes

    def stats(self) -> dict[str, Any]:
        if self.tier is None:
            return {"tier": self.config.tier, "initialized": False}
        return {**self.tier.stats(), "hf_length": self.length, "in_place": self.in_place,
                "trimmed": self.trimmed}


class KVTierCache(Cache):
    """A ``transformers.Cache`` whose full-attention layers are kvtier tiers.

    Args:
        config: the tier and its parameters; ``None`` reads the environment
            (:meth:`KVCacheConfig.from_env`). ``config.enabled=False`` gives
            transformers' own ``DynamicLayer`` everywhere.
        model_config: the model's config. With it, sliding-window, chunked and
            linear-attention layers stay transformers' own layer types, and a model
            whose attention is ``"kvtier_paged"`` reads the tiers in place. Without
            it every layer is a kvtier layer (correct for any model: sliding layers
            then keep their whole history) and attention reads gathered K/V.

    Example::

        cache = KVTierCache(KVCacheConfig(tier="paged", kv_quant="q8"),
                            model_config=model.config)
        model.set_attn_implementation("kvtier_paged")      # optional: read pages in place
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
        cache.stats()["attention"]                           # 'in place (kvtier_paged)'
    """

    def __init__(self, config: KVCacheConfig | None = None, *, model_config=None):
        config = KVCacheConfig.from_env() if config is None else config
        if not isinstance(config, KVCacheConfig):
            raise ValueError(
                f"config must be a kvtier KVCacheConfig or None, got {type(config).__name__}; "
                "pass the model's config as model_config=model.config"
            )
        self.kv_config = config
        self.model_config = model_config
        self._text_config = None
        self._probe = _PaddingProbe()
        self._plans = _DecodePlans(lambda: self.kvtier_layers)
        self.hf_layer_types: dict[int, str] = {}  # layer index -> transformers layer type kept
        if model_config is None:
            replicate = self._new_layer if config.enabled else DynamicLayer
            super().__init__(layer_class_to_replicate=replicate)
            return
        types, per_layer = get_layer_types_and_kwargs(model_config.get_text_config(decoder=True))
        if isinstance(per_layer, dict):  # transformers < 5.2x: one kwargs dict for every layer
            per_layer = [per_layer] * len(types)
        layers = []
        for i, (kind, kwargs) in enumerate(zip(types, per_layer)):
            if kind == "full_attention" and config.enabled:
                layers.append(self._new_layer())
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
                self.hf_layer_types[i] = kind
        super().__init__(layers=layers)

    def _new_layer(self) -> KVTierLayer:
        return KVTierLayer(self.kv_config, self._reads_in_place, self._probe, self._plans)

    def _reads_in_place(self) -> bool:
        """Whether the model's attention is ``kvtier_paged`` (read at every update)."""
        if self.model_config is None:
            return False
        if self._text_config is None:  # the same object for the model's life: look it up once
            self._text_config = self.model_config.get_text_config(decoder=True)
        return self._text_config._attn_implementation == ATTENTION_NAME

    @property
    def kvtier_layers(self) -> list[KVTierLayer]:
        return [layer for layer in self.layers if isinstance(layer, KVTierLayer)]

    def get_max_length(self, layer_idx: int | None = None) -> int:
        if not self.layers:
            return -1
        return super().get_max_length(layer_idx)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """The older name of :meth:`get_max_length` (``-1``: no maximum)."""
        return self.get_max_length(layer_idx)

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer: kvtier tiers (payload and sidecars) and transformers layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, KVTierLayer):
                total += layer.nbytes
            else:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        total += t.numel() * t.element_size()
        return total

    def stats(self) -> dict[str, Any]:
        """A plain dict: the tier, the read path, kept transformers layers, bytes and copy counters."""
        mine = self.kvtier_layers
        notes = []
        if self.hf_layer_types:
            kinds = sorted(set(self.hf_layer_types.values()))
            notes.append(
                f"layers {sorted(self.hf_layer_types)} are {', '.join(kinds)}: kept as "
                "transformers' own layer types"
            )
        if self.model_config is None:
            notes.append(
                "no model_config: every layer is a kvtier layer and attention reads gathered K/V; "
                "pass model_config=model.config to keep sliding/linear layers and read in place"
            )
        in_place = any(layer.in_place for layer in mine) or (not mine and self._reads_in_place())
        counters = {"updates": 0, "bytes": 0, "time_s": 0.0, "grow_events": 0, "trimmed": 0}
        for layer in mine:
            s = layer.stats()
            for name in counters:
                counters[name] += s.get(name, 0)
        params = self.kv_config.tier_params() if self.kv_config.enabled else {}
        if params.get("turboquant") is not None:
            params["turboquant"] = vars(params["turboquant"]).copy()
        first = next((layer for layer in mine if layer.tier is not None), None)
        return {
            "enabled": self.kv_config.enabled,
            "tier": self.kv_config.tier,
            "params": params,
            "attention": f"in place ({ATTENTION_NAME})" if in_place else "gathered K/V",
            "kvtier_layers": len(mine),
            "hf_layers": dict(self.hf_layer_types),
            "notes": notes,
            "seq_length": self.get_seq_length() if self.layers else 0,
            "nbytes": self.nbytes,
            **counters,
            "planned_steps": self._plans.planned_steps,
            "tier_stats": None if first is None else first.stats(),
        }
