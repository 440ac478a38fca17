"""The paged tier's memory: a pool of pages, a free list and per-row block tables.

:class:`BlockPool` owns the pages ``[num_blocks, block_size, H_kv, D']`` of K and
V, their codec sidecars ``[num_blocks, block_size, H_kv, G]``, the free list and
the blocks each row holds. It knows nothing of lengths or codecs' arithmetic;
:class:`~kvtier.caches.paged.PagedKVCache` drives it. The sizing rules are plain
functions so that configuration can use them before any cache exists.

Invariant: every allocated block is either free or held by exactly one row, so
``free + used == allocated`` at all times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvtier.caches.base import CacheCapacityError, tensor_nbytes
from kvtier.caches.base import check_indices as check_indices  # re-exported: paged.py takes it here
from kvtier.quant.codec import Codec

RowsArg = int | Sequence[int] | torch.Tensor | None


def dynamic_paged_num_blocks(
    block_size: int,
    configured_blocks: int,
    request_tokens: int | None = None,
    previous_high_water: int = 0,
    margin: int = 128,
    min_blocks: int | None = None,
) -> int:
    """Start-up pool size in blocks for a dynamic paged cache.

    Blocks for ``max(request_tokens, ceil(1.5 * previous_high_water)) + margin``
    tokens, never below ``configured_blocks`` nor ``min_blocks``.

    >>> dynamic_paged_num_blocks(16, 64, request_tokens=4000)   # (4000 + 128) / 16
    258
    """
    for name, v in (("block_size", block_size), ("configured_blocks", configured_blocks)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    for name, v in (("request_tokens", request_tokens or 0), ("previous_high_water", previous_high_water),
                    ("margin", margin), ("min_blocks", min_blocks or 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0 (or None), got {v!r}")
    tokens = max(request_tokens or 0, math.ceil(1.5 * previous_high_water)) + margin
    return max(math.ceil(tokens / block_size), configured_blocks, min_blocks or 0)


def paged_grown_blocks(
    current: int,
    required_tokens: int,
    block_size: int,
    context_window_tokens: int | None = None,
) -> int:
    """Pool size in blocks after growing ``current`` blocks to hold ``required_tokens``.

    Unchanged when the requirement fits; otherwise
    ``max(required, ceil(1.5 * current), current + 1)`` blocks, clamped to the
    context window's blocks when one is set and the requirement fits in it.

    >>> paged_grown_blocks(10, 200, 16)        # needs 13 blocks; 1.5x gives 15
    15
    >>> paged_grown_blocks(10, 200, 16, context_window_tokens=224)   # clamp to 14 blocks
    14
    """
    if current < 0 or required_tokens < 0 or block_size <= 0:
        raise ValueError(
            f"paged_grown_blocks needs current >= 0, required_tokens >= 0 and block_size > 0, "
            f"got {current}, {required_tokens}, {block_size}"
        )
    required = math.ceil(required_tokens / block_size)
    if required <= current:
        return current
    grown = max(required, math.ceil(1.5 * current), current + 1)
    if context_window_tokens is not None:
        window = math.ceil(context_window_tokens / block_size)
        if required <= window:
            grown = min(grown, window)
    return grown


def rows_arg(B: int, name: str, value: RowsArg, default: list[int]) -> list[int]:
    """A per-row argument as ``B`` host ints: None (``default``), an int, ints, or an integer
    tensor ``[B]``."""
    if value is None:
        return list(default)
    if isinstance(value, torch.Tensor):  # (a 0-d tensor is refused, as the ragged tier refuses it)
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor [{B}], got {value.dtype} "
                             f"{tuple(value.shape)}")
        if tuple(value.shape) != (B,):
            raise ValueError(f"{name} must have shape ({B},) (one per row), got {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * B
    if (not isinstance(value, Sequence) or len(value) != B
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
        raise ValueError(f"{name} must be an int or {B} ints (one per row), got {value!r}")
    return list(value)


#: writes of at most this many tokens take their slots from the host's block lists (one small
#: copy to the device) instead of a gather from the device block tables
HOST_SLOTS_MAX = 256


class PagedKVGrowthRefused(CacheCapacityError):
    """A write needs more blocks than the pool has free and the pool may not grow."""


class BlockPool:
    """Pages, sidecars, a free list and per-row block lists (host side) with their block tables.

    ``block_tables`` is int32 ``[B, num_blocks]`` on the pages' device: row ``r``'s
    logical block ``i`` lives in physical block ``block_tables[r, i]`` for
    ``i < len(rows[r])``; later entries are 0.
    """

    def __init__(
        self,
        block_size: int,
        batch_size: int,
        *,
        initial_blocks: int,
        dynamic: bool = False,
        context_window_tokens: int | None = None,
    ):
        self.block_size = block_size
        self.initial_blocks, self.dynamic = initial_blocks, dynamic
        self.context_window_tokens = context_window_tokens
        self.frozen = False
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.k_sidecars: dict[str, torch.Tensor] = {}
        self.v_sidecars: dict[str, torch.Tensor] = {}
        self.block_tables: torch.Tensor | None = None
        self.free: list[int] = []  # popped from the end: the next block handed out
        self.rows: list[list[int]] = [[] for _ in range(batch_size)]

    # -- facts ------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self.key_cache is not None

    @property
    def num_blocks(self) -> int:
        return 0 if self.key_cache is None else self.key_cache.shape[0]

    @property
    def used_blocks(self) -> int:
        return sum(len(r) for r in self.rows)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(
            self.key_cache, self.value_cache, *self.k_sidecars.values(), *self.v_sidecars.values()
        )

    def figures(self, live: int) -> dict[str, int | float | bool | None]:
        """Blocks, token slots, waste and bytes of the pool holding ``live`` committed tokens."""
        bs, cap = self.block_size, self.num_blocks * self.block_size
        payload = tensor_nbytes(self.key_cache, self.value_cache)
        return {
            "block_size": bs,
            "allocated_blocks": self.num_blocks,
            "used_blocks": self.used_blocks,
            "free_blocks": len(self.free),
            "capacity": cap,
            "live_tokens": live,
            "waste_tokens": cap - live,
            "waste_pct": 100.0 * (cap - live) / cap if cap else 0.0,
            "held_waste_tokens": self.used_blocks * bs - live,
            "frozen": self.frozen,
            "payload_bytes": payload,
            "sidecar_bytes": self.nbytes - payload,
            "bytes_per_live_token": self.nbytes / live if live else None,
        }

    def slots(self, starts: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
        """int64 physical slots of row ``r``'s positions ``starts[r] .. starts[r] + counts[r] - 1``,
        row by row (``block * block_size + position % block_size``).

        A few slots (a decode step) come from the host's block lists, in one small copy
        to ``device``; many (a prefill) from the device block tables.
        """
        bs = self.block_size
        if sum(counts) <= HOST_SLOTS_MAX:
            host = [self.rows[r][p // bs] * bs + p % bs
                    for r, (s, n) in enumerate(zip(starts, counts)) for p in range(s, s + n)]
            return torch.tensor(host, dtype=torch.int64, device=device)
        n = torch.tensor(counts)
        row = torch.repeat_interleave(torch.arange(len(counts)), n)  # (total,)
        first = torch.cumsum(n, 0) - n  # index of each row's first slot
        pos = torch.tensor(starts)[row] + torch.arange(row.numel()) - first[row]
        row, pos = row.to(device), pos.to(device)
        return self.block_tables[row, pos // bs].long() * bs + pos % bs

    def extra_blocks(self, ends: list[int]) -> list[int]:
        """Blocks each row still needs so that positions ``< ends[r]`` have a slot."""
        return [max(0, math.ceil(e / self.block_size) - len(r)) for e, r in zip(ends, self.rows)]

    # -- growth policy -------------------------------------------------------------------
    def _target_blocks(self, extra: int) -> int:
        """Pool size after making ``extra`` blocks free; raises if the pool may not grow."""
        have = self.num_blocks if self.allocated else self.initial_blocks
        free = len(self.free) if self.allocated else have
        if extra <= free:
            return have
        if self.dynamic and not self.frozen:
            need = (have - free + extra) * self.block_size
            return paged_grown_blocks(have, need, self.block_size, self.context_window_tokens)
        why = "the pool is frozen (freeze())" if self.frozen else "the pool does not grow"
        raise PagedKVGrowthRefused(
            f"this write needs {extra} more blocks of {self.block_size} tokens but {free} of "
            f"{have} are free and {why}; set KVTIER_DYNAMIC_PAGED_KV=1 (dynamic=True), raise "
            f"KVTIER_PAGED_NUM_BLOCKS (num_blocks={have} now), or release finished rows"
        )

    def make_room(self, extra: int, heads: int, k_codec: Codec, v_codec: Codec, device) -> bool:
        """Ensure ``extra`` free blocks: allocate the pool (first use) or grow it, all-or-nothing.

        Returns whether the pool passed its previous size (or ``initial_blocks``).
        Raises :class:`PagedKVGrowthRefused` when growth is off, the pool is
        frozen, or the allocation fails; the pool is then unchanged.
        """
        target = self._target_blocks(extra)
        before = self.num_blocks if self.allocated else self.initial_blocks
        if self.allocated and target == before:
            return False
        try:
            self.resize(target, heads, k_codec, v_codec, device)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise PagedKVGrowthRefused(
                f"allocating {target} blocks of {self.block_size} tokens failed ({e}); the "
                "cache is unchanged: lower KVTIER_PAGED_NUM_BLOCKS, quantise "
                "(KVTIER_PAGED_KV_QUANT), or release finished rows"
            ) from e
        return target > before

    # -- allocation ----------------------------------------------------------------------
    def _new_tensors(self, n: int, heads: int, k_codec: Codec, v_codec: Codec, device):
        """Fresh zeroed pages and sidecars for ``n`` blocks (may raise on allocation failure)."""
        bs = self.block_size
        out = []
        for codec in (k_codec, v_codec):
            pages = torch.zeros(n, bs, heads, codec.packed_dim(), dtype=codec.payload_dtype, device=device)
            side = {
                s.name: torch.zeros(n, bs, heads, s.groups, dtype=s.dtype, device=device)
                for s in codec.sidecar_specs()
            }
            out.append((pages, side))
        tables = torch.zeros(len(self.rows), n, dtype=torch.int32, device=device)
        return out, tables

    def resize(self, n: int, heads: int, k_codec: Codec, v_codec: Codec, device) -> None:
        """Allocate (first time) or grow the pool to ``n`` blocks, keeping every block's contents.

        Everything new is allocated before anything is swapped in, so an
        allocation failure leaves the pool exactly as it was.
        """
        old = self.num_blocks
        assert n >= old, f"the pool never shrinks ({old} -> {n})"
        ((kp, ks), (vp, vs)), tables = self._new_tensors(n, heads, k_codec, v_codec, device)
        if old:
            kp[:old], vp[:old] = self.key_cache, self.value_cache
            for new, cur in ((ks, self.k_sidecars), (vs, self.v_sidecars)):
                for name, t in cur.items():
                    new[name][:old] = t
            tables[:, :old] = self.block_tables
        self.key_cache, self.value_cache, self.k_sidecars, self.v_sidecars = kp, vp, ks, vs
        self.block_tables = tables
        # new blocks are handed out after the ones already free, lowest id first
        self.free = list(range(n - 1, old - 1, -1)) + self.free

    def assign(self, extra: list[int]) -> None:
        """Give row ``r`` ``extra[r]`` blocks from the free list and record them in the tables."""
        assert sum(extra) <= len(self.free), "caller must check free blocks first"
        rr, cc, bb = [], [], []
        for r, k in enumerate(extra):
            for _ in range(k):
                rr.append(r)
                cc.append(len(self.rows[r]))
                b = self.free.pop()
                bb.append(b)
                self.rows[r].append(b)
        if rr:
            dev = self.block_tables.device
            # Tables made under inference_mode are inference tensors: write them inside it.
            with torch.inference_mode():
                self.block_tables[torch.tensor(rr, device=dev), torch.tensor(cc, device=dev)] = (
                    torch.tensor(bb, dtype=torch.int32, device=dev)
                )

    def release(self, rows: list[int]) -> None:
        """Return the rows' blocks to the free list (reused first) and clear their tables."""
        for r in rows:
            self.free.extend(reversed(self.rows[r]))
            self.rows[r] = []
        if rows and self.block_tables is not None:
            with torch.inference_mode():
                self.block_tables[torch.tensor(rows, device=self.block_tables.device)] = 0

    def select(self, indices: list[int]) -> None:
        """Keep rows ``indices`` in that order; the caller released the others first."""
        self.rows = [self.rows[i] for i in indices]
        if self.block_tables is not None:
            idx = torch.tensor(indices, device=self.block_tables.device)
            self.block_tables = self.block_tables.index_select(0, idx)

    def add_rows(self, count: int) -> None:
        """Append ``count`` empty rows."""
        self.rows.extend([] for _ in range(count))
        if self.block_tables is not None:
            pad = self.block_tables.new_zeros(count, self.block_tables.shape[1])
            self.block_tables = torch.cat([self.block_tables, pad])

    def copy_blocks(self, src: BlockPool, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy whole blocks (payload and sidecars) from ``src`` into this pool."""
        dev = self.key_cache.device
        s = torch.tensor(src_ids, device=src.key_cache.device)
        d = torch.tensor(dst_ids, device=dev)
        for mine, theirs in ((self.key_cache, src.key_cache), (self.value_cache, src.value_cache)):
            mine.index_copy_(0, d, theirs.index_select(0, s).to(dev))
        for mine, theirs in ((self.k_sidecars, src.k_sidecars), (self.v_sidecars, src.v_sidecars)):
            for name, t in mine.items():
                t.index_copy_(0, d, theirs[name].index_select(0, s).to(dev))

    # -- persistence ----------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """The pool's tensors and books (live tensors, not copies)."""
        return {
            "key_cache": self.key_cache,
            "value_cache": self.value_cache,
            "block_tables": self.block_tables,
            "free_blocks": torch.tensor(self.free, dtype=torch.long),
            "held_blocks": torch.tensor([len(r) for r in self.rows], dtype=torch.long),
            **{f"k_sidecar.{n}": t for n, t in self.k_sidecars.items()},
            **{f"v_sidecar.{n}": t for n, t in self.v_sidecars.items()},
        }

    def load(self, state: dict[str, torch.Tensor], k_codec: Codec, v_codec: Codec) -> None:
        """Fill a fresh pool from :meth:`state` exactly; ``ValueError`` if it does not fit the codecs."""
        kc = state.get("key_cache")
        if kc is None or kc.dim() != 4:
            raise ValueError("state has no 4-D 'key_cache'; the file is inconsistent")
        self.resize(kc.shape[0], kc.shape[2], k_codec, v_codec, kc.device)
        mine = self.state()
        for name in ("key_cache", "value_cache", "block_tables", *(n for n in mine if "sidecar" in n)):
            got = state.get(name)
            want = mine[name]
            if got is None or got.shape != want.shape or got.dtype != want.dtype:
                desc = None if got is None else (tuple(got.shape), got.dtype)
                raise ValueError(
                    f"state[{name!r}] is {desc}, the codecs need {(tuple(want.shape), want.dtype)}; "
                    "the file is inconsistent"
                )
            want.copy_(got)
        held = state["held_blocks"].tolist()
        if len(held) != len(self.rows):
            raise ValueError(f"state holds {len(held)} rows, meta_state {len(self.rows)}")
        self.rows = [self.block_tables[r, :n].tolist() for r, n in enumerate(held)]
        self.free = state["free_blocks"].tolist()
        if sorted(self.free + [b for r in self.rows for b in r]) != list(range(self.num_blocks)):
            raise ValueError(
                "state's block tables and free list do not cover the pool exactly once; "
                "the file is inconsistent"
            )
