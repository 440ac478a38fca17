"""Generation over any tier, in three layers (each one short):

1. :func:`generate_step` yields the sampled tokens ``[B]`` of one step at a time:
   chunked prefill, then decode.
2. :func:`stream_generate` turns them into :class:`GenerationResponse` objects:
   text deltas, stop tokens and strings, max tokens, running timings. It is one
   shell (:func:`stream_steps`) around a step function: plain decoding
   (:func:`plain_steps`), or speculative decoding with a ``drafter``
   (:mod:`kvtier.speculative`).
3. :func:`generate` returns the text.

Batches of prompts of different lengths
---------------------------------------
The per-row tiers (``ragged``, ``paged``: a :class:`~kvtier.caches.base.RowKVCache`)
hold rows of different lengths, so the whole batch runs in one forward per step: prefill right-pads every row to the
longest prompt and commits only each row's own tokens (``new_offsets``), and
each decode step writes row ``r`` at its own position (``write_start = offsets``).
The scalar tiers (``tail``, ``block``) keep one length for every row, and a
padded row would attend to its padding: a batch of equal-length prompts runs in
lock-step, and a batch of different lengths runs row by row (each row with its
own fresh caches), which gives exactly the batch-1 result.

The prompt's last token is not prefilled: it is the input of the first decode
step, so every row's first logits come from its own last prompt position without
computing logits for the whole prompt.

Example::

    >>> from kvtier.model import load_model
    >>> lm = load_model()
    >>> generate(lm.model, lm.tokenizer, "The capital of France is",
    ...          GenerationConfig(max_tokens=8))
    ' Paris.\n\nThe answer is:'
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral

import torch

from kvtier.caches.base import KVCache, RowKVCache
from kvtier.config import KVCacheConfig, make_caches
from kvtier.cuda_graph import check_graph_tier, make_decoder
from kvtier.limits import context_room
from kvtier.prefill import prefill
from kvtier.sampling import SamplingParams, make_generator, sample

Prompt = str | Sequence[int]
ProgressFn = Callable[[int, int], None]
#: a step function of :func:`stream_steps`: ``steps(rows, caches, *, generator, stop_ids,
#: on_progress, on_prefilled)`` yields, per forward, the new tokens of each row (``B`` lists)
StepFn = Callable[..., Generator[list[list[int]], None, None]]


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate: token budget, stop conditions, sampling, prefill chunk size."""

    max_tokens: int = 256
    #: strings that end a row; checked on the decoded text and cut from the output
    stop: tuple[str, ...] = ()
    #: token ids that end a row, besides the tokenizer's end-of-sequence ids
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: prompt tokens a row per prefill forward (bounds the activation memory of long prompts);
    #: None: ``kvtier.prefill.prefill_chunk_for(rows)``, 2,048 tokens shared by the rows, at least 512 a row
    prefill_chunk: int | None = None
    #: replay decode steps from a CUDA graph (ragged and paged tiers on CUDA; the caches are
    #: frozen for max_tokens steps); None: whenever it can serve, False: never
    cuda_graph: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"stop must be a tuple of non-empty strings, got {self.stop!r}; "
                "write stop=('</s>',) for a single string"
            )
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a tuple of ints >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        c = self.prefill_chunk
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"prefill_chunk must be None (auto) or an int >= 1, got {c!r}")
        if self.cuda_graph is not None and not isinstance(self.cuda_graph, bool):
            raise ValueError(f"cuda_graph must be None (auto), True or False, got {self.cuda_graph!r}")


# -- layer 1: tokens ---------------------------------------------------------------


