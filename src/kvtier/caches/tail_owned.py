"""TailOwnedKVCache: one contiguous buffer that grows in multiples of ``step``.

Each update copies only the new tokens into the buffer; growth copies the live
prefix ``[0:offset]`` once per ``step`` tokens at most.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvtier.caches.base import (
    CopyStats,
    CopyTimer,
    KVCache,
    check_kv,
    check_queries,
    check_trim,
    tensor_nbytes,
)
from kvtier.kernels.reference import causal_attention


class TailOwnedKVCache(KVCache):
    """Contiguous ``[B, H_kv, capacity, D]`` K and V buffers, capacity a multiple of ``step``.

    Example::

        cache = TailOwnedKVCache(step=256)
        K, V = cache.update_and_fetch(k, v)   # k, v: (B, H_kv, T, D); K: views (B, H_kv, offset, D)
        out = cache.attention(q)              # q: (B, H_q, T, D)
    """

    tier = "tail"

    def __init__(self, step: int = 256):
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
            raise ValueError(f"step must be a positive int, got {step!r}")
        self.step = step
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._offset = 0
        self.copy_stats = CopyStats()

    # -- storage ----------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(self, needed: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """Reallocate to ``ceil(needed / step) * step`` slots, copying ``[0:offset]`` once."""
        cap = math.ceil(needed / self.step) * self.step
        B, H, _, Dk = like_k.shape
        new_k = like_k.new_zeros(B, H, cap, Dk)
        new_v = like_v.new_zeros(B, H, cap, like_v.shape[3])
        if self.keys is not None and self._offset:
            new_k[:, :, : self._offset] = self.keys[:, :, : self._offset]
            new_v[:, :, : self._offset] = self.values[:, :, : self._offset]
        self.keys, self.values = new_k, new_v
        self.copy_stats.grow_events += 1

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        check_kv(keys, values, self.keys)
        T = keys.shape[2]
        end = self._offset + T
        if end > self.capacity:
            self._grow(end, keys, values)
        with CopyTimer(self.copy_stats, tensor_nbytes(keys, values)):
            self.keys[:, :, self._offset : end] = keys
            self.values[:, :, self._offset : end] = values
        self._offset = end

    def fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            raise ValueError("the cache is empty; call update() first")
        return self.keys[:, :, : self._offset], self.values[:, :, : self._offset]

    def attention(self, queries: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        if self.keys is None:
            raise ValueError("attention() on an empty cache; call update() first")
        check_queries(queries, self.keys.shape[1], self.keys.shape[3])
        k, v = self.fetch()
        return causal_attention(queries, k, v, scale=scale)

    # -- bookkeeping --------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self._offset

    def size(self) -> int:
        return self._offset

    def trim(self, n: int) -> int:
        n = min(check_trim(n), self._offset)
        self._offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.keys, self.values)

    def stats(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "offset": self._offset,
            "capacity": self.capacity,
            "step": self.step,
            "nbytes": self.nbytes,
            **self.copy_stats.as_dict(),
        }

    def tail_owner_stats(self) -> dict[str, Any]:
        """The seed's name for the copy counters."""
        s = self.copy_stats
        return {
            "tail_owner_updates": s.updates,
            "tail_owner_bytes": s.bytes,
            "tail_owner_time_s": s.time_s,
            "tail_owner_grow_events": s.grow_events,
        }

    # -- persistence ----------------------------------------------------------------
    @property
    def state(self) -> dict[str, torch.Tensor]:
        if self.keys is None:
            return {}
        k, v = self.fetch()
        return {"keys": k.contiguous(), "values": v.contiguous()}

    @property
    def meta_state(self) -> dict[str, Any]:
        return {"tier": self.tier, "step": self.step, "offset": self._offset}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], meta_state: dict[str, Any]) -> TailOwnedKVCache:
        cache = cls(step=int(meta_state["step"]))
        if state:
            if state["keys"].shape[2] != int(meta_state["offset"]):
                raise ValueError(
                    f"state holds {state['keys'].shape[2]} tokens but meta_state says "
                    f"offset {meta_state['offset']}; the file is inconsistent"
                )
            cache.update(state["keys"], state["values"])
        return cache

    @classmethod
    def from_cache(cls, other: KVCache, *, step: int = 256) -> TailOwnedKVCache:
        cache = cls(step=step)
        if other.size() > 0:
            cache.update(*other.fetch())
        return cache
