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
    ScalarKVCache,
    allocating,
    check_kv,
    check_queries,
    check_window,
    exclusive,
    fetch_taken,
    tensor_nbytes,
)
from kvtier.caches.state_checks import (
    check_state_args,
    check_state_kv,
    check_unit,
    meta_dtype,
    read_meta_ints,
    restore_slack,
)
from kvtier.kernels.reference import causal_attention, window_start


def live_kv(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The live K/V ``[B, H_kv, n, D]`` of a cache of any tier, or ``None`` when it holds nothing,
    in the dtype the cache takes (a tail cache's ``kv_dtype`` storage widened back, exactly).

    Tiers with per-row lengths (``offset`` a ``[B]`` tensor) qualify only when
    every row holds the same ``n`` tokens; otherwise a ``ValueError`` says so,
    since a scalar-offset tier cannot hold rows of different lengths.
    """
    off = cache.offset
    if isinstance(off, torch.Tensor):
        lengths = off.reshape(-1).tolist()
        if min(lengths) != max(lengths):
            raise ValueError(
                f"rows hold different lengths {lengths}; a tier with one offset cannot hold "
                "them: trim the rows to one length first, or keep a per-row tier"
            )
        n = int(lengths[0])
    else:
        n = int(off)
    if n == 0:
        return None
    k, v = fetch_taken(cache)
    return k[:, :, :n], v[:, :, :n]


def check_query_rows(queries: torch.Tensor, batch: int, offset: int) -> None:
    """Queries must match the cache's batch and be no more than the tokens it holds."""
    if queries.shape[0] != batch:
        raise ValueError(f"queries batch {queries.shape[0]} differs from the cache's {batch}")
    if queries.shape[2] > offset:
        raise ValueError(
            f"{queries.shape[2]} queries but the cache holds {offset} tokens; call update() "
            "with the same tokens' keys and values before attention()"
        )


#: what ``kv_dtype`` may name: keys and values stored narrower than they are computed
KV_STORAGE_DTYPES = (torch.float16, torch.bfloat16)


def _meta_dtype(meta_state: dict[str, Any], name: str) -> torch.dtype | None:
    """``meta_state[name]`` as :func:`~kvtier.caches.state_checks.meta_dtype` reads it, or
    ``None`` where it is absent or ``None``."""
    return None if meta_state.get(name) is None else meta_dtype(meta_state, name)


class TailOwnedKVCache(ScalarKVCache):
    """Contiguous ``[B, H_kv, capacity, D]`` K and V buffers, capacity a multiple of ``step``.

    ``kv_dtype`` (``torch.float16`` or ``torch.bfloat16``; default ``None``: the dtype of the
    keys written) stores keys and values narrower than the model computes them: ``update``
    takes the model's keys and values (float32, say) and rounds them into the buffers,
    ``attention`` takes queries of that dtype and reads the buffers back in it, and
    ``fetch`` returns the stored views. Half the bytes a step reads at long contexts on the
    CPU (the one-call decode step reads float16 rows as they are; ``docs/model.md``).

    Example::

        cache = TailOwnedKVCache(step=256)
        K, V = cache.update_and_fetch(k, v)   # k, v: (B, H_kv, T, D); K: views (B, H_kv, offset, D)
        out = cache.attention(q)              # q: (B, H_q, T, D)
        half = TailOwnedKVCache(kv_dtype=torch.float16)  # float32 k, v, q; float16 buffers
    """

    tier = "tail"

    def __init__(self, step: int = 256, *, kv_dtype: torch.dtype | None = None):
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
            raise ValueError(f"step must be a positive int, got {step!r}")
        if kv_dtype is not None and kv_dtype not in KV_STORAGE_DTYPES:
            raise ValueError(
                f"kv_dtype must be None (store what is written) or one of "
                f"{', '.join(map(str, KV_STORAGE_DTYPES))}, got {kv_dtype!r}"
            )
        self.step = step
        self.kv_dtype = kv_dtype
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        #: the dtype of the keys, values and queries the cache takes (the buffers' own unless kv_dtype)
        self.dtype: torch.dtype | None = None
        self._offset = 0
        self.copy_stats = CopyStats()

    # -- storage ----------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(self, needed: int, like_k: torch.Tensor, like_v: torch.Tensor, cap: int | None = None) -> None:
        """Reallocate to ``cap`` slots (default ``ceil(needed / step) * step``), copying
        ``[0:offset]`` once.

        The slots past ``offset`` are left uninitialised: nothing reads past ``offset``.
        """
        cap = math.ceil(needed / self.step) * self.step if cap is None else cap
        B, H, _, Dk = like_k.shape
        if self.dtype is None:
            self.dtype = like_k.dtype
        store = self.kv_dtype or like_k.dtype
        with allocating(self, f"{cap} positions", "write fewer tokens, or free memory"):
            new_k = like_k.new_empty(B, H, cap, Dk, dtype=store)
            new_v = like_v.new_empty(B, H, cap, like_v.shape[3], dtype=store)
        if self.keys is not None and self._offset:
            new_k[:, :, : self._offset] = self.keys[:, :, : self._offset]
            new_v[:, :, : self._offset] = self.values[:, :, : self._offset]
        self.keys, self.values = new_k, new_v
        self.copy_stats.grow_events += 1

    @exclusive
    def update(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values`` ``[B, H_kv, T, D]`` (copied; the caller's tensors are not kept)."""
        keys, values = check_kv(keys, values, self.keys, dtype=self.dtype)
        T = keys.shape[2]
        end = self._offset + T
        self.make_room(T, keys, values)
        stored = (keys.numel() + values.numel()) * self.keys.element_size()
        with CopyTimer(self.copy_stats, stored):
            self.keys[:, :, self._offset : end] = keys
            self.values[:, :, self._offset : end] = values
        self._offset = end

    @exclusive
    def make_room(self, tokens: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """Grow, as :meth:`update` does, so that ``tokens`` more positions fit; ``like_k`` /
        ``like_v`` ``[B, H_kv, *, D]`` give the buffers' shape and dtype when there are none yet.
        ``ValueError`` for a count that is not an int >= 1, as :meth:`commit_written` checks its own."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"make_room({tokens!r}) takes an int >= 1, the positions a write needs past "
                             "the offset")
        if self._offset + tokens > self.capacity:
            self._grow(self._offset + tokens, like_k, like_v)

    def commit_written(self, tokens: int) -> None:
        """Take ``tokens`` positions a caller wrote in place at ``[offset, offset + tokens)`` of
        :attr:`keys` / :attr:`values` (after :meth:`make_room`; the one-call CPU decode step,
        :mod:`kvtier.model.cpu_step`), booked as :meth:`update` books a copy, without its time.
        ``ValueError`` for a count that is not an int in ``[1, capacity - offset]``."""
        room = self.capacity - self._offset
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= room:
            raise ValueError(f"commit_written({tokens!r}) takes an int in [1, {room}], the positions "
                             "make_room() left past the offset; call make_room() first")
        B, H, _, D = self.keys.shape
        self.copy_stats.updates += 1
        self.copy_stats.bytes += tokens * B * H * (D + self.values.shape[3]) * self.keys.element_size()
        self._offset += tokens

    def fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[B, H_kv, offset, D]`` of the buffers (no copy)."""
        if self.keys is None:
            raise ValueError("the cache is empty; call update() first")
        return self.keys[:, :, : self._offset], self.values[:, :, : self._offset]

    def attention(self, queries: torch.Tensor, *, scale: float | None = None,
                  window: int | None = None) -> torch.Tensor:
        """Causal attention ``[B, H_q, T, D]`` of the ``T`` newest positions over the buffer
        (each over the ``window`` newest keys up to its own, with a sliding ``window``)."""
        if self.keys is None:
            raise ValueError("attention() on an empty cache; call update() first")
        scale = check_queries(queries, self.keys.shape[1], self.keys.shape[3], self.dtype, scale)
        window = check_window(window)
        check_query_rows(queries, self.keys.shape[0], self._offset)
        first = window_start(self._offset - queries.shape[2], window)  # keys before it: out of every window
        k, v = self.keys[:, :, first : self._offset], self.values[:, :, first : self._offset]
        if k.dtype != queries.dtype:  # stored narrower (kv_dtype): read back in the queries' dtype
            k, v = k.to(queries.dtype), v.to(queries.dtype)
        return causal_attention(queries, k, v, scale=scale, window=window)

    # -- bookkeeping --------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.keys, self.values)

    def stats(self) -> dict[str, Any]:
        out = {
            "tier": self.tier,
            "offset": self._offset,
            "capacity": self.capacity,
            "step": self.step,
            "nbytes": self.nbytes,
            **self.copy_stats.as_dict(),
        }
        if self.kv_dtype is not None:
            out["kv_dtype"] = str(self.kv_dtype).removeprefix("torch.")
        return out

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
        """``keys``/``values`` ``[B, H_kv, offset, D]`` (contiguous), or ``{}`` if never written."""
        if self.keys is None:
            return {}
        k, v = self.fetch()
        return {"keys": k.contiguous(), "values": v.contiguous()}

    @property
    def meta_state(self) -> dict[str, Any]:
        meta = {"tier": self.tier, "step": self.step, "offset": self._offset}
        if self.kv_dtype is not None:  # the stored dtype and the one the cache takes
            meta["kv_dtype"] = str(self.kv_dtype).removeprefix("torch.")
            meta["dtype"] = str(self.dtype).removeprefix("torch.")
        return meta

    @classmethod
    def from_state(
        cls, state: dict[str, torch.Tensor], meta_state: dict[str, Any]
    ) -> TailOwnedKVCache:
        """Rebuild from :attr:`state` and :attr:`meta_state` (capacity rounded up to ``step``).

        Everything is checked first (:mod:`kvtier.caches.state_checks`): a bad field
        raises ``ValueError`` naming it; ``step`` may not pass
        :data:`~kvtier.caches.state_checks.MAX_UNIT_TOKENS`. The capacity comes from the
        tokens stored: rounded up to ``step`` only while the rounding adds at most
        :func:`~kvtier.caches.state_checks.restore_slack` positions, else exactly the tokens
        (the next write grows by ``step`` as usual).
        """
        check_state_args(state, meta_state, cls.tier)
        (offset,) = read_meta_ints(meta_state, "offset")
        k, v = check_state_kv(state, offset)
        step = check_unit(meta_state, "step", offset)
        kv_dtype, dtype = (_meta_dtype(meta_state, n) for n in ("kv_dtype", "dtype"))
        if (kv_dtype is None) != (dtype is None):
            raise ValueError("meta_state names kv_dtype without dtype (or dtype alone); save both, "
                             "as meta_state does")
        if k is not None and kv_dtype is not None and k.dtype != kv_dtype:
            raise ValueError(f"state holds {k.dtype} keys but meta_state says kv_dtype {kv_dtype}")
        cache = cls(step=step, kv_dtype=kv_dtype)
        if k is not None:
            if dtype is not None:  # the buffers' values, as the dtype the cache takes (exact)
                k, v = k.to(dtype), v.to(dtype)
            # storage even when trimmed to 0 tokens: it carries dtype, heads and head_dim;
            # a step's rounding past restore_slack is not allocated (_grow rounds to self.step)
            need = max(offset, 1)
            rounded = math.ceil(need / step) * step
            cache._grow(need, k, v, cap=rounded if rounded - offset <= restore_slack(offset) else need)
            if offset:
                cache.update(k, v)
        return cache

    @classmethod
    def from_cache(cls, other: KVCache, *, step: int = 256,
                   kv_dtype: torch.dtype | None = None) -> TailOwnedKVCache:
        """A tail cache holding ``other``'s live tokens (any tier with one length per row),
        stored as ``kv_dtype`` when given."""
        cache = cls(step=step, kv_dtype=kv_dtype)
        kv = live_kv(other)
        if kv is not None:
            cache.update(*kv)
        return cache

