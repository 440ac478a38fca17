"""What moves the logits of the requests that ask for it (``logit_bias``, ``min_tokens``' hold on
the stop ids, the penalties, ``allowed_token_ids``, ``bad_words``, ``guided_choice`` and
structured outputs), for every such row of a step at once.

Each request that adjusts its logits takes a *slot* at its first sampled step: a row of
buffers ``[slots, vocab]`` on the model's device, made only once some request needs them:

- ``bias`` (float32): its ``logit_bias``;
- ``stops`` (bool): its stop ids, held back (``-inf``) until ``min_tokens`` are out;
- ``counts`` (int32): its generated tokens' counts, grown on the device as they are sampled,
  so the asynchronous engine never waits for the host to count;
- ``seen`` (bool): its prompt's tokens (repetition penalty);
- ``banned`` (bool): tokens never sampled (those outside ``allowed_token_ids``, one-token bad
  words);
- ``recent`` (int32, ``[slots, MAX_BAD_WORD_TOKENS - 1]``): its last generated tokens, shifted
  in on the device as they are sampled (-1 before there are any), against which the prefixes of
  its longer bad words are matched; a match bans the word's last token for that step.

A request with ``guided_choice`` keeps its choices on the device (``[c, longest + 1]``, padded
with -1), which of them its answer still follows, and its count of tokens; a step allows the
next token of each choice still followed, and the stop ids once one is whole. These rows are
done one at a time (a few kernels each). A structured output's rows (a JSON schema, a pattern, a
grammar) take their allowed tokens from their matchers, all in one bitmask
(:func:`kvtier.serve.structured.mask_rows`).

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
from kvtier.serve.params import MAX_BAD_WORD_TOKENS
from kvtier.serve.structured import mask_rows

__all__ = ["LogitAdjustments"]

_DTYPES = {"bias": torch.float32, "stops": torch.bool, "counts": torch.int32, "seen": torch.bool,
           "banned": torch.bool, "recent": torch.int32}
#: what a free slot's row holds (zero where not named)
_EMPTY = {"recent": -1}
#: a bad word's prefix padded on the left to MAX_BAD_WORD_TOKENS - 1 with this (matches anything)
_ANY = -2

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
        # slot -> its bad words of two tokens or more on the device: prefixes [w, MAX_BAD_WORD_TOKENS - 1]
        # (padded on the left with _ANY) and last tokens [w]
        self.words: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # slot -> its guided choices [c, longest + 1], their lengths [c], those still followed [c],
        # its tokens so far [1] and its stop ids, all on the device
        self.guided: dict[int, tuple[torch.Tensor, ...]] = {}
        self._guided_rows: list[tuple[int, int]] = []  # (row of the last apply, slot)
        self.bans: set[int] = set()  # slots with a row of "banned" (set when the slot is taken)

    @staticmethod
    def applies(live: Live) -> bool:
        """Whether anything moves ``live``'s logits this step (a bias, a penalty, a ban, guided
        choices, a structured output, or stop ids held back because fewer than ``min_tokens``
        are out)."""
        p = live.params
        return bool(p.logit_bias or p.penalised or p.allowed_token_ids or p.bad_words or p.guided_choice
                    or live.matcher is not None or live.holds_stops())

    def release(self, request_id: str) -> None:
        """The request has ended: its slot is free again."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.words.pop(slot, None)
            self.guided.pop(slot, None)
            self.bans.discard(slot)
            self.free.append(slot)

    def apply(self, logits: torch.Tensor, rows: Sequence[int], lives: Sequence[Live]) -> tuple[torch.Tensor, torch.Tensor]:
        """The adjusted logits ``[n, V]`` (float32, a new tensor: ``logits`` stay the model's own) of
        ``rows`` of ``logits`` ``[B, V]``, ``lives[j]`` the request of ``rows[j]``; and the rows' and
        slots' indices ``[2, n]`` on the device (for :meth:`count`)."""
        slots = [self._slot(lv, logits) for lv in lives]
        params = [lv.params for lv in lives]
        hold = [lv.holds_stops() for lv in lives]
        device = logits.device
        index = to_device(torch.tensor([list(rows), slots]), device)
        out = logits.index_select(0, index[0]).float()
        bias, penalties = any(p.logit_bias for p in params), any(p.penalised for p in params)
        banned = not self.bans.isdisjoint(slots)
        repetition = any(p.repetition_penalty != 1.0 for p in params)
        n = len(rows)
        block = n if out.is_cuda else max(1, CPU_BLOCK_BYTES // (4 * out.shape[1]))
        knobs = None  # the rows' penalties and holds as columns, copied in only where a block needs them
        if (penalties and block > 1) or (any(hold) and not all(hold)):
            knobs = to_device(torch.tensor([[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                                            [p.repetition_penalty for p in params], hold], dtype=torch.float32), device)
        for a in range(0, n, block):  # on the CPU in blocks of rows that stay in the cache
            b = slice(a, a + block)
            knob = None
            if penalties and block == 1:  # one row: its knobs as numbers (a scalar's loop is the CPU's faster)
                knob = (params[a].presence_penalty, params[a].frequency_penalty, params[a].repetition_penalty)
            elif penalties:
                knob = (knobs[0, b, None], knobs[1, b, None], knobs[2, b, None])
            held = None
            if any(hold[b]):
                held = self.buffers["stops"].index_select(0, index[1, b])
                if not all(hold[b]):
                    held &= knobs[3, b, None] > 0
            self._adjust(out[b], index[1, b], bias, banned, held, knob, repetition)
        if any(s in self.words for s in slots):
            self._ban_word_ends(out, slots)
        self._guided_rows = [(j, s) for j, s in enumerate(slots) if s in self.guided]
        if self._guided_rows:  # (one buffer of allowed tokens for all of them)
            allow = torch.zeros(len(self._guided_rows), out.shape[1], dtype=torch.int32, device=device)
            for m, (j, slot) in enumerate(self._guided_rows):
                self._guide(out[j], allow[m], *self.guided[slot])
        grammar = [(j, lv.matcher) for j, lv in enumerate(lives)
                   if lv.matcher is not None and not lv.matcher.ended and not lv.matcher.waiting]
        if grammar:  # (a row whose grammar has ended is sampled once more and dropped: left as it is)
            mask_rows(out, *zip(*grammar))
        return out, index

    @staticmethod
    def _guide(row: torch.Tensor, allow: torch.Tensor, choices, lengths, followed, k, stops) -> None:
        """``-inf`` in ``row`` but at the next token of each choice still followed after ``k``
        tokens, and at the stop ids once one of them is whole. (A request that has ended, whose
        step runs once more under asynchronous scheduling, has nothing left: its row stays.)
        ``allow``: zeros ``[V]`` to count the allowed tokens in."""
        col = choices.index_select(1, k.clamp(max=choices.shape[1] - 1))[:, 0]
        allow.index_put_((col.clamp(min=0),), (followed & (k < lengths)).int(), accumulate=True)
        whole = (followed & (k == lengths)).any().int()
        allow.index_put_((stops,), whole.expand(stops.shape[0]), accumulate=True)
        row.masked_fill_((allow == 0) & (allow.sum() > 0), float("-inf"))

    def _adjust(self, out: torch.Tensor, s: torch.Tensor, bias: bool, banned: bool, held: torch.Tensor | None,
                penalties: tuple | None, repetition: bool) -> None:
        """Rows ``out`` (in place) of slots ``s``: their bias, ``-inf`` where ``banned`` or ``held``,
        and with ``penalties`` (presence, frequency, repetition: numbers or ``[rows, 1]`` columns)
        those."""
        b = self.buffers
        if bias:
            out += b["bias"].index_select(0, s)
        if banned:
            out.masked_fill_(b["banned"].index_select(0, s), float("-inf"))
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

    def _ban_word_ends(self, out: torch.Tensor, slots: list[int]) -> None:
        """``-inf`` at the last token of each bad word whose other tokens end its row's output
        (``out`` row j is slot ``slots[j]``'s); a row left with nothing to sample keeps its
        logits as they were before this."""
        js = [j for j, slot in enumerate(slots) if slot in self.words]
        prefix = torch.cat([self.words[slots[j]][0] for j in js])
        ends = torch.cat([self.words[slots[j]][1] for j in js])
        counts = [len(self.words[slots[j]][1]) for j in js]
        rows = to_device(torch.tensor([js, [slots[j] for j in js]]), out.device).repeat_interleave(
            to_device(torch.tensor(counts), out.device), dim=1, output_size=sum(counts))
        recent = self.buffers["recent"].index_select(0, rows[1])
        match = ((recent == prefix) | (prefix == _ANY)).all(dim=-1)
        touched = to_device(torch.tensor(js), out.device)
        before = out.index_select(0, touched)
        out.index_put_((rows[0], ends), torch.where(match, float("-inf"), 0.0), accumulate=True)
        after = out.index_select(0, touched)
        dead = torch.isneginf(after).all(dim=-1, keepdim=True)
        out.index_copy_(0, touched, torch.where(dead, before, after))

    def count(self, index: torch.Tensor, picked: torch.Tensor) -> None:
        """Count each row's sampled token (``picked`` ``[B]``, the step's tokens) in its slot, and
        shift it into the slot's recent tokens."""
        if not (self._guided_rows or "counts" in self.buffers or "recent" in self.buffers):
            return
        tokens = picked.index_select(0, index[0])
        for j, slot in self._guided_rows:  # the choices the answer still follows, its count
            choices, _, followed, k, _ = self.guided[slot]
            followed &= choices.index_select(1, k.clamp(max=choices.shape[1] - 1))[:, 0] == tokens[j]
            k += 1
        if "counts" in self.buffers:
            self.buffers["counts"].index_put_((index[1], tokens), self.ones[: len(tokens)], accumulate=True)
        if "recent" in self.buffers:
            recent = self.buffers["recent"]
            recent.index_copy_(0, index[1], torch.cat([recent.index_select(0, index[1])[:, 1:],
                                                       tokens[:, None].to(recent.dtype)], dim=1))

    # -- slots --------------------------------------------------------------------------------------
    def _slot(self, live: Live, logits: torch.Tensor) -> int:
        rid = live.request.request_id
        slot = self.slots.get(rid)
        if slot is not None:
            return slot
        if not self.free:
            self._grow()
        slot = self.slots[rid] = self.free.pop()
        for name, buf in self.buffers.items():
            buf[slot] = _EMPTY.get(name, 0)  # a former request's rows
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
        ones = [w[0] for w in p.bad_words if len(w) == 1]
        if p.allowed_token_ids or ones:
            banned = self._buffer("banned", logits)
            self.bans.add(slot)
            if p.allowed_token_ids:
                banned[slot] = True
                banned[slot, to_device(torch.tensor(p.allowed_token_ids), device)] = False
            if ones:
                banned[slot, to_device(torch.tensor(ones), device)] = True
        if p.guided_choice:
            width = max(map(len, p.guided_choice)) + 1
            choices = torch.tensor([list(c) + [-1] * (width - len(c)) for c in p.guided_choice])
            self.guided[slot] = tuple(to_device(t, device) for t in (
                choices, torch.tensor([len(c) for c in p.guided_choice]), torch.ones(len(choices), dtype=torch.bool),
                torch.zeros(1, dtype=torch.long), torch.tensor(sorted(live.text.stop_ids))))
        longer = [w for w in p.bad_words if len(w) > 1]
        if longer:
            self._buffer("recent", logits)
            h = MAX_BAD_WORD_TOKENS - 1
            prefixes = torch.tensor([[_ANY] * (h - len(w) + 1) + list(w[:-1]) for w in longer], dtype=torch.int32)
            self.words[slot] = (to_device(prefixes, device), to_device(torch.tensor([w[-1] for w in longer]), device))
        return slot

    def _buffer(self, name: str, logits: torch.Tensor) -> torch.Tensor:
        if name not in self.buffers:
            width = MAX_BAD_WORD_TOKENS - 1 if name == "recent" else logits.shape[-1]
            self.buffers[name] = torch.full((self.size, width), _EMPTY.get(name, 0), dtype=_DTYPES[name],
                                            device=logits.device)
            if name == "counts":
                self.ones = torch.ones(self.size, dtype=torch.int32, device=logits.device)
        return self.buffers[name]

    def _grow(self) -> None:
        """Twice the slots (8 at first); the buffers made so far keep their rows."""
        new = max(8, 2 * self.size)
        for name, old in self.buffers.items():
            buf = torch.full((new, old.shape[1]), _EMPTY.get(name, 0), dtype=old.dtype, device=old.device)
            buf[: self.size] = old
            self.buffers[name] = buf
        if self.ones is not None:
            self.ones = torch.ones(new, dtype=torch.int32, device=self.ones.device)
        self.free.extend(range(new - 1, self.size - 1, -1))  # the lowest slot first
        self.size = new
