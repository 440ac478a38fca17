"""The host tier of the serving engine's prefix cache: copies of evicted blocks in host memory.

:class:`~kvtier.serve.prefix.BlockManager` decides what moves (``host_blocks`` > 0): a cached
block evicted from the pool is saved to a host slot, and an admission whose prompt continues
into blocks only the host holds gets fresh blocks loaded from them. :class:`HostBlocks` holds
the slots and carries out each step's queue of copies (``StepBatch.copies``) before the
forward, in the queue's order, for every layer and every tensor of a block (the pages and the
sidecars of quantised codecs: scales, norms), so a loaded block is the saved one bit for bit.

On CUDA the slots are pinned and nothing waits for the device in the common case:

- loads gather their slots on the host, stage them in pinned memory and send them with one
  asynchronous copy a tensor, then scatter them into the pool on the device;
- saves gather the blocks on the device and copy them into a pinned staging tensor
  asynchronously; the staged rows are written into their slots once the copy has landed
  (an event), at the latest before a later load reads one of those slots.

On the CPU both are plain gathers and scatters: there the host tier is only a second LRU
in the same memory, which a larger pool (``--kv-memory``) serves as well.

Example::

    >>> host = HostBlocks(runner.caches, 4096)                 # doctest: +SKIP
    >>> host.apply([("save", 7, 0), ("load", 3, 7)])           # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.caches.paged_shared import to_device

__all__ = ["HostBlocks", "block_tensors"]


def block_tensors(cache) -> list[torch.Tensor]:
    """The tensors of a shared-block cache's pool whose first dimension is the block: pages,
    then sidecars, keys before values (the same order for every cache of one runner)."""
    pool = cache.pool
    return [pool.key_cache, pool.value_cache, *pool.k_sidecars.values(), *pool.v_sidecars.values()]


class HostBlocks:
    """``num_slots`` host copies of a block of every tensor of every cache in ``caches`` (pinned
    when the pool is on CUDA), and the copies of :meth:`apply`."""

    def __init__(self, caches: Sequence, num_slots: int):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.pool = [t for c in caches for t in block_tensors(c)]
        self.device = self.pool[0].device
        pin = self.device.type == "cuda"
        try:
            self.slots = [torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                          for t in self.pool]
        except RuntimeError as e:  # pinned memory the host cannot lock, or no memory at all
            gib = num_slots * self.bytes_per_block(caches) / 2**30
            raise ValueError(f"the host tier of {num_slots} blocks ({gib:.2f} GiB{' pinned' if pin else ''}) could "
                             f"not be allocated ({e}); lower --kv-offload-memory") from e
        self.num_slots = num_slots
        self._landing: list[tuple[torch.cuda.Event, torch.Tensor, list[torch.Tensor]]] = []  # saves in flight

    @staticmethod
    def bytes_per_block(caches: Sequence) -> int:
        """Host bytes one slot takes (every layer, pages and sidecars)."""
        return sum(t[0].numel() * t.element_size() for c in caches for t in block_tensors(c))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)

    def apply(self, copies: Sequence[tuple[str, int, int]]) -> None:
        """Run ``copies`` (``("save", block, slot)`` / ``("load", slot, block)``) in order; runs
        of one kind go together (a load waits for the saves before it that it reads)."""
        i = 0
        while i < len(copies):
            kind = copies[i][0]
            j = i
            while j < len(copies) and copies[j][0] == kind:
                j += 1
            pairs = [c[1:] for c in copies[i:j]]
            if kind == "save":
                self._save([b for b, _ in pairs], [s for _, s in pairs])
            elif kind == "load":
                self._load([s for s, _ in pairs], [b for _, b in pairs])
            else:
                raise ValueError(f"a block copy is ('save', block, slot) or ('load', slot, block), got {copies[i]!r}")
            i = j
        self._land(wait=False)

    def _save(self, blocks: list[int], slots: list[int]) -> None:
        index = to_device(torch.tensor(blocks), self.device)
        to = torch.tensor(slots)
        if self.device.type != "cuda":
            for host, dev in zip(self.slots, self.pool):
                host.index_copy_(0, to, dev.index_select(0, index))
            return
        staged = []
        for dev in self.pool:
            rows = dev.index_select(0, index)
            pinned = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            pinned.copy_(rows, non_blocking=True)
            staged.append(pinned)
        done = torch.cuda.Event()
        done.record()
        self._landing.append((done, to, staged))

    def _land(self, wait: bool, slots: Sequence[int] = ()) -> None:
        """Write the saves whose copies have landed into their slots; ``wait``: also those (and
        the ones before them) that fill one of ``slots``."""
        want = set(slots)
        last = max((k for k, (_, to, _) in enumerate(self._landing) if want.intersection(to.tolist())),
                   default=-1) if wait else -1
        while self._landing and (last >= 0 or self._landing[0][0].query()):
            last -= 1
            done, to, staged = self._landing.pop(0)
            done.synchronize()
            for host, rows in zip(self.slots, staged):
                host.index_copy_(0, to, rows)

    def _load(self, slots: list[int], blocks: list[int]) -> None:
        self._land(wait=True, slots=slots)  # a slot saved this step or the last may be the one read
        index = torch.tensor(slots)
        to = to_device(torch.tensor(blocks), self.device)
        cuda = self.device.type == "cuda"
        for host, dev in zip(self.slots, self.pool):
            rows = host.index_select(0, index)
            if cuda:
                rows = rows.pin_memory().to(self.device, non_blocking=True)
            dev.index_copy_(0, to, rows)
