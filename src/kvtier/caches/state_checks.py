"""Checks of a saved ``state`` / ``meta_state`` before a tier rebuilds from it.

A tier's ``from_state`` reads plain JSON values (``meta_state``) and tensors
(``state``) that may come from a damaged or crafted file. These helpers read each
field with its type and range, so anything wrong is a ``ValueError`` naming the
field, never an ``AttributeError``, a ``ZeroDivisionError`` or a row that reads
another row's keys. They only read; nothing is built until they all pass.

Example::

    >>> check_state_args({}, {"tier": "tail", "step": 4, "offset": 0}, "tail")
    >>> meta_ints({"step": 4, "offset": 0}, "step", minimum=1)
    [4]
    >>> meta_bool({"frozen": "false"}, "frozen")
    Traceback (most recent call last):
    ...
    ValueError: meta_state['frozen'] must be true or false, got 'false'
"""

from __future__ import annotations

from typing import Any

import torch

#: the largest count or size a meta_state may hold (token positions, blocks, steps)
MAX_INT = 2**31 - 1
#: the largest step (tail) or block (block tier) a restored cache may have: the most tokens any
#: size of a config may name (``kvtier.config.MAX_TOKENS``; not imported: config imports caches)
MAX_UNIT_TOKENS = 2**24
#: positions past the stored tokens a restore allocates at most beyond ``max(tokens, this)``:
#: see :func:`restore_slack`
RESTORE_SLACK = 2**16

#: dtypes a saved cache may hold its keys and values in (``meta_state`` spells them so)
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def check_state_args(state: Any, meta_state: Any, tier: str) -> None:
    """``state`` is a dict of named tensors and ``meta_state`` a dict of tier ``tier``."""
    if not isinstance(meta_state, dict):
        raise ValueError(f"meta_state must be a dict, got {type(meta_state).__name__}")
    if meta_state.get("tier") != tier:
        raise ValueError(f"meta_state tier {meta_state.get('tier')!r} is not {tier!r}")
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict of tensors, got {type(state).__name__}")
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"state[{name!r}] is {type(t).__name__}; state maps names to tensors")


def check_state_names(state: dict[str, torch.Tensor], allowed: set[str]) -> None:
    """No tensor in ``state`` other than ``allowed`` ones (a stray name means a damaged file)."""
    extra = sorted(set(state) - allowed)
    if extra:
        raise ValueError(f"state holds unexpected tensors {extra}; expected some of {sorted(allowed)}")


def meta_int(meta_state: dict[str, Any], name: str, *, minimum: int = 0,
             optional: bool = False) -> int | None:
    """``meta_state[name]`` as an int in ``[minimum, MAX_INT]`` (``None`` allowed when
    ``optional``). The bound keeps a crafted size from overflowing a tensor shape."""
    v = meta_state.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= MAX_INT:
        raise ValueError(f"meta_state[{name!r}] must be an int in [{minimum}, {MAX_INT}], got {v!r}")
    return v


def meta_ints(meta_state: dict[str, Any], *names: str, minimum: int = 0) -> list[int]:
    """Several :func:`meta_int` fields at once."""
    return [meta_int(meta_state, n, minimum=minimum) for n in names]


def read_meta_ints(meta_state: dict[str, Any], *names: str) -> list[int]:
    """Non-negative int fields of a meta_state; ValueError names a missing or bad one."""
    return meta_ints(meta_state, *names)


def meta_bool(meta_state: dict[str, Any], name: str, default: bool | None = None) -> bool:
    """``meta_state[name]`` as a real bool; a string such as ``"false"`` is refused, not truthy.

    ``default`` stands for a missing field (files written before it existed); without
    one, a missing field is an error.
    """
    v = meta_state.get(name, default)
    if not isinstance(v, bool):
        raise ValueError(f"meta_state[{name!r}] must be true or false, got {v!r}")
    return v


def meta_str(meta_state: dict[str, Any], name: str, *, optional: bool = False,
             default: str | None = None) -> str | None:
    """``meta_state[name]`` as a string (``None`` allowed when ``optional``)."""
    v = meta_state.get(name, default)
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise ValueError(f"meta_state[{name!r}] must be a string, got {v!r}")
    return v


def meta_dtype(meta_state: dict[str, Any], name: str) -> torch.dtype:
    """``meta_state[name]`` as one of :data:`FLOAT_DTYPES` (``"float32"``, ...)."""
    v = meta_state.get(name)
    if not isinstance(v, str) or v not in FLOAT_DTYPES:
        raise ValueError(f"meta_state[{name!r}] must name a dtype, one of {list(FLOAT_DTYPES)}; "
                         f"got {v!r}")
    return FLOAT_DTYPES[v]


