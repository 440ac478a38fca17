"""Prefill: writing prompts into the caches before decoding, a chunk of tokens a forward.

:func:`prefill` writes every prompt but its last token (the first decode step's input), in
lock step on the scalar tiers (:func:`prefill_lockstep`: one length for every row) and row by
row on the per-row tiers (:func:`prefill_rows`: each row at its own positions, padding past
its length). A forward takes ``chunk`` tokens a row; by default :func:`prefill_chunk_for`
shares :data:`PREFILL_TOKENS` among the rows.
"""

from __future__ import annotations

import torch

from kvtier.caches.base import RowKVCache

#: prompt tokens of all rows a prefill forward by default (at least 512 a row). A packed model
#: dequantises its weights once a forward: a 2,048-token prompt on the 2-core CPU took 4.3-4.9 s
#: (median 4.52) in one forward against 4.8-6.5 s (4.97) in chunks of 512, eight alternated
#: rounds (benchmarks/RESULTS.md, 2026-12-03)
PREFILL_TOKENS = 2048


def prefill_chunk_for(rows: int) -> int:
    """The default prefill chunk of ``rows`` prompts: :data:`PREFILL_TOKENS` in all, at least 512 a row.

    >>> prefill_chunk_for(1), prefill_chunk_for(2), prefill_chunk_for(8)
    (2048, 1024, 512)
    """
    return max(512, PREFILL_TOKENS // max(1, rows))


def prefill(model, rows, caches, chunk, device, on_progress) -> None:
    """Write every prompt but its last token: row by row on the ragged and paged tiers
    (:func:`prefill_rows`), in lock step on the others (:func:`prefill_lockstep`), ``chunk``
    tokens a row a forward (``None``: :func:`prefill_chunk_for`)."""
    if chunk is None:
        chunk = prefill_chunk_for(len(rows))
    if isinstance(caches[0], RowKVCache):
        prefill_rows(model, rows, caches, chunk, device, on_progress)
    else:
        prefill_lockstep(model, rows, caches, chunk, device, on_progress)


def prefill_lockstep(model, rows, caches, chunk, device, on_progress) -> None:
    """Scalar tiers: every row has the same length and the caches one offset."""
    if len({len(r) for r in rows}) != 1:
        raise ValueError(
            f"the {caches[0].tier} tier keeps one length for every row, but the prompts have "
            f"lengths {[len(r) for r in rows]}; use the ragged or paged tier, or stream_generate "
            "(which runs such a batch row by row)"
        )
    start, end = caches[0].offset, len(rows[0]) - 1
    if start > end:
        raise ValueError(
            f"the caches hold {start} tokens but the prompt has {end + 1}; at most "
            f"{end} may be reused (trim the caches)"
        )
    tokens = torch.tensor(rows, dtype=torch.long, device=device)  # (B, L)
    for s in range(start, end, chunk):
        e = min(s + chunk, end)
        model(tokens[:, s:e], caches, last_only=True)
        if on_progress is not None:
            on_progress(e - start, end - start)


def prefill_rows(model, rows, caches, chunk, device, on_progress) -> None:
    """Per-row tiers: row ``r`` writes its own tokens at its own positions, all but its
    last prompt token (where decoding starts).

    Each forward takes the next ``chunk`` tokens of every row, right-padded to a
    common width; ``new_offsets`` commits only the row's real tokens, so the
    padding is written past the row's length and never becomes part of it. The rows
    go to the caches as host values, so their books keep the lengths (no device read).
    """
    B = len(rows)
    starts = caches[0].lengths if caches[0].size() else [0] * B  # a fresh cache may not know its batch
    if len(starts) != B:
        raise ValueError(f"the caches hold {len(starts)} rows but {B} prompts were given")
    ends = [len(r) - 1 for r in rows]
    for i, (s, e) in enumerate(zip(starts, ends)):
        if s > e:
            raise ValueError(
                f"row {i}: the caches hold {s} tokens but its prompt has {e + 1}; "
                f"at most {e} may be reused (trim the caches)"
            )
    total = sum(e - s for s, e in zip(starts, ends))
    n_chunks = max(-(-(e - s) // chunk) for s, e in zip(starts, ends))
    done = 0
    for c in range(n_chunks):
        ws = [min(s + c * chunk, e) for s, e in zip(starts, ends)]
        no = [min(s + (c + 1) * chunk, e) for s, e in zip(starts, ends)]
        width = max(n - w for w, n in zip(ws, no))
        # rows that are done (or shorter) take padding; it lies past new_offsets
        block = [r[w : w + width] + [0] * (width - len(r[w : w + width])) for r, w in zip(rows, ws)]
        kw = {"write_start": torch.tensor(ws, dtype=torch.long), "new_offsets": torch.tensor(no, dtype=torch.long)}
        model(torch.tensor(block, dtype=torch.long, device=device), caches, cache_kwargs=kw, last_only=True)
        done += sum(n - w for w, n in zip(ws, no))
        if on_progress is not None:
            on_progress(done, total)
