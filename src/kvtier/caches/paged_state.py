"""Saving and restoring a :class:`~kvtier.caches.paged.PagedKVCache` exactly.

``state`` holds tensors (pages, sidecars ``k_sidecar.NAME`` / ``v_sidecar.NAME``,
block tables, free list, row lengths); ``meta_state`` the constructor arguments
and the storage in use (JSON-serialisable). :func:`paged_from_state` rebuilds
the same pool, codecs and books, so a restored cache continues identically.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvtier.caches.paged_codecs import CodecChoice, mode_codecs
from kvtier.caches.state_checks import (
    check_state_args,
    meta_bool,
    meta_dtype,
    meta_int,
    meta_ints,
    meta_str,
    state_rows,
)
from kvtier.quant.modes import TurboQuantConfig

if TYPE_CHECKING:
    from kvtier.caches.paged import PagedKVCache
    from kvtier.quant.codec import Codec


def storage_facts(cache: PagedKVCache) -> dict[str, Any]:
    """The storage asked for and the storage in use (``None`` fields before the first write)."""
    c = cache.codecs
    return {
        "mode": None if c is None else c.mode,
        "kv_quant": cache.kv_quant,
        "turboquant": None if cache.turboquant is None else dataclasses.asdict(cache.turboquant),
        "turboquant_disabled_reason": None if c is None else c.turboquant_disabled_reason,
        "kv_quant_disabled_reason": None if c is None else c.kv_quant_disabled_reason,
    }


def paged_state(cache: PagedKVCache) -> dict[str, torch.Tensor]:
    """Pages, sidecars, block tables, free list and row lengths (empty before the first write)."""
    if not cache.pool.allocated:
        return {}
    rows = {"lengths": cache._lengths, "write_start": cache._write_start}
    centre = cache.codecs.k_codec.centre if cache.codecs is not None else None
    return {**cache.pool.state(), **{k: torch.tensor(v, dtype=torch.long) for k, v in rows.items()},
            **({} if centre is None else {"k_centre": centre})}


def paged_meta_state(cache: PagedKVCache) -> dict[str, Any]:
    """Constructor arguments and the storage in use (JSON-serialisable)."""
    c = cache.codecs
    return {
        "tier": cache.tier,
        "block_size": cache.block_size,
        "num_blocks": cache.num_blocks,
        "batch_size": cache.batch_size,
        "dynamic": cache.dynamic,
        "context_window_tokens": cache.context_window_tokens,
        "attention_backend": cache.attention_backend,
        "frozen": cache.frozen,
        "grow_events": cache.copy_stats.grow_events,
        "last_write_tokens": cache._last_q,
        "head_dim": None if c is None else c.k_codec.head_dim,
        "dtype": None if c is None else str(c.k_codec.dtype).removeprefix("torch."),
        **storage_facts(cache),
    }


def paged_from_state(cls: type[PagedKVCache], state: dict[str, torch.Tensor],
                     meta_state: dict[str, Any]) -> PagedKVCache:
    """Rebuild a cache exactly (pages, sidecars, block tables, free list, lengths).

    Every field is checked before anything is built (a ``ValueError`` names it); in
    particular no row may claim more tokens than the blocks it holds, so no row can
    read another row's pages, and ``num_blocks`` must agree with the pages held.
    """
    check_state_args(state, meta_state, cls.tier)
    m = meta_state
    tq = _turboquant(m.get("turboquant"))
    meta_ints(m, "block_size", "num_blocks", "batch_size", minimum=1)
    cache = cls(m["block_size"], m["num_blocks"], batch_size=m["batch_size"], dynamic=m.get("dynamic"),
                context_window_tokens=m.get("context_window_tokens"), kv_quant=m.get("kv_quant"),
                turboquant=tq, attention_backend=m.get("attention_backend"))
    frozen = meta_bool(m, "frozen")
    (grow_events,) = meta_ints(m, "grow_events")
    reasons = [meta_str(m, name, optional=True)
               for name in ("turboquant_disabled_reason", "kv_quant_disabled_reason")]
    if state:
        mode = meta_str(m, "mode")
        if mode == "turboquant" and tq is None:
            raise ValueError("meta_state mode 'turboquant' comes without its 'turboquant' settings")
        k, v = mode_codecs(mode, meta_int(m, "head_dim", minimum=1), meta_dtype(m, "dtype"), tq)
        _check_books(state, k, v, cache.block_size, cache.batch_size)
        _check_pool_size(state["key_cache"].shape[0], cache.num_blocks, cache.dynamic)
        cache.pool.load({n: t for n, t in state.items() if n != "k_centre"}, k, v)
        cache._allocating_here()  # the pool's tensors
        if "k_centre" in state:
            k.centre = state["k_centre"].to(device=cache.pool.key_cache.device, dtype=torch.float32)
        cache.codecs = CodecChoice(k, v, mode, *reasons)
        cache._lengths = state["lengths"].tolist()
        cache._write_start = state["write_start"].tolist()
        cache._last_q = meta_int(m, "last_write_tokens", optional=True) or 0  # 0 in older files
    cache.pool.frozen = frozen
    cache.copy_stats.grow_events = grow_events
    return cache


def _check_pool_size(held: int, num_blocks: int, dynamic: bool) -> None:
    """``num_blocks`` (the first allocation's size) against the ``held`` blocks the file's
    pages hold: a pool never shrinks, and grows past its first size only when dynamic."""
    if num_blocks > held or (not dynamic and num_blocks != held):
        want = "at most" if dynamic else "exactly"
        raise ValueError(f"meta_state num_blocks={num_blocks} but state['key_cache'] holds {held} blocks; "
                         f"a {'dynamic' if dynamic else 'fixed'} pool's first allocation is {want} the "
                         "blocks it holds; the file is inconsistent")


def _turboquant(d: Any) -> TurboQuantConfig | None:
    """The saved TurboQuant settings: ``None``, or a dict of exactly its fields, typed."""
    if d is None:
        return None
    types = {"key_quant": str, "value_quant": str, "rotate_keys": bool, "seed": int}
    if not isinstance(d, dict) or set(d) != set(types):
        raise ValueError(f"meta_state['turboquant'] must be None or a dict of {sorted(types)}, got {d!r}")
    for name, kind in types.items():
        if type(d[name]) is not kind:
            raise ValueError(f"meta_state['turboquant'][{name!r}] must be {kind.__name__}, got {d[name]!r}")
    return TurboQuantConfig(**d)


def _check_books(state: dict[str, torch.Tensor], k: Codec, v: Codec, block_size: int,
                 batch: int) -> None:
    """Names, pool size and per-row books of a paged state: each row's length and write
    start lie within the blocks it holds."""
    pool = {"key_cache", "value_cache", "block_tables", "free_blocks", "held_blocks"}
    sidecars = {f"{side}_sidecar.{s.name}" for side, c in (("k", k), ("v", v)) for s in c.sidecar_specs()}
    expected = pool | sidecars | {"lengths", "write_start"}
    if k.centres_keys and "k_centre" in state:  # the key codec's centre (kvtier.quant.fp8)
        expected.add("k_centre")
    if set(state) != expected:
        raise ValueError(f"state tensors {sorted(state)} are not the paged tier's "
                         f"(missing {sorted(expected - set(state))}, "
                         f"unexpected {sorted(set(state) - expected)})")
    kc = state["key_cache"]
    if kc.dim() != 4 or kc.shape[0] == 0 or kc.shape[1] != block_size:
        raise ValueError(f"state['key_cache'] {tuple(kc.shape)} is not [num_blocks, {block_size}, "
                         "kv_heads, head_dim']")
    centre = state.get("k_centre")
    if centre is None and k.centres_keys and "lengths" in state and bool(state["lengths"].any()):
        raise ValueError(f"state holds {k.name} keys but no k_centre, the centre they were coded against "
                         "(a file written before keys were centred, or altered); save the cache again")
    if centre is not None and (centre.shape != (kc.shape[2], k.head_dim) or centre.dtype != torch.float32
                               or not bool(torch.isfinite(centre).all())):
        raise ValueError(f"state['k_centre'] {tuple(centre.shape)} {centre.dtype} is not finite float32 "
                         f"[{kc.shape[2]}, {k.head_dim}]; the file is inconsistent")
    held = state_rows(state, "held_blocks", batch, high=kc.shape[0])
    free = state["free_blocks"]
    if free.dim() != 1 or free.dtype.is_floating_point or free.dtype == torch.bool:
        raise ValueError(f"state['free_blocks'] must be a 1-D integer tensor, got {free.dtype} "
                         f"{tuple(free.shape)}")
    capacity = [n * block_size for n in held]
    for name in ("lengths", "write_start"):
        rows = state_rows(state, name, batch)
        over = [r for r in range(batch) if rows[r] > capacity[r]]
        if over:
            raise ValueError(f"state[{name!r}] {rows} passes the blocks rows {over} hold "
                             f"({[capacity[r] for r in over]} tokens); the file is inconsistent")