def generate_step(
    model,
    prompts: Sequence[Sequence[int]],
    caches: list[KVCache],
    *,
    params: SamplingParams | None = None,
    prefill_chunk: int | None = GenerationConfig.prefill_chunk,
    generator: torch.Generator | None = None,
    on_progress: ProgressFn | None = None,
    on_prefilled: Callable[[], None] | None = None,
    cuda_graph: bool | None = None,
    max_steps: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the sampled tokens of each step, ``[B]`` int64 on the model's device, until every
    row has filled the model's context (:func:`kvtier.limits.context_room`; ids checked first).

    ``prompts``: ``B`` lists of token ids (each at least one token). ``caches``: one
    cache per layer, empty or already holding a prefix of every prompt (a reused
    prompt cache); only the rest is prefilled. Scalar tiers need prompts of equal
    length (see the module docstring); per-row tiers take any lengths. Rows never
    stop here: the caller ignores the rows it has finished and closes the
    generator. ``on_progress(done, total)`` is called after each prefill chunk and
    ``on_prefilled()`` once the prompt (but its last token) is in the caches.

    Per-row tiers decode through one step plan for every layer, and
    ``cuda_graph`` (``None``: whenever it can serve) replays the step from a CUDA
    graph, with the caches frozen for ``max_steps`` decode steps (``None``: they
    must be frozen already); see :func:`kvtier.cuda_graph.make_decoder`.
    """
    params = SamplingParams() if params is None else params
    rows = check_prompts(prompts)
    steps = max(context_room(model, rows))  # ends once every row has reached the context
    device = model_device(model)
    per_row = isinstance(caches[0], RowKVCache)
    if cuda_graph and not per_row:
        check_graph_tier(caches[0].tier)
    with torch.inference_mode():
        prefill(model, rows, caches, prefill_chunk, device, on_progress)
        if on_prefilled is not None:
            on_prefilled()
        decoder = None
        if per_row:  # rows stand at their last prompt token
            decoder = make_decoder(model, caches, [len(r) - 1 for r in rows],
                                   cuda_graph=cuda_graph, max_steps=max_steps)
        y = torch.tensor([r[-1] for r in rows], dtype=torch.long, device=device)  # (B,)
        try:
            # On CUDA the next step is queued before the caller reads this one (a host
            # sync), so the device never waits for Python; on CPU that step would be waste.
            if device.type != "cuda":
                for _ in range(steps):
                    y = _decode_step(model, y, caches, decoder, params, generator)
                    yield y
                return
            y_next = _decode_step(model, y, caches, decoder, params, generator)
            for i in range(1, steps + 1):
                y = y_next
                if i < steps:  # nothing is queued past the context
                    y_next = _decode_step(model, y, caches, decoder, params, generator)
                yield y
        finally:
            if decoder is not None:
                decoder.close()


def _decode_step(model, y, caches, decoder, params, generator) -> torch.Tensor:
    """One forward of the tokens ``y`` ``[B]`` (through ``decoder`` for per-row tiers);
    returns the next tokens."""
    if decoder is None:
        logits = model(y[:, None], caches, last_only=True)  # (B, 1, V)
    else:
        logits = decoder.step(y)  # (B, 1, V)
    return sample(logits[:, -1], params, generator)


def check_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(prompts, (str, torch.Tensor)) or not prompts:
        raise ValueError(
            f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}; "
            "wrap a single prompt as [ids]"
        )
    bad = [i for i, p in enumerate(prompts) if isinstance(p, (str, bytes)) or not isinstance(p, Sequence)]
    if bad:
        raise ValueError(
            f"prompt {bad[0]} is a {type(prompts[bad[0]]).__name__}, not a token-id list; "
            "wrap a single prompt as [ids] and encode text with the tokenizer"
        )
    rows = [list(p) for p in prompts]
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"prompt {i} holds no token; every prompt needs at least one")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in r):
            raise ValueError(f"prompt {i} must hold int token ids >= 0, got {r[:8]}...")
    return rows


def model_device(model) -> torch.device:
    """The device of the model's parameters."""
    return next(model.parameters()).device


# -- layer 2: responses --------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationStats:
    """Running figures of one :func:`stream_generate` call, all rows together.

    ``prefill_s`` runs from the start until a row's first token is read (its
    prefill and first step); ``decode_s`` covers the steps after it, in which
    ``decode_tokens`` tokens were sampled for rows still running.
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_tokens: int = 0
    prompt_cache_tokens_reused: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed (reused ones excluded) per second of prefill."""
        computed = self.prompt_tokens - self.prompt_cache_tokens_reused
        return computed / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            **{f: getattr(self, f) for f in self.__dataclass_fields__},
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclass(frozen=True)
class GenerationResponse:
    """One sampled token of one row, with the text it completed.

    ``text`` is the new text of row ``row`` since its previous response (it can be
    empty while a multi-byte character or a possible stop string is incomplete);
    ``finish_reason`` is ``None`` while the row runs, then ``"stop"`` (a stop token
    or string) or ``"length"`` (``max_tokens``).
    """

    row: int
    text: str
    token: int
    finish_reason: str | None
    stats: GenerationStats


def stream_generate(
    model,
    tokenizer,
    prompts: Prompt | Sequence[Prompt],
    config: GenerationConfig | None = None,
    *,
    drafter=None,
    speculative=None,
    cache_config: KVCacheConfig | None = None,
    caches: list[KVCache] | None = None,
    prompt_cache=None,
    on_progress: ProgressFn | None = None,
) -> Iterator[GenerationResponse]:
    """Stream :class:`GenerationResponse` objects as tokens are sampled.

    ``prompts``: a string or a token-id list (one prompt), or a list of them (a
    batch). Caches come from ``caches`` (one per layer, for the whole batch) or
    are built from ``cache_config`` (default: ``KVCacheConfig.from_env()``). A
    batch of different lengths on a scalar tier runs row by row (module
    docstring), so all of row 0's responses come before row 1's.

    ``drafter`` (a :class:`kvtier.drafters.Drafter`) decodes speculatively, with
    ``speculative`` (a :class:`kvtier.speculative.SpeculativeConfig`, default
    ``SpeculativeConfig()``); the responses are then
    :class:`~kvtier.speculative.SpeculativeResponse` objects, and on a scalar tier
    every row of a batch runs on its own (its rows would accept different drafts).

    ``prompt_cache`` (a :class:`kvtier.prompt_cache.PromptCache`; one prompt, and
    ``cache_config`` naming its tier) saves the prompt's keys and values after
    prefill. Without ``caches`` it also restores them first; with ``caches`` they
    are taken as already restored by the caller (``prompt_cache.restore``).
    """
    config = GenerationConfig() if config is None else config
    if not isinstance(config, GenerationConfig):
        raise ValueError(f"config must be a GenerationConfig, got {type(config).__name__}"
                         + ("; build one with GenerationConfig(**config)" if isinstance(config, dict) else ""))
    kw = {"cache_config": cache_config, "caches": caches, "prompt_cache": prompt_cache,
          "on_progress": on_progress}
    if drafter is not None:  # speculative decoding builds on this module: imported when asked for
        from kvtier.speculative import stream_speculative

        if not all(callable(getattr(drafter, m, None)) for m in ("propose", "reset", "cost")):
            raise ValueError(f"drafter must be a kvtier.drafters.Drafter (NgramDrafter(), "
                             f"EarlyExitDrafter(model, 8), ModelDrafter(small)), got {drafter!r:.60}")

        return stream_speculative(model, tokenizer, prompts, config, drafter=drafter,
                                  speculative=speculative, **kw)
    if speculative is not None:
        raise ValueError(f"speculative={speculative!r} needs a drafter (drafter=NgramDrafter(), ...)")
    return stream_steps(model, tokenizer, prompts, config, plain_steps(model, config), **kw)


def plain_steps(model, config: GenerationConfig) -> StepFn:
    """The step function of plain decoding for :func:`stream_steps`: one token per row per
    forward, from :func:`generate_step` (prefill, decode, CUDA graphs as ``config`` says)."""

    def steps(rows, caches, *, generator, stop_ids, on_progress, on_prefilled):
        tokens = generate_step(
            model, rows, caches, params=config.sampling, prefill_chunk=config.prefill_chunk,
            generator=generator, on_progress=on_progress, on_prefilled=on_prefilled,
            cuda_graph=config.cuda_graph, max_steps=config.max_tokens + 1,  # + the step queued ahead
        )
        try:
            for y in tokens:
                yield [[t] for t in y.tolist()]  # the one host sync of a step
        finally:
            tokens.close()

    return steps


def stream_steps(
    model,
    tokenizer,
    prompts: Prompt | Sequence[Prompt],
    config: GenerationConfig,
    steps: StepFn,
    *,
    respond: Callable[..., GenerationResponse] = GenerationResponse,
    lockstep: bool = True,
    cache_config: KVCacheConfig | None = None,
    caches: list[KVCache] | None = None,
    prompt_cache=None,
    on_progress: ProgressFn | None = None,
) -> Iterator[GenerationResponse]:
    """The streaming shell of plain and speculative decoding: rows, caches, prompt cache, text, stats.

    Encodes the prompts, groups the rows (one group on a per-row tier; on a scalar
    tier one group when ``lockstep`` allows it and the prompts have one length,
    else one group per row), gets each group's caches (``caches``, a restored
    ``prompt_cache``, or fresh ones from ``cache_config``) and runs
    ``steps(rows, caches, *, generator, stop_ids, on_progress, on_prefilled)``,
    which yields per forward each row's new tokens (``B`` lists of ints). Each token
    becomes ``respond(row, text, token, finish_reason, stats)`` (default a
    :class:`GenerationResponse`) until the row stops (:class:`RowText`). Arguments
    as :func:`stream_generate`.
    """
    rows, cache_config, per_row = resolve_rows(tokenizer, prompts, caches, cache_config, prompt_cache)
    context_room(model, rows)  # every row, before any forward (kvtier.limits)
    if per_row or len(rows) == 1 or (lockstep and len({len(r) for r in rows}) == 1):
        groups = [list(range(len(rows)))]
    elif caches is not None:
        what = f"prompts of lengths {[len(r) for r in rows]}" if lockstep else \
            f"{len(rows)} rows that accept different drafts"
        raise ValueError(
            f"the {caches[0].tier} tier keeps one length for every row and cannot hold {what} in one "
            "cache; pass cache_config instead of caches (rows then run one by one), or use the "
            "ragged or paged tier"
        )
    else:
        groups = [[i] for i in range(len(rows))]
    run = _Run(model, tokenizer, config)
    for group in groups:
        on_prefilled = None
        group_caches = caches
        if prompt_cache is not None:
            if group_caches is None:
                group_caches, _ = prompt_cache.restore(model, rows[0], cache_config)
            run.prompt_cache_tokens_reused += prompt_cache.reused
            on_prefilled = functools.partial(
                prompt_cache.save, group_caches, rows[0][:-1], cache_config,
                dtype=next(model.parameters()).dtype,
            )
        elif group_caches is None:
            group_caches = make_caches(model.args.n_layers, cache_config, batch_size=len(group))
        rows_of_group = [rows[i] for i in group]
        yield from run.stream(group, rows_of_group, group_caches, steps, respond, on_progress, on_prefilled)


class _Run:
    """Bookkeeping of one stream_steps call: timings, the generator, row states."""

    def __init__(self, model, tokenizer, config: GenerationConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.stop_ids = frozenset(tokenizer.eos_token_ids) | frozenset(config.stop_token_ids)
        self.generator = make_generator(config.sampling, model_device(model))
        self.prompt_tokens = self.generation_tokens = self.decode_tokens = 0
        self.prompt_cache_tokens_reused = 0
        self.prefill_s = self.decode_s = 0.0

    def stats(self) -> GenerationStats:
        return GenerationStats(
            self.prompt_tokens, self.generation_tokens, self.decode_tokens,
            self.prompt_cache_tokens_reused, self.prefill_s, self.decode_s,
        )

    def stream(self, ids, rows, caches, step_fn, respond, on_progress,
               on_prefilled) -> Iterator[GenerationResponse]:
        states = [RowText(self.tokenizer.stream_decoder(), self.config, self.stop_ids) for _ in rows]
        for state, room in zip(states, context_room(self.model, rows)):
            state.max_tokens = min(state.max_tokens, room)  # the context ends a row as max_tokens does
        self.prompt_tokens += sum(len(r) for r in rows)
        steps = step_fn(rows, caches, generator=self.generator, stop_ids=self.stop_ids,
                        on_progress=on_progress, on_prefilled=on_prefilled)
        t_last = time.perf_counter()
        try:
            for i, new in enumerate(steps):
                now = time.perf_counter()
                if i == 0:  # the first forward's tokens end the prefill
                    self.prefill_s += now - t_last
                else:
                    self.decode_s += now - t_last
                t_last = now
                for row, state, tokens in zip(ids, states, new):
                    for token in tokens:
                        if state.done:
                            break
                        text, reason = state.push(token)
                        self.generation_tokens += 1
                        self.decode_tokens += i > 0
                        yield respond(row, text, token, reason, self.stats())
                if all(s.done for s in states):
                    return
        finally:
            steps.close()


class RowText:
    """Text of one row: incremental detokenizing, stop tokens and strings, max tokens."""

    def __init__(self, decoder, config: GenerationConfig, stop_ids: frozenset[int], min_tokens: int = 0,
                 include_stop: bool = False):
        self.decoder, self.stop, self.stop_ids = decoder, config.stop, stop_ids
        self.max_tokens = config.max_tokens
        self.min_tokens = min_tokens  # before this many tokens no stop string ends the row (vLLM's)
        self.include_stop = include_stop  # a stop string ends the text with it, not before it (vLLM's)
        self.held = ""  # decoded text not yet given out: it may begin a stop string
        self.count = 0
        self.done = False

    def push(self, token: int) -> tuple[str, str | None]:
        """Take one sampled token; return ``(new text, finish_reason)``."""
        self.count += 1
        if token in self.stop_ids:
            return self._finish(self.held + self.decoder.flush(), "stop")
        stop = self.stop if self.count >= self.min_tokens else ()
        text, self.held, hit = split_at_stop(self.held + self.decoder.feed(token), stop, include=self.include_stop)
        if hit:
            return self._finish(text, "stop", flushed=True)
        if self.count >= self.max_tokens:
            tail, reason = self._finish(self.held + self.decoder.flush(), "length")
            return text + tail, reason
        return text, None

    def _finish(self, text: str, reason: str, flushed: bool = False) -> tuple[str, str]:
        self.done, self.held = True, ""
        if not flushed:
            text, _, hit = split_at_stop(text, self.stop, hold=False, include=self.include_stop)
            reason = "stop" if hit else reason
        return text, reason


def split_at_stop(text: str, stop: Sequence[str], *, hold: bool = True,
                  include: bool = False) -> tuple[str, str, bool]:
    """Split streamed ``text`` at the first stop string.

    Returns ``(emit, held, hit)``: with a stop string in ``text``, ``emit`` is the
    text before it (through it with ``include``; of stop strings found at one place,
    the longest) and ``hit`` is True. Otherwise ``held`` is the longest end of ``text``
    that could still grow into a stop string (kept back when ``hold``), and ``emit``
    the rest.
    """
    found = [(i, -len(s)) for s in stop if (i := text.find(s)) >= 0]
    if found:
        cut, minus = min(found)
        return text[: cut - minus if include else cut], "", True
    if not hold:
        return text, "", False
    keep = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:n]):
                keep = n
                break
    return text[: len(text) - keep], text[len(text) - keep :], False


