"""What moves the logits of the requests that ask for it (``logit_bias``, ``min_tokens``' hold on
the stop ids, the penalties), for every such row of a step at once.

Each request that adjusts its logits takes a *slot* at its first sampled step: a row of
buffers ``[slots, vocab]`` on the model's device, made only once some request needs them:

- ``bias`` (float32): its ``logit_bias``;
- ``stops`` (bool): its stop ids, held back (``-inf``) until ``min_tokens`` are out;
- ``counts`` (int32): its generated tokens' counts, grown on the device as they are sampled,
  so the asynchronous engine never waits for the host to count;
- ``seen`` (bool): its prompt's tokens (repetition penalty).

A step gathers the rows' slots and logits and applies everything in a fixed number of
kernels, however many rows there are (one request at a time took several launches a row:
256 penalised rows halved the H100's serving throughput, benchmarks/RESULTS.md,
2026-12-06). The slot goes back when the request ends (:meth:`LogitAdjustments.release`),
and its rows are cleared when the next request takes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.caches.paged_shared import to_device
from kvtier.serve.live import Live

__all__ = ["LogitAdjustments"]

_DTYPES = {"bias": torch.float32, "stops": torch.bool, "counts": torch.int32, "seen": torch.bool}

#: on the CPU the rows are adjusted in blocks of about this many bytes of float32 logits, which
#: stay in the cache through the dozen passes (64 rows of SmolLM2's 49,152 words at once: one
#: pass a step from memory each, and the step took 1.5x as long as row by row)
CPU_BLOCK_BYTES = 2**18


class LogitAdjustments:
    """The slots and buffers of the module docstring, for one engine."""

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}
        self.free: list[int] = []
        self.size = 0
        self.buffers: dict[str, torch.Tensor] = {}
        self.ones: torch.Tensor | None = None  # a count of one for every slot, made with "counts"

    @staticmethod
    def applies(live: Live) -> bool:
        """Whether anything moves ``live``'s logits this step (a bias, a penalty, or stop ids held
        back because fewer than ``min_tokens`` are out)."""
        return bool(live.params.logit_bias or live.params.penalised or live.holds_stops())

    def release(self, request_id: str) -> None:
        """The request has ended: its slot is free again."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def apply(self, logits: torch.Tensor, rows: Sequence[int], lives: Sequence[Live]) -> tuple[torch.Tensor, torch.Tensor]:
        """The adjusted logits ``[n, V]`` (float32, a new tensor: ``logits`` stay the model's own) of
        ``rows`` of ``logits`` ``[B, V]``, ``lives[j]`` the request of ``rows[j]``; and the rows' and
        slots' indices ``[2, n]`` on the device (for :meth:`count`)."""
        slots = [self._slot(lv, logits) for lv in lives]
        params = [lv.params for lv in lives]
        hold = [lv.holds_stops() for lv in lives]
        device = logits.device
        index = to_device(torch.tensor([list(rows), slots]), device)  # two small copies in
        knobs = to_device(torch.tensor([[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                                        [p.repetition_penalty for p in params], hold], dtype=torch.float32), device)
        out = logits.index_select(0, index[0]).float()
        bias, penalties = any(p.logit_bias for p in params), any(p.penalised for p in params)
        repetition = any(p.repetition_penalty != 1.0 for p in params)
        n = len(rows)
        block = n if out.is_cuda else max(1, CPU_BLOCK_BYTES // (4 * out.shape[1]))
        for a in range(0, n, block):  # on the CPU in blocks of rows that stay in the cache
            b = slice(a, a + block)
            if block == 1:  # one row: its knobs as numbers (a scalar's loop is the CPU's faster)
                p = params[a]
                presence, frequency, r = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            else:
                presence, frequency, r = knobs[0, b, None], knobs[1, b, None], knobs[2, b, None]
            held = None
            if any(hold[b]):
                held = self.buffers["stops"].index_select(0, index[1, b])
                if not all(hold[b]):
                    held &= knobs[3, b, None] > 0
            self._adjust(out[b], index[1, b], bias, held, penalties and (presence, frequency, r), repetition)
        return out, index

    def _adjust(self, out: torch.Tensor, s: torch.Tensor, bias: bool, held: torch.Tensor | None,
                penalties: tuple | bool, repetition: bool) -> None:
        """Rows ``out`` (in place) of slots ``s``: their bias, ``-inf`` where ``held``, and with
        ``penalties`` (presence, frequency, repetition: numbers or ``[rows, 1]`` columns) those."""
        b = self.buffers
        if bias:
            out += b["bias"].index_select(0, s)
        if held is not None:
            out.masked_fill_(held, float("-inf"))
        if penalties:
            presence, frequency, r = penalties
            counts = b["counts"].index_select(0, s)
            generated = counts > 0
            if repetition:
                seen = generated | b["seen"].index_select(0, s)
                out.copy_(torch.where(seen, torch.where(out > 0, out / r, out * r), out))
            out -= frequency * counts
            out -= presence * generated

    def count(self, index: torch.Tensor, picked: torch.Tensor) -> None:
        """Count each row's sampled token (``picked`` ``[B]``, the step's tokens) in its slot."""
        if "counts" in self.buffers:
            tokens = picked.index_select(0, index[0])
            self.buffers["counts"].index_put_((index[1], tokens), self.ones[: len(tokens)], accumulate=True)

    # -- slots --------------------------------------------------------------------------------------
    def _slot(self, live: Live, logits: torch.Tensor) -> int:
        rid = live.request.request_id
        slot = self.slots.get(rid)
        if slot is not None:
            return slot
        if not self.free:
            self._grow()
        slot = self.slots[rid] = self.free.pop()
        for buf in self.buffers.values():
            buf[slot].zero_()  # a former request's rows
        p, device = live.params, logits.device
        if p.logit_bias:
            ids, values = zip(*p.logit_bias, strict=True)
            self._buffer("bias", logits)[slot, to_device(torch.tensor(ids), device)] = to_device(
                torch.tensor(values, dtype=torch.float32), device)
        if p.min_tokens and live.text.stop_ids:
            self._buffer("stops", logits)[slot, to_device(torch.tensor(sorted(live.text.stop_ids)), device)] = True
        if p.penalised:
            self._buffer("counts", logits)
        if p.repetition_penalty != 1.0:
            self._buffer("seen", logits)[slot, to_device(torch.tensor(live.request.prompt_token_ids), device)] = True
        return slot

    def _buffer(self, name: str, logits: torch.Tensor) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.zeros(self.size, logits.shape[-1], dtype=_DTYPES[name], device=logits.device)
            if name == "counts":
                self.ones = torch.ones(self.size, dtype=torch.int32, device=logits.device)
        return self.buffers[name]

    def _grow(self) -> None:
        """Twice the slots (8 at first); the buffers made so far keep their rows."""
        new = max(8, 2 * self.size)
        for name, old in self.buffers.items():
            buf = torch.zeros(new, old.shape[1], dtype=old.dtype, device=old.device)
            buf[: self.size] = old
            self.buffers[name] = buf
        if self.ones is not None:
            self.ones = torch.ones(new, dtype=torch.int32, device=self.ones.device)
        self.free.extend(range(new - 1, self.size - 1, -1))  # the lowest slot first
        self.size = new
