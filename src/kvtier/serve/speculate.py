"""Speculative decoding in the serving engine: prompt-lookup (n-gram) drafts, verified in the
step that feeds them.

A running request whose next token comes from the model's own logits (greedy, or sampled
with temperature, top-k, top-p, min-p) may feed more than its last token in a decode step:
its last token and up to
``num_speculative_tokens`` drafts, the tokens that followed the latest earlier occurrence
of the n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) that ends its
prompt and output so far (:class:`kvtier.drafters.NgramDrafter`'s lookup, kept per request
by :class:`NgramIndex`). The step computes the logits of every fed position. A greedy
row keeps the drafts up to the first one that is not the best token after the tokens
before it, and that best token follows them: always the tokens greedy decoding gives one
at a time. A sampling row keeps each draft with the probability plain sampling gives it,
and after the first it rejects draws from the rest of that distribution (rejection
sampling, :func:`kvtier.speculative.accept_drafts`, with the request's generator): its
tokens follow plain sampling's distribution, and a seed gives the same tokens each time,
though not those it gives without drafts. Drafts cost compute (their positions), never a
token. Text that repeats (code edits, quotes of the prompt, lists, JSON) gives the most.

The rows that draft: nothing moving the logits (no bias, penalty, ban,
guided choice, structured output, or stop ids held back by ``min_tokens``), no prompt
logprobs still to compute; a row's logprobs come from the logits of each position it fed.
Other requests decode a token a step beside them. Drafts never preempt: they take the
room a request's blocks hold, and fresh blocks only while more stay free than requests
run. The keys and values of rejected drafts stay past the request's length, where its
next tokens overwrite them; the prefix cache hashes only the tokens kept.

The engine runs it synchronously (a step's drafts come from the tokens of the step before,
which asynchronous scheduling would not have yet) and decodes such steps without CUDA
graphs (their rows feed several tokens). vLLM's ``--speculative-config`` spells the same
(``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``).

Example::

    >>> spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    >>> spec.num_speculative_tokens, spec.prompt_lookup_max
    (3, 4)
    >>> Speculator(spec).accept((7, 8, 9), [7, 8, 5, 2])  # two drafts kept, then the model's 5
    [7, 8, 5]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from kvtier.caches.paged_shared import to_device
from kvtier.drafters import Draft, continuation
from kvtier.serve.adjust import LogitAdjustments
from kvtier.serve.live import Live
from kvtier.serve.scheduler import ScheduledRow
from kvtier.speculative import accept_drafts

__all__ = ["METHODS", "MAX_SPECULATIVE_TOKENS", "NgramIndex", "SpeculativeConfig", "Speculator", "speculates",
           "verified"]

#: the drafting methods served
METHODS = ("ngram",)
#: drafts a row feeds in a step at most
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` (``"ngram"``: prompt lookup), ``num_speculative_tokens`` drafts a step at most,
    looked up from n-grams of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens;
    ``disable_by_batch_size``: no drafts in a step while more requests than this run (vLLM's
    key; ``None``: drafts at any batch size). Where a step is bound by compute rather than by
    reading the weights (many rows, or a CPU), drafts cost more than they give."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not served; use one of {list(METHODS)} "
                             "(drafts looked up in the request's own tokens)")
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
                                ("prompt_lookup_max", 1, None), ("prompt_lookup_min", 1, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be an int {bound}, got {v!r}")
        n = self.disable_by_batch_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"disable_by_batch_size must be an int >= 1 or null, got {n!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} is above prompt_lookup_max "
                             f"{self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: str | Mapping) -> SpeculativeConfig:
        """From vLLM's ``--speculative-config``: a JSON object (text or a mapping) of this
        class's fields; ``"model"`` may name ``"ngram"`` or ``"[ngram]"``, as vLLM's older
        spelling does. A ``ValueError`` names an unknown key or a bad value."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"the speculative config is not JSON ({e.msg}): give an object such as "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, Mapping):
            raise ValueError(f"the speculative config must be a JSON object, got {type(value).__name__}")
        value = dict(value)
        model = value.pop("model", None)
        if model is not None:
            if model not in ("ngram", "[ngram]"):
                raise ValueError(f"a draft model ({model!r}) is not served; drafts come from the request's own "
                                 'tokens: {"method": "ngram"}')
            value.setdefault("method", "ngram")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        return cls(**value)


