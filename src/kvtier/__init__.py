"""kvtier: tiered KV caches for transformer decoding.

Tiers: :class:`TailOwnedKVCache`, :class:`BlockOwnedKVCache`,
:class:`RaggedBatchKVCache`, :class:`PagedKVCache`; one environment-driven switch
(:class:`KVCacheConfig`, :func:`make_caches`, :func:`configure_kv_cache`);
persistence (:func:`save_cache`, :func:`load_cache`).
"""

from kvtier.caches.base import CacheCapacityError, KVCache
from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.paged import PagedKVCache, PagedKVGrowthRefused
from kvtier.caches.persist import load_cache, save_cache
from kvtier.caches.ragged import (
    RaggedBatchKVCache,
    restore_ragged_caches,
    restore_ragged_caches_masked,
    snapshot_ragged_caches,
)
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.quant.modes import TurboQuantConfig

_CONFIG_NAMES = ("KVCacheConfig", "configure_kv_cache", "make_caches")


def __getattr__(name: str):
    # kvtier.config sits above the caches (it builds them): it is imported on first use, so
    # importing a cache, codec or kernel never loads it (docs/architecture.md)
    if name in _CONFIG_NAMES:
        from kvtier import config

        return getattr(config, name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "BlockOwnedKVCache",
    "CacheCapacityError",
    "KVCache",
    "KVCacheConfig",
    "PagedKVCache",
    "PagedKVGrowthRefused",
    "RaggedBatchKVCache",
    "TailOwnedKVCache",
    "TurboQuantConfig",
    "configure_kv_cache",
    "load_cache",
    "make_caches",
    "restore_ragged_caches",
    "restore_ragged_caches_masked",
    "save_cache",
    "snapshot_ragged_caches",
]