def state_rows(state: dict[str, torch.Tensor], name: str, batch: int, *, low: int = 0,
               high: int | None = None) -> list[int]:
    """``state[name]``, an integer tensor ``[batch]``, as host ints in ``[low, high]``."""
    t = state.get(name)
    if t is None:
        raise ValueError(f"state lacks {name!r}, one int per row")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool \
            or tuple(t.shape) != (batch,):
        raise ValueError(f"state[{name!r}] must be an integer tensor ({batch},) (one per row), "
                         f"got {t.dtype} {tuple(t.shape)}")
    rows = [int(x) for x in t.tolist()]
    bad = [x for x in rows if x < low or (high is not None and x > high)]
    if bad:
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"state[{name!r}] {rows} holds {bad}, outside {span}")
    return rows


def restore_slack(tokens: int) -> int:
    """Positions past ``tokens`` stored ones that a restore allocates at most where the file's
    sizes name room that holds no data: ``max(tokens, RESTORE_SLACK)``. Blocks a trimmed block
    cache kept and the capacity of a ragged cache that is not frozen are restored up to it (a
    tail step's rounding only within it); the cache grows past it as the original would, and
    a crafted size never allocates (or loops over) memory out of proportion to the file."""
    return max(tokens, RESTORE_SLACK)


def free_bytes(device: torch.device) -> int | None:
    """Memory ``device`` has free now: the GPU's (``torch.cuda.mem_get_info``), or the CPU's
    ``MemAvailable`` (/proc/meminfo); ``None`` where it cannot be read (then not checked).
    The server sizes its page pool against it too."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib * 1024


def check_unit(meta_state: dict[str, Any], name: str, tokens: int | None = None) -> int:
    """``meta_state[name]``, a step or block size, as an int in ``[1, MAX_UNIT_TOKENS]``
    (``tokens``: those the state holds, named in the message)."""
    v = meta_int(meta_state, name, minimum=1)
    if v > MAX_UNIT_TOKENS:
        held = "" if tokens is None else f" (the state holds {tokens} tokens)"
        raise ValueError(f"meta_state {name}={v} passes the {MAX_UNIT_TOKENS} tokens a {name} may "
                         f"have{held}; the file is inconsistent")
    return v


def check_state_kv(
    state: dict[str, torch.Tensor], offset: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``keys``/``values`` ``[B, H_kv, offset, D]`` of a scalar-offset tier's state.

    Both or neither (then ``offset`` must be 0); floating dtypes; the same batch,
    heads, device and dtype; exactly ``offset`` tokens.
    """
    check_state_names(state, {"keys", "values"})
    if not state:
        if offset:
            raise ValueError(f"meta_state says offset {offset} but the state holds no tensors")
        return None, None
    missing = {"keys", "values"} - set(state)
    if missing:
        raise ValueError(f"state lacks {sorted(missing)}; expected 'keys' and 'values'")
    k, v = state["keys"], state["values"]
    for name, t in (("keys", k), ("values", v)):
        if t.dim() != 4 or t.shape[2] != offset or 0 in (t.shape[0], t.shape[1], t.shape[3]):
            raise ValueError(
                f"state[{name!r}] {tuple(t.shape)} does not hold offset={offset} tokens as "
                "[batch, kv_heads, tokens, head_dim]; the state is inconsistent"
            )
        if not t.dtype.is_floating_point:
            raise ValueError(f"state[{name!r}] is {t.dtype}; keys and values are floating point")
    if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(
            f"state keys {tuple(k.shape)} {k.dtype} and values {tuple(v.shape)} {v.dtype} disagree"
        )
    return k, v


def check_ragged_state(state: Any, meta_state: Any) -> int:
    """Everything :meth:`RaggedBatchKVCache.from_state` reads, checked before it builds;
    returns the capacity to restore (:func:`ragged_capacity`).

    ``meta_state``: ``step`` in ``[1, MAX_UNIT_TOKENS]``, ``capacity`` a multiple of it,
    ``batch_size`` (``None`` or >= 1), ``frozen`` / ``has_last_write`` bools,
    ``attention_backend`` a string. ``state``: ``offsets`` and ``last_write_start``, int
    ``[B]``, and ``keys``/``values`` ``[B, H_kv, T, D]`` (floating, ``T <= capacity``,
    every offset ``<= T``), each when present.
    """
    check_state_args(state, meta_state, "ragged")
    step = check_unit(meta_state, "step")
    cap = meta_int(meta_state, "capacity")
    if cap % step:
        raise ValueError(f"meta_state capacity {cap} is not a multiple of step {step}")
    batch = meta_int(meta_state, "batch_size", minimum=1, optional=True)
    frozen = meta_bool(meta_state, "frozen", False)
    meta_bool(meta_state, "has_last_write", False)
    meta_int(meta_state, "last_write_tokens", optional=True)
    meta_str(meta_state, "attention_backend", default="auto")
    check_state_names(state, {"offsets", "last_write_start", "keys", "values"})
    if state:
        _check_ragged_rows(state, cap, batch)
    return ragged_capacity(cap, step, frozen, state.get("keys"), state.get("values"))