def resolve_rows(tokenizer, prompts, caches, cache_config, prompt_cache):
    """Encode the prompts and settle the tier: ``(rows, cache_config, per_row)``, ``per_row``
    telling whether the tier keeps a length per row (a :class:`RowKVCache`).

    A prompt cache serves one prompt and needs ``cache_config`` (it records the
    tier); without caches or a config, the environment picks the tier.
    """
    rows = encode_prompts(tokenizer, prompts)
    if cache_config is not None and not isinstance(cache_config, KVCacheConfig):
        raise ValueError(f"cache_config must be a KVCacheConfig (e.g. KVCacheConfig(tier='paged')), got "
                         f"{cache_config!r:.60}")
    if caches is not None and (not isinstance(caches, list | tuple) or not caches):
        raise ValueError(f"caches must be a non-empty list, one cache a layer (make_caches), got "
                         f"{caches!r:.60}")
    if prompt_cache is not None and (len(rows) != 1 or cache_config is None):
        raise ValueError(
            "a prompt cache serves one prompt and needs cache_config (it records the tier); "
            f"got {len(rows)} prompts and cache_config={cache_config!r}"
        )
    if caches is None and cache_config is None:
        cache_config = KVCacheConfig.from_env()
    per_row = isinstance(caches[0], RowKVCache) if caches is not None else cache_config.per_row
    return rows, cache_config, per_row


