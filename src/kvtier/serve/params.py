"""What a request asks for (:class:`RequestParams`) and what each engine step gives back
(:class:`RequestOutput`). Plain frozen dataclasses, checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.sampling import SamplingParams
from kvtier.serve.structured import Structure

__all__ = ["MAX_BAD_WORD_TOKENS", "MAX_GUIDED_CHOICES", "MAX_LOGPROBS", "RequestOutput", "RequestParams", "TokenLogprob"]

#: the most alternatives a request may ask for per token (OpenAI's limit)
MAX_LOGPROBS = 20

#: tokens of one of ``bad_words`` at most (the engine keeps each request's last
#: ``MAX_BAD_WORD_TOKENS - 1`` tokens on the device to match their prefixes)
MAX_BAD_WORD_TOKENS = 16

#: choices of one ``guided_choice`` at most
MAX_GUIDED_CHOICES = 256


@dataclass(frozen=True)
class RequestParams:
    """How one request generates.

    ``max_tokens``: new tokens at most (``None``: as many as the context leaves);
    ``stop``: strings that end the text (cut from it, or kept as its end with
    ``include_stop_str_in_output``, vLLM's); ``stop_token_ids``: ids that end
    it besides the tokenizer's end-of-sequence ids, which ``ignore_eos`` disregards
    (benchmarks use it to generate a fixed length); ``logprobs``: ``None`` for none,
    else the log-probability of each chosen token and of the ``logprobs`` most likely
    alternatives (0 to :data:`MAX_LOGPROBS`); ``presence_penalty`` and ``frequency_penalty``
    (OpenAI's, -2 to 2) and ``repetition_penalty`` (vLLM's, > 0; 1 is off): see
    :func:`kvtier.sampling.apply_penalties`; ``logit_bias``: ``(token_id, bias)`` pairs, each
    bias in [-100, 100] added to its token's logit before the penalties (OpenAI's; -100 all
    but bans a token); ``min_tokens`` (vLLM's): until that many tokens are out, the
    end-of-sequence and stop ids are not sampled and no stop string ends the text (one
    found by then stays in it). Logprobs stay those of the model's own logits.
    ``prompt_logprobs``: ``None`` for none, else the log-probability of each prompt token
    after the first, given the tokens before it, and of the ``prompt_logprobs`` most likely
    alternatives there (0 to :data:`MAX_LOGPROBS`); they come with the request's first output
    (:attr:`RequestOutput.prompt_logprobs`). Such a request computes its whole prompt (no
    prefix-cache hit) in chunks whose logits take at most
    :data:`~kvtier.serve.engine.PROMPT_LOGITS_BYTES` a step.
    ``allowed_token_ids`` (vLLM's): when given, only these ids are sampled (the end of
    sequence too only if listed); ``bad_words``: token sequences never generated whole (a
    one-token word is never sampled; a longer one's last token is not sampled after the
    request's output ends with the rest of it), at most :data:`MAX_BAD_WORD_TOKENS` tokens
    each. Where a bad word's last token is the only one left to sample, it is sampled.
    ``guided_choice`` (vLLM's, as token sequences): the answer is one of these sequences
    followed by a stop id (at each step only the next tokens of the sequences the answer
    still follows are sampled, and a stop id once one is whole); not with
    ``allowed_token_ids``, ``bad_words`` or ``min_tokens``, and it needs a stop id.
    ``structure``: the answer follows a JSON schema, is a JSON object, matches a regular
    expression or a grammar (:class:`~kvtier.serve.structured.Structure`), then a stop id; the
    same conditions as ``guided_choice``, and not with it. ``priority``: under the engine's
    ``"priority"`` scheduling policy, lower values are admitted first and preempted last.
    """

    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    guided_choice: tuple[tuple[int, ...], ...] = ()
    structure: Structure | None = None
    priority: int = 0

    @property
    def penalised(self) -> bool:
        """Whether a presence, frequency or repetition penalty moves this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def __post_init__(self) -> None:
        m = self.max_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {m!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(_token_id(t) for t in ids):
                raise ValueError(f"{name} must be a tuple of ints >= 0, got {ids!r}")
        if not isinstance(self.bad_words, tuple) or not all(
                isinstance(w, tuple) and 1 <= len(w) <= MAX_BAD_WORD_TOKENS and all(map(_token_id, w))
                for w in self.bad_words):
            raise ValueError(f"bad_words must be a tuple of token-id tuples of 1 to {MAX_BAD_WORD_TOKENS} "
                             f"ids >= 0 each, got {self.bad_words!r}")
        g = self.guided_choice
        if not isinstance(g, tuple) or len(g) > MAX_GUIDED_CHOICES or not all(
                isinstance(c, tuple) and c and all(map(_token_id, c)) for c in g):
            raise ValueError(f"guided_choice must be a tuple of at most {MAX_GUIDED_CHOICES} non-empty token-id "
                             f"tuples, got {len(g) if isinstance(g, tuple) else type(g).__name__} choices")
        if g and (self.allowed_token_ids or self.bad_words or self.min_tokens):
            raise ValueError("guided_choice chooses every token itself; it does not go with allowed_token_ids, "
                             "bad_words or min_tokens: drop those")
        if self.structure is not None and not isinstance(self.structure, Structure):
            raise ValueError(f"structure must be a Structure or None, got {type(self.structure).__name__}")
        if self.structure is not None and (g or self.allowed_token_ids or self.bad_words or self.min_tokens):
            raise ValueError("structure chooses which tokens may come itself; it does not go with guided_choice, "
                             "allowed_token_ids, bad_words or min_tokens: drop those")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, int | float) or not (0 < r < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {r!r}")
        k = self.min_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0 or (m is not None and k > m):
            raise ValueError(f"min_tokens must be an int in [0, max_tokens], got {k!r} "
                             f"(max_tokens {m!r})")
        if not isinstance(self.logit_bias, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int)
                and not isinstance(pair[0], bool) and pair[0] >= 0 and isinstance(pair[1], int | float)
                and not isinstance(pair[1], bool) and -100.0 <= pair[1] <= 100.0 for pair in self.logit_bias):
            raise ValueError(f"logit_bias must be a tuple of (token id >= 0, bias in [-100, 100]) pairs, "
                             f"got {self.logit_bias!r}")

    def check_vocabulary(self, vocab: int) -> None:
        """``ValueError`` naming the first field that holds a token id outside ``[0, vocab)``."""
        outside = [t for t in self.stop_token_ids if t >= vocab]
        if outside:
            raise ValueError(f"stop_token_ids {outside[:5]} are outside the vocabulary [0, {vocab}); "
                             "no token could match them")
        outside = [t for t, _ in self.logit_bias if t >= vocab]
        if outside:
            raise ValueError(f"logit_bias names token ids {outside[:5]} outside the vocabulary [0, {vocab})")
        for name, named in (("allowed_token_ids", self.allowed_token_ids),
                            ("bad_words", [t for w in self.bad_words for t in w]),
                            ("guided_choice", [t for c in self.guided_choice for t in c])):
            outside = [t for t in named if t >= vocab]
            if outside:
                raise ValueError(f"{name} holds token ids {outside[:5]} outside the vocabulary [0, {vocab})")


def _token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability (natural log, of the model's own distribution: before temperature
    and filters) of a chosen token, and the ``top`` alternatives as ``(token_id, logprob)``;
    for a prompt token, ``rank``: its place in the vocabulary, 1 for the most likely."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request.

    ``text`` and ``token_ids`` are new since the previous output (``text`` may lag
    the tokens while a multi-byte character or a possible stop string is incomplete);
    ``finish_reason`` is ``None`` while it runs, then ``"stop"`` (an end-of-sequence
    id, a stop id or string) or ``"length"`` (``max_tokens`` or the context).
    Times are ``time.monotonic()`` seconds: arrival, first token, finish.
    ``prompt_logprobs`` (asked for by :attr:`RequestParams.prompt_logprobs`, on the first
    output only): one entry per prompt token, ``None`` for the first (nothing precedes it).
    ``pieces``: where a step gave several tokens (drafts kept, :mod:`kvtier.serve.speculate`),
    the text each token gave, whose join is ``text``; empty otherwise.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    pieces: tuple[str, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
