"""kvtier: tiered KV caches for transformer decoding.

Tiers: :class:`TailOwnedKVCache`, :class:`BlockOwnedKVCache`,
:class:`RaggedBatchKVCache`, :class:`PagedKVCache`; one environment-driven switch
(:class:`KVCacheConfig`, :func:`make_caches`, :func:`configure_kv_cache`).
"""

from kvtier.caches.base import CacheCapacityError, KVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.config import KVCacheConfig, TurboQuantConfig, configure_kv_cache, make_caches

__version__ = "0.1.0"

__all__ = [
    "CacheCapacityError",
    "KVCache",
    "KVCacheConfig",
    "TailOwnedKVCache",
    "TurboQuantConfig",
    "configure_kv_cache",
    "make_caches",
]