def _integer_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex()
                                                or t.dtype == torch.bool)


def _token_id(t) -> bool:
    """An int, a numpy integer or a 0-d integer tensor (not a bool)."""
    return not isinstance(t, bool) and (isinstance(t, Integral) or (_integer_tensor(t) and t.dim() == 0))


def as_prompts(prompts):
    """``prompts`` checked and normalised: a string; one prompt's ids as a list of ints (from a
    list of ints, numpy integers or 0-d tensors, or a ``[T]`` tensor); or a batch, a list of
    strings and int lists (a ``[B, T]`` tensor gives one). Raises ``ValueError`` for anything
    else (bytes included: decode them first)."""
    if isinstance(prompts, torch.Tensor):
        if not _integer_tensor(prompts) or prompts.dim() not in (1, 2):
            raise ValueError(f"a tensor of prompts must hold integer token ids, [T] or [B, T]; got "
                             f"{prompts.dtype} of shape {tuple(prompts.shape)}")
        prompts = prompts.tolist()
    if isinstance(prompts, str):
        return prompts
    if isinstance(prompts, bytes | bytearray):
        raise ValueError(f"prompts are {type(prompts).__name__}, not text or token ids; decode them "
                         "first (prompts.decode('utf-8'))")
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(
            f"prompts must be a string, a token-id list, or a non-empty list of them; got "
            f"{prompts!r:.60}"
        )
    if all(_token_id(t) for t in prompts):
        return [int(t) for t in prompts]
    rows = []
    for r, p in enumerate(prompts):
        p = p.tolist() if _integer_tensor(p) and p.dim() == 1 else p
        if not isinstance(p, str) and (isinstance(p, bytes | bytearray) or not isinstance(p, Sequence)
                                       or not all(_token_id(t) for t in p)):
            raise ValueError(f"prompt {r} must be a string or a list of int token ids, got {p!r:.60}")
        rows.append(p if isinstance(p, str) else [int(t) for t in p])
    return rows


def encode_prompts(tokenizer, prompts) -> list[list[int]]:
    prompts = as_prompts(prompts)
    if isinstance(prompts, str):
        return [tokenizer.encode(prompts)]
    if all(isinstance(t, int) for t in prompts):
        return [prompts]
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]


# -- layer 3: text ------------------------------------------------------------------------


def generate(
    model,
    tokenizer,
    prompts: Prompt | Sequence[Prompt],
    config: GenerationConfig | None = None,
    **kwargs,
) -> str | list[str]:
    """The generated text: a string for one prompt, a list of strings for a batch.

    Takes the arguments of :func:`stream_generate`; with ``drafter=`` (and optionally
    ``speculative=``) the text comes from speculative decoding.
    """
    prompts = as_prompts(prompts)
    single = isinstance(prompts, str) or all(isinstance(t, int) for t in prompts)
    n = 1 if single else len(prompts)
    texts = [""] * n
    for r in stream_generate(model, tokenizer, prompts, config, **kwargs):
        texts[r.row] += r.text
    return texts[0] if single else texts
