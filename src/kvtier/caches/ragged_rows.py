"""Per-row arguments of the ragged tier: ints, sequences or integer tensors, one value per row.

Host values (ints, lists, CPU tensors) are checked on the host; a tensor on an
accelerator is passed through as it is, so that reading it never forces a
device-to-host sync (the tier checks it on the device).
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any

import torch

from kvtier.caches.state_checks import MAX_UNIT_TOKENS

#: the most rows a per-row cache tracks: the bound a config puts on every size
#: (``kvtier.config.MAX_TOKENS``), so a mistyped batch size is refused before anything is built
MAX_ROWS = MAX_UNIT_TOKENS


def round_up(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step``."""
    return math.ceil(n / step) * step


def on_accelerator(x: Any) -> bool:
    """True for a tensor that lives off the CPU."""
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def check_int(v: Any, name: str, minimum: int, maximum: int | None = None) -> int:
    """``v`` if it is an int in ``[minimum, maximum]`` (no upper bound by default), else a
    ``ValueError`` naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (maximum is not None and v > maximum):
        wanted = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {wanted}, got {v!r}")
    return v


def check_batch_size(v: Any) -> int:
    """A per-row cache's ``batch_size``: an int in ``[1, MAX_ROWS]``, checked before any
    per-row list or tensor is built."""
    return check_int(v, "batch_size", 1, MAX_ROWS)


def row_values(x: Any, name: str, batch: int, device: torch.device) -> list[int] | torch.Tensor | None:
    """Per-row ints from an int, a sequence or an integer tensor ``[batch]``: a host list
    (checked >= 0), or the tensor itself when it lives on an accelerator."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}; cast with .long()")
        if tuple(x.shape) != (batch,):
            raise ValueError(f"{name} must have shape ({batch},) (one per row), got {tuple(x.shape)}")
        if on_accelerator(x):
            if x.device != device:
                raise ValueError(f"{name} is on {x.device} but the cache is on {device}")
            return x.long()
        x = x.tolist()
    elif isinstance(x, Integral) and not isinstance(x, bool):
        x = [int(x)] * batch
    elif not isinstance(x, list | tuple) or len(x) != batch:
        raise ValueError(f"{name} must be an int, {batch} ints or a tensor [{batch}], got {x!r}")
    if any(isinstance(v, bool) or not isinstance(v, Integral) for v in x):
        raise ValueError(f"{name} must hold ints, got {x!r}")
    if min(x) < 0:
        raise ValueError(f"{name} must be >= 0, got {list(x)}")
    return [int(v) for v in x]


def host_row_values(x: Any, name: str, batch: int) -> list[int]:
    """Like :func:`row_values`, but always host values (a device tensor is read once)."""
    return row_values(x.cpu() if isinstance(x, torch.Tensor) else x, name, batch, torch.device("cpu"))


def check_host_rows(ws: list[int] | None, no: list[int] | None, lengths: list[int], q: int) -> list[int]:
    """The new row lengths of a ``q``-token write at ``ws`` (default: ``lengths``) committing
    ``no`` (default: all), checked against the rows' ``lengths``: ``ValueError`` for a write
    that would leave a gap or commit outside ``[write_start, write_start + q]``."""
    ws = lengths if ws is None else ws
    for r, (w, n) in enumerate(zip(ws, lengths)):
        if w > n:
            raise ValueError(f"write_start[{r}]={w} is past the row's length {n}; rewrite "
                             "(write_start < length) or append (==), never leave a gap")
    no = [w + q for w in ws] if no is None else no
    for r, (w, n) in enumerate(zip(ws, no)):
        if not w <= n <= w + q:
            raise ValueError(f"new_offsets[{r}]={n} must lie in [write_start, write_start + q]"
                             f" = [{w}, {w + q}]; drop older tokens with trim() or restore_masked()")
    return list(no)


def check_row_mask(mask: Any, batch: int) -> list[bool] | torch.Tensor:
    """``[batch]`` bools: a host list, or the tensor itself when it lives on an accelerator."""
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool or tuple(mask.shape) != (batch,):
            raise ValueError(f"row_mask must be a bool tensor ({batch},), got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        if mask.is_meta:
            raise ValueError("row_mask is on the meta device, which holds no values; pass it on the "
                             "CPU or the cache's device")
        return mask if on_accelerator(mask) else mask.tolist()
    if not isinstance(mask, list | tuple) or [type(m) for m in mask] != [bool] * batch:
        raise ValueError(f"row_mask must be {batch} bools (one per row), got {mask!r}")
    return list(mask)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``, copied without the host waiting on CUDA."""
    if device.type == "cuda":  # pinned + non_blocking: the host does not wait for the copy
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def last_write_starts(starts: Any, lengths: Any, own_q: int, q: int) -> Any:
    """The last-write starts of rows whose last write had ``own_q`` tokens, once they sit in a
    cache whose last write had ``q`` (``restore_masked``, ``extend``): kept when the counts
    agree; else ``max(length - q, 0)``, so that a default ``q``-token query of theirs takes the
    row's newest positions, as any query that is not its last write's tokens does. ``starts``
    and ``lengths``: int64 tensors ``[B]`` or host lists alike."""
    if own_q == q:
        return starts
    if isinstance(lengths, torch.Tensor):
        return (lengths - q).clamp(min=0)
    return [max(0, n - q) for n in lengths]


def query_starts(q_start: Any, batch: int, device: torch.device) -> torch.Tensor:
    """``q_start`` (:func:`row_values`) as int64 ``[batch]`` on ``device``. A start past its row's
    tokens is taken: that row's queries see all of its keys (as a released row's do)."""
    qs = row_values(q_start, "q_start", batch, device)
    return qs if isinstance(qs, torch.Tensor) else torch.tensor(qs, dtype=torch.long, device=device)
