"""Snapshots of the ragged tier: owned copies that rows can be returned to exactly.

:meth:`~kvtier.caches.ragged.RaggedBatchKVCache.snapshot` takes a
:class:`RaggedSnapshot`; ``restore`` returns every row to it and
``restore_masked`` only the chosen rows. The helpers here do the same for the
per-layer caches of a model, checking every layer before changing any.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtier.caches.ragged_rows import check_row_mask

if TYPE_CHECKING:
    from kvtier.caches.ragged import RaggedBatchKVCache


@dataclass(frozen=True)
class RaggedSnapshot:
    """Owned copies: ``keys``/``values`` ``[B, H_kv, live, D]`` (``None`` before any write)."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    offsets: torch.Tensor
    last_write_start: torch.Tensor
    last_q: int  # the last write's tokens (0: none)
    lengths: tuple[int, ...] | None
    bound: int


def layout(k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What two K/V buffers must share to hold each other's rows: heads, head_dims, dtype, device."""
    return (k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)


def check_snapshot(cache: RaggedBatchKVCache, snap: RaggedSnapshot) -> None:
    """``snap`` can be restored into ``cache``: its rows, layout and length fit."""
    if not isinstance(snap, RaggedSnapshot):
        raise ValueError(f"expected a RaggedSnapshot, got {type(snap).__name__}")
    if snap.offsets.shape[0] != cache.batch_size:
        raise ValueError(f"the snapshot holds {snap.offsets.shape[0]} rows, the cache {cache.batch_size}")
    held = [(c.keys, c.values) for c in (snap, cache) if c.keys is not None]
    if len({layout(k, v) for k, v in held}) > 1:
        raise ValueError("the snapshot's heads, head_dim, dtype or device differ from the cache's")
    cache._check_fits(0 if snap.keys is None else snap.keys.shape[2])


def snapshot_ragged_caches(caches: list[RaggedBatchKVCache]) -> list[RaggedSnapshot]:
    """One :meth:`~kvtier.caches.ragged.RaggedBatchKVCache.snapshot` per layer."""
    return [c.snapshot() for c in caches]


def _check_pairs(caches: list, snaps: list, row_mask: Any = None) -> None:
    if len(caches) != len(snaps):
        raise ValueError(f"{len(caches)} caches but {len(snaps)} snapshots")
    for c, s in zip(caches, snaps):
        check_snapshot(c, s)
        if row_mask is not None:
            check_row_mask(row_mask, c.batch_size)


def restore_ragged_caches(caches: list[RaggedBatchKVCache], snaps: list[RaggedSnapshot]) -> None:
    """:meth:`~kvtier.caches.ragged.RaggedBatchKVCache.restore` every layer; all are checked
    before any changes."""
    _check_pairs(caches, snaps)
    for c, s in zip(caches, snaps):
        c.restore(s)


def restore_ragged_caches_masked(caches: list, snaps: list, row_mask: Any) -> None:
    """:meth:`~kvtier.caches.ragged.RaggedBatchKVCache.restore_masked` every layer; all are
    checked before any changes."""
    _check_pairs(caches, snaps, row_mask)
    for c, s in zip(caches, snaps):
        c.restore_masked(s, row_mask)