def _check_ragged_rows(state: dict[str, torch.Tensor], cap: int, batch: int | None) -> None:
    """The tensors of a ragged state that holds any: keys and values, offsets, write starts."""
    if ("keys" in state) != ("values" in state):
        raise ValueError("state holds only one of 'keys' and 'values'; a file holds both or neither")
    tokens = 0
    if "keys" in state:
        k, v = state["keys"], state["values"]
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or 0 in k.shape:
            raise ValueError(f"state keys {tuple(k.shape)} and values {tuple(v.shape)} must be "
                             "[batch, kv_heads, tokens, head_dim] of one batch, heads and tokens")
        if not (k.dtype.is_floating_point and k.dtype == v.dtype):
            raise ValueError(f"state keys ({k.dtype}) and values ({v.dtype}) must share a float dtype")
        tokens = k.shape[2]
        if tokens > cap:
            raise ValueError(f"state keys hold {tokens} positions, past meta_state capacity {cap}")
        if batch is not None and k.shape[0] != batch:
            raise ValueError(f"state keys hold {k.shape[0]} rows, meta_state batch_size {batch}")
        batch = k.shape[0]
    if batch is None:
        raise ValueError("state holds rows but meta_state has no batch_size")
    if "offsets" in state:  # without offsets, every row holds all the keys given
        state_rows(state, "offsets", batch, high=tokens)
    if "last_write_start" in state:
        state_rows(state, "last_write_start", batch, high=cap)


def ragged_capacity(cap: int, step: int, frozen: bool, k: torch.Tensor | None,
                    v: torch.Tensor | None) -> int:
    """The capacity a ragged restore allocates for a saved ``capacity`` of ``cap``.

    Not ``frozen``: the capacity is room the cache would grow into anyway, so at most the
    ``T`` positions the keys hold plus :func:`restore_slack`, rounded up to ``step`` (a larger
    ``cap`` is clamped to that; writes past it grow the buffers as the original's would).
    ``frozen``: the capacity is part of the cache's contract (static shapes, CUDA graphs) and
    is kept exactly, up to :data:`MAX_UNIT_TOKENS` positions; with keys, it is refused
    (``ValueError``) where its keys and values pass the memory free on their device
    (:func:`free_bytes`), before anything is allocated.
    """
    tokens = 0 if k is None else k.shape[2]
    room = -(-(tokens + restore_slack(tokens)) // step) * step
    if not frozen:
        return min(cap, room)
    if cap > max(MAX_UNIT_TOKENS, room):
        raise ValueError(f"meta_state capacity={cap} (frozen) passes the {MAX_UNIT_TOKENS} positions a "
                         f"capacity may have (the state's keys hold {tokens}); the file is inconsistent")
    if k is not None and v is not None:
        check_restore_fits(cap, k, v)
    return cap


def check_restore_fits(cap: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse a frozen ragged capacity of ``cap`` positions whose keys and values (as ``k`` and
    ``v``: rows, heads, head_dims, dtype) need more than the memory free on their device."""
    (B, H, _, dk), dv, size = k.shape, v.shape[3], k.element_size()
    need = B * H * cap * (dk + dv) * size
    free = free_bytes(k.device)
    if free is None or need <= free:
        return
    dims = f"{dk} head_dim x 2" if dk == dv else f"({dk} + {dv}) head_dims"
    raise ValueError(
        f"meta_state capacity={cap} (frozen) needs {need} bytes ({need / 2**30:.1f} GiB) of keys and values "
        f"({B} rows x {H} kv_heads x {cap} positions x {dims} x {size} bytes), more than the {free} bytes "
        f"({free / 2**30:.1f} GiB) free on {k.device}; free memory or load it on a device with more "
        "(load_cache(path, device=...)), or save the cache again frozen at fewer positions "
        "(freeze_capacity)"
    )
