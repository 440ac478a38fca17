"""Saving and restoring a :class:`~kvtier.caches.paged.PagedKVCache` exactly.

``state`` holds tensors (pages, sidecars ``k_sidecar.NAME`` / ``v_sidecar.NAME``,
block tables, free list, row lengths); ``meta_state`` the constructor arguments
and the storage in use (JSON-serialisable). :func:`paged_from_state` rebuilds
the same pool, codecs and books, so a restored cache continues identically.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvtier.caches.paged_codecs import CodecChoice, mode_codecs
from kvtier.config import TurboQuantConfig

if TYPE_CHECKING:
    from kvtier.caches.paged import PagedKVCache


def storage_facts(cache: PagedKVCache) -> dict[str, Any]:
    """The storage asked for and the storage in use (``None`` fields before the first write)."""
    c = cache.codecs
    return {
        "mode": None if c is None else c.mode,
        "kv_quant": cache.kv_quant,
        "turboquant": None if cache.turboquant is None else dataclasses.asdict(cache.turboquant),
        "turboquant_disabled_reason": None if c is None else c.turboquant_disabled_reason,
        "kv_quant_disabled_reason": None if c is None else c.kv_quant_disabled_reason,
    }


def paged_state(cache: PagedKVCache) -> dict[str, torch.Tensor]:
    """Pages, sidecars, block tables, free list and row lengths (empty before the first write)."""
    if not cache.pool.allocated:
        return {}
    rows = {"lengths": cache._lengths, "write_start": cache._write_start}
    return {**cache.pool.state(), **{k: torch.tensor(v, dtype=torch.long) for k, v in rows.items()}}


def paged_meta_state(cache: PagedKVCache) -> dict[str, Any]:
    """Constructor arguments and the storage in use (JSON-serialisable)."""
    c = cache.codecs
    return {
        "tier": cache.tier,
        "block_size": cache.block_size,
        "num_blocks": cache.num_blocks,
        "batch_size": cache.batch_size,
        "dynamic": cache.dynamic,
        "context_window_tokens": cache.context_window_tokens,
        "attention_backend": cache.attention_backend,
        "frozen": cache.frozen,
        "grow_events": cache.copy_stats.grow_events,
        "head_dim": None if c is None else c.k_codec.head_dim,
        "dtype": None if c is None else str(c.k_codec.dtype).removeprefix("torch."),
        **storage_facts(cache),
    }


def paged_from_state(cls: type[PagedKVCache], state: dict[str, torch.Tensor],
                     meta_state: dict[str, Any]) -> PagedKVCache:
    """Rebuild a cache exactly (pages, sidecars, block tables, free list, lengths)."""
    m = meta_state
    if m.get("tier") != cls.tier:
        raise ValueError(f"meta_state tier {m.get('tier')!r} is not 'paged'")
    tq = None if m["turboquant"] is None else TurboQuantConfig(**m["turboquant"])
    cache = cls(m["block_size"], m["num_blocks"], batch_size=m["batch_size"], dynamic=m["dynamic"],
                context_window_tokens=m["context_window_tokens"], kv_quant=m["kv_quant"],
                turboquant=tq, attention_backend=m["attention_backend"])
    cache.pool.frozen = bool(m["frozen"])
    cache.copy_stats.grow_events = int(m["grow_events"])
    if not state:
        return cache
    mode = m["mode"]
    k, v = mode_codecs(mode, int(m["head_dim"]), getattr(torch, m["dtype"]), tq)
    cache.pool.load(state, k, v)
    cache.codecs = CodecChoice(k, v, mode, m["turboquant_disabled_reason"], m["kv_quant_disabled_reason"])
    cache._lengths = state["lengths"].tolist()
    cache._write_start = state["write_start"].tolist()
    return cache
