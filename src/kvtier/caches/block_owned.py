"""BlockOwnedKVCache: a list of fixed-size blocks, one allocated when a write reaches it.

Nothing is ever reallocated: a block, once allocated, stays where it is, so a long
context grows without a copy of its history. Reads go block by block; the
concatenated K/V are built only when :meth:`BlockOwnedKVCache.fetch` is called.
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
    tensor_nbytes,
)
from kvtier.caches.state_checks import (
    check_state_args,
    check_state_kv,
    check_unit,
    meta_ints,
    restore_slack,
)
from kvtier.caches.tail_owned import check_query_rows, live_kv
from kvtier.kernels.reference import OnlineSoftmax, causal_mask, partial_attention, window_start


class BlockOwnedKVCache(ScalarKVCache):
    """K and V as lists of ``[B, H_kv, block_size, D]`` blocks.

    A block is allocated only when a write reaches it; a write that crosses a
    block boundary is split. :meth:`trim` keeps the blocks, and later writes reuse
    them, so the cache holds ``ceil(highest offset reached / block_size)`` blocks.

    Example::

        cache = BlockOwnedKVCache(block_size=1024)
        cache.update(k, v)                      # k, v: (B, H_kv, T, D)
        out = cache.attention(q)                # q: (B, H_q, T, D), block by block
        for start, kb, vb in cache.active_block_slices():
            ...                                 # kb, vb: views (B, H_kv, n, D)
    """

    tier = "block"

    def __init__(self, block_size: int = 1024):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.key_blocks: list[torch.Tensor] = []
        self.value_blocks: list[torch.Tensor] = []
        self._offset = 0
        self.copy_stats = CopyStats()

    # -- storage ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.key_blocks)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    def _ensure_capacity_for(self, end: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """Allocate blocks until positions ``[0, end)`` have storage (one grow event each)."""
        B, H, _, Dk = like_k.shape
        n = math.ceil(end / self.block_size) - self.num_blocks
        if n <= 0:
            return
        with allocating(self, f"{n} blocks of {self.block_size} positions", "write fewer tokens, or free memory"):
            keys = [like_k.new_empty(B, H, self.block_size, Dk) for _ in range(n)]
            values = [like_v.new_empty(B, H, self.block_size, like_v.shape[3]) for _ in range(n)]
        self.key_blocks += keys
        self.value_blocks += values
        self.copy_stats.grow_events += n

    @exclusive
    def update(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values`` ``[B, H_kv, T, D]``, split across block boundaries (copied)."""
        keys, values = check_kv(keys, values, self.key_blocks[0] if self.key_blocks else None)
        end = self._offset + keys.shape[2]
        self._ensure_capacity_for(end, keys, values)
        with CopyTimer(self.copy_stats, tensor_nbytes(keys, values)):
            pos = self._offset
            while pos < end:
                b, at = divmod(pos, self.block_size)
                n = min(self.block_size - at, end - pos)
                src = slice(pos - self._offset, pos - self._offset + n)
                self.key_blocks[b][:, :, at : at + n] = keys[:, :, src]
                self.value_blocks[b][:, :, at : at + n] = values[:, :, src]
                pos += n
        self._offset = end

    def active_block_slices(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(start, k, v)`` for each block holding live tokens; ``k``/``v`` are views
        ``[B, H_kv, n, D]`` of positions ``start .. start + n - 1``."""
        out = []
        for b in range(math.ceil(self._offset / self.block_size)):
            start = b * self.block_size
            n = min(self.block_size, self._offset - start)
            out.append((start, self.key_blocks[b][:, :, :n], self.value_blocks[b][:, :, :n]))
        return out

    def fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The live K/V ``[B, H_kv, offset, D]``: a view when one block holds them, else a copy."""
        if not self.key_blocks:
            raise ValueError("the cache is empty; call update() first")
        slices = self.active_block_slices()
        if len(slices) <= 1:
            kb, vb = self.key_blocks[0], self.value_blocks[0]
            return kb[:, :, : self._offset], vb[:, :, : self._offset]
        return (
            torch.cat([k for _, k, _ in slices], dim=2),
            torch.cat([v for _, _, v in slices], dim=2),
        )

    def attention(self, queries: torch.Tensor, *, scale: float | None = None,
                  window: int | None = None) -> torch.Tensor:
        """Causal attention ``[B, H_q, T, D]`` (dtype of ``queries``) of the ``T`` newest
        positions, one block at a time, merged with an online softmax (no concatenation); with
        a sliding ``window``, each query over the ``window`` newest keys up to its own (blocks
        before every query's window are not read)."""
        if not self.key_blocks:
            raise ValueError("attention() on an empty cache; call update() first")
        kb = self.key_blocks[0]  # (B, H_kv, block_size, D)
        scale = check_queries(queries, kb.shape[1], kb.shape[3], kb.dtype, scale)
        window = check_window(window)
        check_query_rows(queries, kb.shape[0], self._offset)
        B, _, T, _ = queries.shape
        q_start = self._offset - T
        first = window_start(q_start, window)  # keys before it: out of every query's window
        # keys from here on are in every query's window (the last query's starts latest)
        in_all = 0 if window is None else q_start + T - window
        acc = OnlineSoftmax()
        for start, k, v in self.active_block_slices():
            n = k.shape[2]
            if start + n <= first:
                continue  # out of every query's window
            # blocks that end at or before the first query and start in every query's window
            # are fully visible: no mask
            mask = None
            if start + n - 1 > q_start or start < in_all:
                mask = causal_mask(B, T, n, q_start, key_start=start, device=queries.device, window=window)
            acc.add(*partial_attention(queries, k, v, mask, scale))
        return acc.result(queries.dtype)

    # -- bookkeeping --------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return tensor_nbytes(*self.key_blocks, *self.value_blocks)

    def stats(self) -> dict[str, Any]:
        """Counters; ``grow_events`` counts blocks allocated."""
        return {
            "tier": self.tier,
            "offset": self._offset,
            "capacity": self.capacity,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "nbytes": self.nbytes,
            **self.copy_stats.as_dict(),
        }

    # -- persistence ----------------------------------------------------------------
    @property
    def state(self) -> dict[str, torch.Tensor]:
        """``keys``/``values`` ``[B, H_kv, offset, D]`` (contiguous), or ``{}`` if never written."""
        if not self.key_blocks:
            return {}
        k, v = self.fetch()
        return {"keys": k.contiguous(), "values": v.contiguous()}

    @property
    def meta_state(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "block_size": self.block_size,
            "offset": self._offset,
            "num_blocks": self.num_blocks,
        }

    @classmethod
    def from_state(
        cls, state: dict[str, torch.Tensor], meta_state: dict[str, Any]
    ) -> BlockOwnedKVCache:
        """Rebuild from :attr:`state` and :attr:`meta_state`.

        Everything is checked first (:mod:`kvtier.caches.state_checks`): a bad field
        raises ``ValueError`` naming it. ``block_size`` may not pass
        :data:`~kvtier.caches.state_checks.MAX_UNIT_TOKENS`, and ``num_blocks`` must hold the
        tokens stored. Blocks past those (a trim keeps them) hold no data, so only up to
        :func:`~kvtier.caches.state_checks.restore_slack` positions of them are allocated
        (rounded up to a block; all of them when within that): writes past them append
        blocks, and the cache goes on exactly as the original would (only ``num_blocks``
        and ``capacity`` may read less).
        """
        check_state_args(state, meta_state, cls.tier)
        offset, num_blocks = meta_ints(meta_state, "offset", "num_blocks")
        k, v = check_state_kv(state, offset)
        block_size = check_unit(meta_state, "block_size", offset)
        needed = math.ceil(offset / block_size)
        if num_blocks < needed or bool(state) != (num_blocks > 0):
            raise ValueError(
                f"meta_state num_blocks={num_blocks} cannot hold offset={offset} tokens in "
                f"blocks of {block_size}; the state is inconsistent"
            )
        num_blocks = min(num_blocks, needed + math.ceil(restore_slack(offset) / block_size))
        cache = cls(block_size=block_size)
        if k is not None:
            cache._ensure_capacity_for(num_blocks * block_size, k, v)
            if offset:
                cache.update(k, v)
        return cache

    @classmethod
    def from_cache(cls, other: KVCache, *, block_size: int = 1024) -> BlockOwnedKVCache:
        """A block cache holding ``other``'s live tokens (any tier with one length per row)."""
        cache = cls(block_size=block_size)
        kv = live_kv(other)
        if kv is not None:
            cache.update(*kv)
        return cache