class NgramIndex:
    """:meth:`NgramDrafter.lookup <kvtier.drafters.NgramDrafter.lookup>` over one request's growing
    tokens, kept as it grows: the latest start of every n-gram (``min_n`` to ``max_n`` tokens) that
    ends before the last token, so a lookup reads a few entries instead of scanning the context
    (which, over hundreds of rows of long contexts a step, took milliseconds of the host's time)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.seen = 0  # n-grams ending before this position are in ``starts``
        self.starts: dict[tuple[int, ...], int] = {}

    def lookup(self, ctx: Sequence[int], k: int) -> list[int]:
        """The drafter's lookup of ``ctx`` (this index's tokens, grown since the last call)."""
        L = len(ctx)
        if self.seen > L - 1:  # (not the tokens it indexed: start again)
            self.seen, self.starts = 0, {}
        for e in range(self.seen, L - 1):  # the n-grams ending at e, latest last
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                self.starts[tuple(ctx[e - n + 1 : e + 1])] = e - n + 1
        self.seen = max(self.seen, L - 1)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            s = self.starts.get(tuple(ctx[L - n :]))
            if s is not None:
                return continuation(ctx, s + n, k)
        return []


def speculates(live: Live) -> bool:
    """Whether ``live``'s decode rows may carry drafts (the module docstring's rows)."""
    return not live.request.prompt_logits and not LogitAdjustments.applies(live)


def verified(draft_logits: Mapping[str, torch.Tensor], rows: Sequence[ScheduledRow],
             lives: Mapping[str, Live]) -> tuple[dict, dict]:
    """For each of ``rows`` that fed drafts, from its logits ``[draft + 1, V]``
    (:attr:`ModelRunner.draft_logits <kvtier.serve.runner.ModelRunner.draft_logits>`): the tokens
    that judge its drafts, ``[draft + 1]``, whose first mismatch with the drafts is the token that
    follows the kept ones (:meth:`Speculator.accept`): a greedy row's best tokens; a sampling row's
    kept drafts then its next token, by rejection sampling from the distribution plain sampling
    draws from (:func:`kvtier.speculative.accept_drafts`, with the request's generator). And where
    the request asks for logprobs, those of each of those tokens: (chosen ``[draft + 1]``, top
    values and ids ``[draft + 1, k]``). All copies on their way to the host."""
    judged, logprobs = {}, {}
    for row in rows if draft_logits else ():  # (no drafts this step: nothing to look at)
        if not row.draft:
            continue
        rid, logits = row.request_id, draft_logits[row.request_id]
        live = lives[rid]
        if live.params.sampling.greedy:
            b = logits.argmax(dim=-1)
        else:
            d = to_device(torch.tensor(row.token_ids[-row.draft:]), logits.device)
            kept, after = accept_drafts(logits[None], Draft(d[None], [row.draft]), live.params.sampling,
                                        live.generator)
            b = torch.cat([d, d[:1]]).index_put_((kept,), after)  # (a rejected draft is never drawn again)
        judged[rid] = b.to("cpu", non_blocking=True)
        top = live.params.logprobs
        if top is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            vals, idx = lp.topk(top, dim=-1) if top else (lp[:, :0], b[:, None][:, :0])
            logprobs[rid] = tuple(t.to("cpu", non_blocking=True) for t in (lp.gather(1, b[:, None])[:, 0], vals, idx))
    return judged, logprobs


class Speculator:
    """Drafts for the scheduler and their verification for the engine, with the counts
    ``/metrics`` reports: ``drafts`` (rows that fed drafts), ``draft_tokens``, ``accepted``."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.drafts = self.draft_tokens = self.accepted = 0

    def propose(self, live: Live, k: int, running: int = 1) -> list[int]:
        """Up to ``k`` (and ``num_speculative_tokens``) drafts to follow the tokens of ``live``'s
        request, through its :class:`NgramIndex` (made on its first call, kept on ``live``);
        none while ``running`` requests are more than ``disable_by_batch_size``."""
        k = min(k, self.config.num_speculative_tokens)
        limit = self.config.disable_by_batch_size
        if k <= 0 or (limit is not None and running > limit):
            return []
        if live.ngrams is None:
            live.ngrams = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        return live.ngrams.lookup(live.request.token_ids, k)

    def accept(self, draft: Sequence[int], best: Sequence[int]) -> list[int]:
        """The tokens a row gives: ``draft`` kept while each is ``best`` at its place (the token
        :func:`verified` judges right after the tokens before it; ``best`` has one more), then
        the first of ``best`` that is not the draft at its place."""
        a = 0
        while a < len(draft) and best[a] == draft[a]:
            a += 1
        self.drafts += 1
        self.draft_tokens += len(draft)
        self.accepted += a
        return [int(t) for t in best[: a + 1]]

    def kept(self, given: int, kept: int) -> None:
        """A row :meth:`accept` gave ``given`` tokens (its drafts kept, then the model's) kept only
        ``kept`` of them (a stop string or token ended it): the drafts after those are not counted."""
        self.accepted -= max(0, (given - 1) - kept)

    def stats(self) -> dict[str, int | float]:
        return {"spec_drafts": self.drafts, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted,
                "spec_acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else 0.0}
