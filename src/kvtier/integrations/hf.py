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

What ``DynamicCache`` offers works the same way: ``cache.layers[i].keys`` /
``.values`` are the layer's live tokens ``[B, H_kv, T, D]`` read from the tier
(read only; :meth:`KVTierLayer.live`), iteration yields ``(keys, values,
sliding_window_tensor)`` per layer, ``len(cache)`` counts layers, ``crop`` follows
``DynamicCache.crop`` (``-k`` removes, a positive value raises ``ValueError``) and
``copy.deepcopy`` gives an independent cache that shares the model's config. The
layer class lives in :mod:`kvtier.integrations.hf_layer`.

Example::

    from transformers import AutoModelForCausalLM
    from kvtier.integrations.hf import KVTierCache

    model = AutoModelForCausalLM.from_pretrained(path)
    out = model.generate(input_ids, past_key_values=KVTierCache(model_config=model.config),
                         max_new_tokens=64, do_sample=False)
"""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import torch

from kvtier.config import KVCacheConfig
from kvtier.integrations.hf_version import TransformersVersionError, require_transformers

require_transformers()  # before transformers' own imports, so an old version gets a clear error

try:
    from transformers.cache_utils import (
        DYNAMIC_LAYER_TYPE_MAPPING,
        Cache,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        get_layer_types_and_kwargs,
    )
except ImportError as e:  # a 5.x release older than the layer-type API
    raise TransformersVersionError(
        f"kvtier.integrations.hf needs transformers' layer-type cache API ({e}); "
        "upgrade with: pip install -U transformers"
    ) from e

from kvtier.integrations.hf_attention import ATTENTION_NAME, register_attention  # noqa: E402
from kvtier.integrations.hf_layer import DecodePlans, KVTierLayer, PaddingProbe, crop_count  # noqa: E402

__all__ = ["ATTENTION_NAME", "KVTierCache", "KVTierLayer", "TransformersVersionError", "cache_kwarg"]

register_attention()


def cache_kwarg(model) -> str:
    """The keyword under which ``model.generate`` and the model's forward take a cache:
    ``"cache"`` from transformers 5.24, ``"past_key_values"`` before (still accepted there
    with a ``FutureWarning``: by ``generate`` until 6.0, by a model's forward until 5.40)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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
                f"config must be a kvtier KVCacheConfig or None, got {type(config).__name__}; build "
                "one (KVCacheConfig(tier='paged', ...)), and pass the model's own config as "
                "model_config=model.config"
            )
        if model_config is not None and not hasattr(model_config, "get_text_config"):
            raise ValueError(f"model_config must be a transformers model config (model.config) or None, "
                             f"got {type(model_config).__name__}")
        self.kv_config = config
        self.model_config = model_config
        self._text_config = None
        self._probe = PaddingProbe()
        self._plans = DecodePlans(self._planned_layers)
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
        if config.enabled and not any(isinstance(layer, KVTierLayer) for layer in layers):
            kinds = ", ".join(sorted(set(types)))
            warnings.warn(f"no layer of this model is full attention (its layers are {kinds}), so every "
                          f"layer stays transformers' own and the {config.tier} tier stores nothing; "
                          "without model_config every layer would be a kvtier layer (sliding layers "
                          "then keep their whole history)", UserWarning, stacklevel=2)
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

    def __deepcopy__(self, memo: dict) -> KVTierCache:
        """A copy holding copies of every layer's tokens; the model's config is shared, not
        copied, so the copy follows the model's attention implementation as this one does
        (the pattern of a prompt cache deep-copied for each prompt)."""
        for shared in (self.model_config, self._text_config):
            if shared is not None:
                memo[id(shared)] = shared
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def _planned_layers(self) -> list[KVTierLayer]:  # a method, not a lambda: copy.deepcopy rebinds it
        return self.kvtier_layers

    # -- what DynamicCache offers ------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update``. A layer of transformers' own (a sliding layer of Gemma-2) is written
        only if the kvtier layers would take the update too (``KVTierLayer.check_update``: in
        place, keys that require grad, or an attention implementation changed with tokens
        held, are refused), so that such a refusal at a forward's first layer changes nothing."""
        if layer_idx < len(self.layers) and not isinstance(self.layers[layer_idx], KVTierLayer):
            mine = self.kvtier_layers
            if mine:
                mine[0].check_update(key_states, value_states, self._reads_in_place())
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def __iter__(self):
        """Each layer's ``(keys, values, sliding_window_tensor)``, as ``DynamicCache`` yields them.

        ``keys`` / ``values`` are ``[B, H_kv, T, D]`` (:meth:`KVTierLayer.live` for a kvtier
        layer, ``None`` for a layer not written yet); the third item is a sliding layer's
        window as a tensor, else ``None``. So ``DynamicCache(ddp_cache_data=cache)`` copies
        this cache into a ``DynamicCache``, and ``for k, v, _ in cache`` walks the layers.
        """
        for layer in self.layers:
            if isinstance(layer, KVTierLayer):
                k, v = layer.live()  # one read of the tier for both (a paged layer gathers)
            else:
                k, v = layer.keys, layer.values
            window = layer._sliding_window_tensor if isinstance(layer, DynamicSlidingWindowLayer) else None
            yield k, v, window

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-k)`` drops every layer's ``k`` newest tokens, as ``DynamicCache.crop`` does.

        ``crop(0)`` changes nothing in a kvtier layer (a kept sliding layer trims its
        window back); a positive value raises ``ValueError``, as in ``DynamicCache``, and
        is checked before any layer changes; ``-k`` past the length empties the layer. A
        cache with no layer yet (built without ``model_config``, before the first update)
        has nothing to crop and, like ``DynamicCache()``, checks nothing. Every kvtier
        layer's limit (in place, right padding) is checked before any layer changes.
        """
        if self.layers:
            crop_count(tokens_to_remove, 0)  # validate once, before the first layer changes
            for layer in self.kvtier_layers:
                layer.crop_count(tokens_to_remove)
        super().crop(tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices``; a selection of no rows raises ``ValueError`` before any layer changes."""
        for layer in self.kvtier_layers:
            layer.rows_kept("batch_select_indices", indices)
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times; ``0`` raises ``ValueError`` before any layer changes."""
        for layer in self.kvtier_layers:
            layer.rows_kept("batch_repeat_interleave", repeats=repeats)
        super().batch_repeat_interleave(repeats)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows in the order of ``beam_idx``; an empty index raises ``ValueError`` before any layer changes."""
        for layer in self.kvtier_layers:
            layer.rows_kept("reorder_cache", beam_idx)
        super().reorder_cache(beam_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        if not self.layers:
            return -1
        return super().get_max_length(layer_idx)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """The older name of :meth:`get_max_length` (``-1``: no maximum; a paged pool that does
        not grow gives the positions each row can reach)."""
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
        in_place = bool(mine) and (any(layer.in_place for layer in mine) or self._reads_in_place())
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
