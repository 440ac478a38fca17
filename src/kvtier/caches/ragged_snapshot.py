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

from kvtier.caches.ragged_rows import check_row_mask, last_write_starts, round_up, to_device

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


def restore_rows(cache: RaggedBatchKVCache, snap: RaggedSnapshot, mask: list[bool] | torch.Tensor | None) -> None:
    """Return the rows ``mask`` picks (``[B]`` bools, a host list or a device tensor; ``None``:
    every row) of ``cache`` to ``snap`` (checked by :func:`check_snapshot`): content, offsets
    and host books. Where a masked restore joins rows of two last writes, the cache's last-write
    tokens stay its own (the snapshot's when it has none, after a trim), and a row whose last
    write had other tokens gets the starts that place its default queries at its newest
    positions (:func:`~kvtier.caches.ragged_rows.last_write_starts`)."""
    if snap.keys is not None and snap.keys.shape[2] > cache.capacity:  # (takes the offsets to the keys' device)
        cache._reallocate(max(round_up(snap.keys.shape[2], cache.step), cache._target), snap.keys, snap.values)
    cache._changed()
    dev = cache._offsets.device  # the CPU while nothing was written
    if isinstance(mask, list):
        m = to_device(mask, torch.bool, dev)
    else:
        m = None if mask is None else mask.to(dev)
    q = snap.last_q if m is None else cache._last_q or snap.last_q
    saved_ws = last_write_starts(snap.last_write_start, snap.offsets, snap.last_q, q)
    kept_ws = None if m is None else last_write_starts(cache._last_ws, cache._offsets, cache._last_q, q)
    if snap.keys is not None:
        n = snap.keys.shape[2]
        for buf, saved in ((cache.keys, snap.keys), (cache.values, snap.values)):
            region = buf[:, :, :n]
            region.copy_(saved if m is None else torch.where(m[:, None, None, None], saved, region))
    for buf, saved, kept in ((cache._offsets, snap.offsets, cache._offsets), (cache._last_ws, saved_ws, kept_ws)):
        saved = saved.to(buf.device)
        buf.copy_(saved if m is None else torch.where(m, saved, kept))
    cache._last_q = q
    if mask is None:
        cache._lengths = None if snap.lengths is None else list(snap.lengths)
        cache._bound = snap.bound
    elif isinstance(mask, list) and cache._lengths is not None and snap.lengths is not None:
        cache._lengths = [s if pick else c for c, s, pick in zip(cache._lengths, snap.lengths, mask)]
        cache._bound = max(cache._lengths)
    else:
        cache._lengths, cache._bound = None, max(cache._bound, snap.bound)


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
