"""Prompt cache: keep a prompt's keys and values in a file and reuse them next time.

After prefill, :class:`PromptCache` saves the per-layer caches with
:func:`kvtier.caches.persist.save_cache`, with metadata naming the model source,
the tier (and its storage codecs), the K/V dtype and the token ids the caches
hold. On the next run it loads the file and, when model, tier and dtype match,
keeps the longest common prefix of the saved tokens and the new prompt (trimming
the rest), so only the remainder is prefilled. Anything that does not match is
recomputed from scratch with a warning; a missing file is simply created (in a
folder that exists: folders are never created). A path that names a directory, a
device or a FIFO (or a symlink to one) is refused when the ``PromptCache`` is made.

Example::

    >>> pc = PromptCache("prompt.safetensors", model_source=lm.source)
    >>> text = generate(lm.model, lm.tokenizer, long_prompt, prompt_cache=pc,
    ...                 cache_config=KVCacheConfig())
    >>> pc.reused          # tokens taken from the file on this run
    0
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvtier.caches.base import KVCache
from kvtier.config import KVCacheConfig, make_caches

#: the key of this module's record in the file's metadata
METADATA_KEY = "kvtier.prompt_cache"


class PromptCacheWarning(UserWarning):
    """A prompt cache file could not be used; the prompt is recomputed."""


class PromptCache:
    """A prompt-cache file bound to one model.

    ``path``: the safetensors file (created on the first save, in a folder that
    must exist). ``model_source``: a string naming the weights
    (``LoadedModel.source``); a file written for other weights is never reused.
    After :meth:`restore`, ``reused`` holds the number of prompt tokens taken from
    the file. Raises ``ValueError`` at once for a path that could never be saved to
    (see :func:`kvtier.caches.persist.check_save_path`).
    """

    def __init__(self, path: str | Path, *, model_source: str):
        from kvtier.caches.persist import check_save_path

        if not isinstance(model_source, str) or not model_source:
            raise ValueError(f"model_source must name the weights, got {model_source!r}")
        check_save_path(path)
        self.path = Path(path)
        self.model_source = model_source
        self.reused = 0
        self._saved_tokens: list[int] | None = None

    def record(self, tokens: Sequence[int], config: KVCacheConfig, dtype: torch.dtype) -> dict[str, Any]:
        """The metadata saved beside the caches (and compared on restore)."""
        return {
            "model": self.model_source,
            "tier": _tier_fingerprint(config),
            "dtype": str(dtype).removeprefix("torch."),
            "tokens": [int(t) for t in tokens],
        }

    def restore(self, model, prompt: Sequence[int], config: KVCacheConfig) -> tuple[list[KVCache], int]:
        """Caches for ``prompt`` and how many of its tokens they already hold.

        The caches hold at most ``len(prompt) - 1`` tokens (generation feeds the
        last prompt token itself). Without a usable file they are fresh and
        empty; a file that exists but does not match warns
        (:class:`PromptCacheWarning`). Restored paged caches take ``config``'s pool
        (its size, growth, window and attention backend) with the file's pages
        copied as stored: never decoded and coded again.
        """
        from kvtier.generate import model_device

        n_layers = model.args.n_layers
        param = next(model.parameters())
        fresh = lambda: make_caches(n_layers, config, batch_size=1)  # noqa: E731
        self.reused = 0
        if not self.path.exists():
            return fresh(), 0
        loaded = self._load(model_device(model))
        if loaded is None:
            return fresh(), 0
        caches, info = loaded
        want = self.record([], config, param.dtype)
        problems = [
            f"{key} {info.get(key)!r} differs from this run's {want[key]!r}"
            for key in ("model", "tier", "dtype")
            if info.get(key) != want[key]
        ]
        if len(caches) != n_layers:
            problems.append(f"it holds {len(caches)} layers, the model has {n_layers}")
        saved = info.get("tokens")
        if not isinstance(saved, list) or any(c.size() != len(saved) for c in caches):
            problems.append("its token list does not match the caches it holds")
        if problems:
            self._warn("; ".join(problems))
            return fresh(), 0
        common = _common_prefix(saved, prompt[:-1])
        if common == 0:
            self._warn("it shares no prefix with this prompt")
            return fresh(), 0
        for c in caches:
            c.trim(c.size() - common)
        caches = [_in_configured_pool(c, config) for c in caches]
        self._saved_tokens = list(saved)
        self.reused = common
        return caches, common

    def save(
        self, caches: list[KVCache], tokens: Sequence[int], config: KVCacheConfig, *, dtype: torch.dtype
    ) -> None:
        """Write ``caches`` (holding exactly ``tokens``, computed in ``dtype``) to the file,
        unless it already holds them."""
        from kvtier.caches.persist import save_cache

        tokens = [int(t) for t in tokens]
        if not tokens or tokens == self._saved_tokens:
            return
        if any(c.size() != len(tokens) for c in caches):
            raise ValueError(
                f"the caches hold {[c.size() for c in caches][:4]}... tokens, not the "
                f"{len(tokens)} tokens given; save right after prefill"
            )
        try:
            save_cache(self.path, caches, {METADATA_KEY: self.record(tokens, config, dtype)})
        except OSError as e:  # a cache is an optimisation: the generation goes on without the file
            warnings.warn(f"the prompt cache {self.path} was not saved ({e}); the generation goes on "
                          "without it", PromptCacheWarning, stacklevel=2)
            return
        self._saved_tokens = tokens

    def _load(self, device: torch.device) -> tuple[list[KVCache], dict[str, Any]] | None:
        from kvtier.caches.persist import load_cache

        try:
            caches, meta = load_cache(self.path, device=device)
        except (OSError, ValueError) as e:
            self._warn(f"it cannot be read ({e})")
            return None
        info = meta.get(METADATA_KEY) if isinstance(meta, dict) else None
        if not isinstance(info, dict):
            self._warn(f"it holds no {METADATA_KEY!r} record (not written by kvtier generate)")
            return None
        return caches, info

    def _warn(self, why: str) -> None:
        warnings.warn(
            f"prompt cache {self.path} is not reused: {why}; recomputing the prompt "
            "(the file is rewritten after prefill)",
            PromptCacheWarning,
            stacklevel=4,
        )

    def stats(self) -> dict[str, Any]:
        return {"path": str(self.path), "prompt_cache_tokens_reused": self.reused}


def _tier_fingerprint(config: KVCacheConfig) -> dict[str, Any]:
    """What decides the cache's stored contents (geometry such as step does not). A tail
    tier's ``kv_dtype`` appears only when set, so files written before it was recorded
    still match the runs that store what the model computes."""
    tq = config.turboquant
    narrow = {"kv_dtype": config.kv_dtype} if config.tier == "tail" and config.kv_dtype else {}
    return {
        "tier": config.tier,
        "kv_quant": config.kv_quant if config.tier == "paged" else None,
        "turboquant": dataclasses.asdict(tq) if tq is not None and config.tier == "paged" else None,
        **narrow,
    }


def _in_configured_pool(cache: KVCache, config: KVCacheConfig) -> KVCache:
    """A restored paged ``cache`` moved into a pool of ``config``'s (the file's pool was sized
    for the request that wrote it), its blocks copied as they are stored
    (:meth:`~kvtier.caches.paged.PagedKVCache.from_cache` of the same storage: decoding and
    coding them again would move fp8 keys and TurboQuant values, and the continuation would
    differ from the one computed from the prompt). The pool keeps the file's block size and
    is never smaller than what the restored tokens hold. Other tiers are returned as they are.
    """
    from kvtier.caches.paged import PagedKVCache

    if not isinstance(cache, PagedKVCache) or config.tier != "paged":
        return cache
    params = config.tier_params()
    bs = cache.block_size  # (another block size could not take the pages as they are)
    params.update(block_size=bs, num_blocks=math.ceil(params["num_blocks"] * params["block_size"] / bs))
    return PagedKVCache.from_cache(cache, **params)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
