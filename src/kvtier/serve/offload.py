"""The host tier of the serving engine's prefix cache: copies of evicted blocks in host memory.

:class:`~kvtier.serve.prefix.BlockManager` decides what moves (``host_blocks`` > 0): a cached
block evicted from the pool is saved to a host slot, and an admission whose prompt continues
into blocks only the host holds gets fresh blocks loaded from them. :class:`HostBlocks` holds
the slots and carries out each step's queue of copies (``StepBatch.copies``) before the
forward, in the queue's order (within a run of copies of one kind, in slot order), for every layer and every tensor of a block (the pages and the
sidecars of quantised codecs: scales, norms), so a loaded block is the saved one bit for bit.

On CUDA the slots are pinned and the copies are asynchronous, in the step's stream, so a load
can never overtake the save it reads:

- saves gather their blocks on the device and copy each run of consecutive slots straight
  into those slots (one copy a run and tensor: many when the host's LRU has scattered the
  slots);
- loads copy each run of consecutive slots into a device buffer and scatter it into the
  pool. A load of more than :data:`MAX_RUNS` runs is gathered on the host into one pinned
  buffer instead, once the saves before it have landed: the host then waits for the device.

A chain is saved tail first, into slots that come out in descending order; sorted by slot,
its blocks make one run.

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


#: runs of consecutive slots a load copies one by one on CUDA; more are gathered on the host
MAX_RUNS = 32


def runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive ids: ``(first position in slots, first slot, length)``.

    >>> runs([4, 5, 6, 0, 9, 10])
    [(0, 4, 3), (3, 0, 1), (4, 9, 2)]
    """
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, s, 1))
    return out


def _groups(copies: Sequence[tuple[str, int, int]]):
    """``copies`` as runs of one kind, a run ending where a block would come twice."""
    group: list[tuple[str, int, int]] = []
    blocks: set[int] = set()
    for c in copies:
        if c[0] not in ("save", "load"):
            raise ValueError(f"a block copy is ('save', block, slot) or ('load', slot, block), got {c!r}")
        block = c[1] if c[0] == "save" else c[2]
        if group and (c[0] != group[0][0] or block in blocks):
            yield group
            group, blocks = [], set()
        group.append(c)
        blocks.add(block)
    if group:
        yield group


class HostBlocks:
    """``num_slots`` host copies of a block of every tensor of every cache in ``caches`` (pinned
    when the pool is on CUDA), and the copies of :meth:`apply`."""

    def __init__(self, caches: Sequence, num_slots: int):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.pool = [t for c in caches for t in block_tensors(c)]
        self.device = self.pool[0].device
        self.cuda = self.device.type == "cuda"
        try:
            self.slots = [torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=self.cuda)
                          for t in self.pool]
        except RuntimeError as e:  # pinned memory the host cannot lock, or no memory at all
            gib = num_slots * self.bytes_per_block(caches) / 2**30
            raise ValueError(f"the host tier of {num_slots} blocks ({gib:.2f} GiB{' pinned' if self.cuda else ''}) "
                             f"could not be allocated ({e}); lower --kv-offload-memory") from e
        self.num_slots = num_slots
        self._saved: torch.cuda.Event | None = None  # after the last saves' copies (CUDA)

    @staticmethod
    def bytes_per_block(caches: Sequence) -> int:
        """Host bytes one slot takes (every layer, pages and sidecars)."""
        return sum(t[0].numel() * t.element_size() for c in caches for t in block_tensors(c))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)

    def apply(self, copies: Sequence[tuple[str, int, int]]) -> None:
        """Run ``copies`` (``("save", block, slot)`` / ``("load", slot, block)``) in order; runs
        of one kind go together, in slot order (copies between distinct blocks and slots commute; a
        run ends where a block would come twice)."""
        for group in _groups(copies):
            if group[0][0] == "save":  # by slot, the last save of a slot saved twice kept (slot order: longer runs)
                pairs = sorted({s: b for _, b, s in group}.items())
                self._save([b for _, b in pairs], [s for s, _ in pairs])
            else:  # (a slot loads once: a hash is loaded into one block)
                pairs = sorted(c[1:] for c in group)
                self._load([s for s, _ in pairs], [b for _, b in pairs])

    def _save(self, blocks: list[int], slots: list[int]) -> None:
        index = to_device(torch.tensor(blocks), self.device)
        if not self.cuda:
            to = torch.tensor(slots)
            for host, dev in zip(self.slots, self.pool):
                host.index_copy_(0, to, dev.index_select(0, index))
            return
        spans = runs(slots)
        for host, dev in zip(self.slots, self.pool):
            rows = dev.index_select(0, index)
            for i, s, n in spans:
                host[s : s + n].copy_(rows[i : i + n], non_blocking=True)
        self._saved = torch.cuda.Event()
        self._saved.record(torch.cuda.current_stream(self.device))  # (the pool's device, not the current one)

    def _load(self, slots: list[int], blocks: list[int]) -> None:
        index = torch.tensor(slots)
        to = to_device(torch.tensor(blocks), self.device)
        spans = runs(slots)
        if self.cuda and len(spans) > MAX_RUNS and self._saved is not None:
            self._saved.synchronize()  # the host reads the slots below: the saves into them must have landed
            self._saved = None
        for host, dev in zip(self.slots, self.pool):
            if not self.cuda:
                rows = host.index_select(0, index)
            elif len(spans) <= MAX_RUNS:  # straight from the pinned slots, in the stream's order
                rows = torch.empty((len(slots), *host.shape[1:]), dtype=host.dtype, device=self.device)
                for i, s, n in spans:
                    rows[i : i + n].copy_(host[s : s + n], non_blocking=True)
            else:
                staged = torch.empty((len(slots), *host.shape[1:]), dtype=host.dtype, pin_memory=True)
                rows = torch.index_select(host, 0, index, out=staged).to(self.device, non_blocking=True)
            dev.index_copy_(0, to, rows)
