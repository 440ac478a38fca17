"""LLMEngine: requests in, token and text deltas out, one forward pass per step for every row.

The engine joins the three parts below the HTTP layer and drives them a step at a time:

- :class:`~kvtier.serve.scheduler.Scheduler` picks the rows (continuous batching,
  chunked prefill, admission, preemption) over a
  :class:`~kvtier.serve.prefix.BlockManager` (blocks and the prefix cache);
- :class:`~kvtier.serve.runner.ModelRunner` runs them and returns logits;
- the engine samples each row with its own :class:`~kvtier.sampling.SamplingParams`
  and seeded generator, detokenises incrementally, holds back text that may begin a
  stop string (:class:`kvtier.generate.RowText`), and ends requests at a stop.

Its calls may come from several threads: each runs alone (one lock), a :meth:`LLMEngine.generate` call
runs its prompts to completion before another starts, and requests stepped by hand belong to one thread
(a ``generate`` call steps them too, and drops their outputs). :class:`kvtier.serve.async_engine.AsyncLLMEngine`
runs the engine in a background thread for many concurrent streams, as the server does.

Asynchronous scheduling (``EngineConfig.async_scheduling``, on by default on CUDA). A step's host
work (scheduling, building the step's inputs, detokenising, stop strings) would otherwise wait for
the GPU and leave it idle in turn. With it on, :meth:`LLMEngine.step` schedules and launches step
``N + 1`` first, feeding each decode row the token step ``N`` sampled straight from the device
(:class:`~kvtier.serve.runner.PendingTokens`), and only then waits for step ``N``'s tokens, whose
outputs it returns: every output comes one call later, and the host work of one step runs while the
GPU computes the next. A request that stops at step ``N`` (an end-of-sequence token, a stop string)
has computed one token too many in step ``N + 1``; that token is dropped. The tokens are those of
the synchronous engine (``tests/serve/test_async_scheduling.py``). A step with structured outputs'
rows waits for step ``N``'s tokens before it samples (a grammar says what may follow only once it
has the token before), after its forward is launched.

Example::

    >>> from kvtier.model import load_model
    >>> lm = load_model()
    >>> engine = LLMEngine(lm.model, lm.tokenizer, EngineConfig(num_blocks=256))
    >>> rid = engine.add_request(lm.tokenizer.encode("The capital of France is"),
    ...                          RequestParams(max_tokens=8))
    >>> text = ""
    >>> while engine.has_unfinished():
    ...     for out in engine.step():
    ...         text += out.text
    >>> text
    ' Paris.\\n\\nThe answer is:'
"""

from __future__ import annotations

import functools
import gc
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvtier.generate import GenerationConfig, RowText
from kvtier.quant.modes import TurboQuantConfig, check_kv_quant, check_turboquant
from kvtier.sampling import make_generator, sample
from kvtier.serve.adjust import LogitAdjustments
from kvtier.serve.graphs import graph_rows
from kvtier.serve.live import Live
from kvtier.serve.params import RequestOutput, RequestParams, TokenLogprob
from kvtier.serve.prefix import BlockManager
from kvtier.serve.runner import ModelRunner, PendingTokens, context_of, host_blocks_for, pool_blocks
from kvtier.serve.scheduler import (
    PENDING,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    StepBatch,
)
from kvtier.serve.speculate import SpeculativeConfig, Speculator, speculates, verified
from kvtier.serve.structured import Grammars
from kvtier.serve.warmup import warm_up

__all__ = ["PROMPT_LOGITS_BYTES", "EngineConfig", "LLMEngine", "freeze_startup_heap"]


def freeze_startup_heap() -> None:
    """Leave every object alive now (the model, the tokenizer, CUDA graphs, compiled kernels,
    the libraries' modules) out of the garbage collector's later passes.

    A full collection walks every tracked object. In a process that holds torch and a model,
    that takes 100 ms or more, and no step is launched meanwhile: a decode step of a few
    milliseconds waits for it (a 133 ms gap between two steps of ``kvtier bench serve`` on the
    H200). Frozen objects are never collected, so call this once, after start-up and warm-up,
    in a process that serves one engine (``kvtier serve`` and ``kvtier bench serve`` do);
    ``gc.unfreeze()`` undoes it.
    """
    gc.collect()
    gc.freeze()


#: keys and values on the CPU when neither num_blocks nor kv_memory_gib is given
DEFAULT_CPU_KV_GIB = 1.0
#: share of the free device memory (after the model) the pool takes on CUDA by default
DEFAULT_CUDA_KV_SHARE = 0.8
#: tokens a step feeds when max_batched_tokens is not given: the CPU's matmuls run faster at
#: 2,048 rows than at 512 (32 requests of 64-512 prompt tokens on the 2-core box: 79.4-79.7
#: against 66.7-69.9 output tok/s, lower TTFT and TPOT too); a GPU needs thousands
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
#: float32 logits a step computes at most for prompt logprobs (all requests together): the
#: scheduler's ``max_prompt_logits`` tokens (1,365 with SmolLM2's 49,152 words, 523 with
#: Llama-3's 128,256)
PROMPT_LOGITS_BYTES = 256 * 2**20


@dataclass(frozen=True)
class EngineConfig:
    """The engine's pool, step limits and storage.

    Pool: ``num_blocks`` blocks of ``block_size`` tokens, or as many as fit in
    ``kv_memory_gib`` (not both; neither: 1 GiB on the CPU, 80% of the free device
    memory on CUDA). ``max_model_len``: tokens of one request at most (default the
    model's context, capped by what the pool holds). Step limits as in
    :class:`~kvtier.serve.scheduler.SchedulerConfig`; ``max_batched_tokens`` ``None``:
    :data:`DEFAULT_BATCHED_TOKENS` of the model's device (2,048 on the CPU, 8,192 on CUDA), at
    least ``max_num_seqs``. ``kv_quant``, ``turboquant``, ``attention_backend`` as for the paged tier;
    ``cuda_graph`` and ``batch_invariant`` (every answer the same bits whatever shares its steps, on
    the CPU) as for :class:`~kvtier.serve.runner.ModelRunner`. ``async_scheduling``: schedule a step
    while the previous one runs (see the module docstring; ``None``: on CUDA only).
    ``scheduling_policy``: ``"fcfs"`` or ``"priority"`` (``RequestParams.priority``).
    ``speculative``: n-gram drafts (:mod:`kvtier.serve.speculate`; synchronous scheduling).
    ``kv_offload_gib``: GiB of host memory for the prefix cache's second tier (:mod:`kvtier.serve.offload`),
    which saves blocks evicted from the pool and loads them back on a later hit (``None``: none).
    """

    num_blocks: int | None = None
    kv_memory_gib: float | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int | None = None
    max_waiting: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_quant: str | None = None
    turboquant: TurboQuantConfig | None = None
    attention_backend: str = "auto"
    cuda_graph: bool | None = None
    async_scheduling: bool | None = None
    scheduling_policy: str = "fcfs"
    speculative: SpeculativeConfig | None = None
    batch_invariant: bool = False
    kv_offload_gib: float | None = None

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.kv_memory_gib is not None:
            raise ValueError(f"give num_blocks ({self.num_blocks}) or kv_memory_gib ({self.kv_memory_gib}), not both")
        for name in ("num_blocks", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        for name, flag in (("kv_memory_gib", "--kv-memory"), ("kv_offload_gib", "--kv-offload-memory")):
            gib = getattr(self, name)
            if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float))
                                    or not 0 < gib < 2**40):  # (an int too large for a float is refused too)
                raise ValueError(f"{name} ({flag}) must be a number of GiB > 0 (below 2**40) or None (the default), got {gib!r}")
        if self.kv_offload_gib is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gib offloads cached prefixes, and prefix caching is off; drop "
                             "--no-prefix-caching (enable_prefix_caching=False) or --kv-offload-memory")
        check_kv_quant(self.kv_quant)
        check_turboquant(self.turboquant)
        # the scheduler's own checks, before a model is built (its context, 1 here, is the model's)
        SchedulerConfig(1, self.max_num_seqs, self.max_batched_tokens or self.max_num_seqs, self.max_waiting, policy=self.scheduling_policy)
        for name in ("enable_prefix_caching", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig or None, got {self.speculative!r}")
        if self.speculative is not None and self.async_scheduling:
            raise ValueError("speculative decoding drafts from the tokens of the step before, which asynchronous scheduling "
                             "does not have yet: leave async_scheduling unset or False (kvtier serve: drop --async-scheduling)")


@dataclass(eq=False)
class _Launched:
    """A step on its way: what it runs, its sampled tokens on the device and their copy
    coming to the host (``ready`` is recorded after the copy), logprobs likewise."""

    batch: StepBatch
    requests: tuple[Request, ...]  # of the sampled rows, in row order
    tokens: torch.Tensor  # (n_sampled,) int64 on the device
    host: torch.Tensor  # (n_sampled,) its host copy, valid once ready
    logprobs: dict[str, tuple[torch.Tensor, ...]]  # request id -> host (chosen, top values, top ids)
    ready: torch.cuda.Event | None
    # request id -> (its request, first position, host (chosen, top values, top ids, ranks)) of its prompt
    prompt_logprobs: dict[str, tuple[Request, int, tuple[torch.Tensor, ...]]] = field(default_factory=dict)
    structured: bool = False  # whether a row's request has a grammar (its matcher takes the token)
    taken: list[int] | None = None  # the tokens on the host, once waited for (and given to the matchers)
    judged: dict[str, torch.Tensor] = field(default_factory=dict)  # drafting row -> host tokens judging its drafts
    given: dict[str, tuple[int, ...]] = field(default_factory=dict)  # drafting row -> its tokens, once booked

    @property
    def pending(self) -> PendingTokens:
        return PendingTokens(self.tokens, {r.request_id: i for i, r in enumerate(self.requests)})


def _serialised(method):
    """``method`` of :class:`LLMEngine` under the engine's lock: one call at a time."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class LLMEngine:
    """Continuous-batching engine over the paged tier (see the module docstring).

    ``model``: a :class:`~kvtier.model.Transformer`; ``tokenizer``: its
    :class:`~kvtier.model.Tokenizer` (``None``: token ids only, no text or stop strings).
    """

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        param = next(model.parameters())
        self.device = param.device
        num_blocks = self._pool_blocks(param.dtype)  # (before anything is allocated)
        self.max_model_len = context = context_of(config.max_model_len, model.args, num_blocks, config.block_size)
        host = 0 if config.kv_offload_gib is None else host_blocks_for(  # (a CPU pool shares the host's memory)
            config.kv_offload_gib, model.args, param.dtype, config.block_size, config.kv_quant, config.turboquant,
            num_blocks if self.device.type == "cpu" else 0)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, host)
        batched = config.max_batched_tokens
        if batched is None:
            batched = max(DEFAULT_BATCHED_TOKENS.get(self.device.type, DEFAULT_BATCHED_TOKENS["cpu"]),
                          config.max_num_seqs)
        self.scheduler = Scheduler(
            SchedulerConfig(max_model_len=context, max_num_seqs=config.max_num_seqs,
                            max_batched_tokens=batched, max_waiting=config.max_waiting,
                            max_prompt_logits=max(1, PROMPT_LOGITS_BYTES // (4 * model.args.vocab_size)),
                            policy=config.scheduling_policy, window=model.args.window_everywhere),
            self.block_manager)
        draft = config.speculative.num_speculative_tokens if config.speculative is not None else None
        self.runner = ModelRunner(
            model, num_blocks=num_blocks, block_size=config.block_size, kv_quant=config.kv_quant,
            turboquant=config.turboquant, attention_backend=config.attention_backend, cuda_graph=config.cuda_graph,
            max_num_seqs=config.max_num_seqs, max_model_len=context, graph_rows=graph_rows(config.max_num_seqs, draft),
            batch_invariant=config.batch_invariant, host_blocks=host)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset()
        self.speculator = None if config.speculative is None else Speculator(config.speculative)
        self.async_scheduling = (self.device.type == "cuda" and self.speculator is None
                                 if config.async_scheduling is None else config.async_scheduling)
        self._inflight: _Launched | None = None
        self._live: dict[str, Live] = {}
        self.adjustments = LogitAdjustments()  # bias, min_tokens and penalties, all rows at once
        # structured outputs' grammars over the tokenizer's vocabulary (compiled on first use)
        self.grammars = Grammars(tokenizer, model.args.vocab_size) if tokenizer is not None else None
        self._lock = threading.RLock()  # one call at a time (module docstring)
        self._ids = itertools.count()
        self.steps = self.prompt_tokens = self.generation_tokens = 0

    def _pool_blocks(self, dtype: torch.dtype) -> int:
        c, gib = self.config, self.config.kv_memory_gib
        if c.num_blocks is None and gib is None and self.device.type == "cuda":
            gib = DEFAULT_CUDA_KV_SHARE * torch.cuda.mem_get_info(self.device)[0] / 2**30
        return pool_blocks(c.num_blocks, DEFAULT_CPU_KV_GIB if gib is None else gib, self.model.args, dtype,
                           self.device, c.block_size, c.kv_quant, c.turboquant)

    # -- requests ---------------------------------------------------------------------------------
    @_serialised
    def add_request(self, prompt_token_ids: Sequence[int], params: RequestParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id (``request_id`` or a fresh one).

        ``ValueError`` for a prompt that is empty, holds ids outside the vocabulary or
        does not fit the context (or ``max_tokens`` beyond it), or a ``structure`` that does
        not compile; :class:`~kvtier.serve.scheduler.QueueFull` when the waiting queue is full.
        Nothing is queued on error.
        """
        params = RequestParams() if params is None else params
        if not isinstance(params, RequestParams):
            raise ValueError(f"params must be a RequestParams, got {type(params).__name__}")
        ids = list(prompt_token_ids) if isinstance(prompt_token_ids, Sequence) else prompt_token_ids
        vocab = self.model.args.vocab_size
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"the prompt must be a non-empty list of token ids in [0, {vocab}), "
                             f"got {str(prompt_token_ids)[:60]}")
        params.check_vocabulary(vocab)
        stop_ids = self.stop_ids(params)
        if params.guided_choice and not stop_ids:
            raise ValueError("guided_choice ends each choice with a stop id, and this request has none (ignore_eos "
                             "without stop_token_ids, or a model without an end-of-sequence id); give stop_token_ids")
        if params.allowed_token_ids:
            left = set(params.allowed_token_ids) - {w[0] for w in params.bad_words if len(w) == 1}
            if not left:
                raise ValueError("allowed_token_ids leave no token to sample: each is a one-token bad word; "
                                 "allow more tokens or drop those words")
            if params.min_tokens and left <= stop_ids:
                raise ValueError(f"allowed_token_ids leave no token to sample until min_tokens "
                                 f"{params.min_tokens} are out: those not among bad_words are stop ids "
                                 f"{sorted(left)[:5]}; allow more tokens or drop min_tokens")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context holds "
                             f"{self.max_model_len} (at least one must be left to generate); "
                             "shorten the prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"the prompt's {len(ids)} tokens plus max_tokens {params.max_tokens} "
                             f"exceed the context of {self.max_model_len} tokens; lower max_tokens "
                             f"to at most {room}")
        rid = request_id if request_id is not None else next(r for i in self._ids if (r := f"req-{i}") not in self._live)
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already in use; ids must be unique")
        matcher = None
        if params.structure is not None:
            if self.grammars is None:
                raise ValueError("structure needs the model's tokenizer (its grammar is compiled over the "
                                 "vocabulary's text), and this engine has none")
            matcher = self.grammars.matcher(params.structure, stop_ids)
        max_tokens = params.max_tokens or room
        request = Request(rid, ids, max_tokens, priority=params.priority)
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True) if self.tokenizer else None
        text = RowText(decoder, GenerationConfig(max_tokens=max_tokens, stop=params.stop), stop_ids,
                       params.min_tokens, params.include_stop_str_in_output)
        live = Live(request, params, text, make_generator(params.sampling, self.device), time.monotonic())
        live.matcher = matcher
        self.scheduler.add(request)  # the last check (queue bound): after it, nothing can fail
        self._live[rid] = live
        self.prompt_tokens += len(ids)
        return rid

    @_serialised
    def abort(self, request_id: str) -> bool:
        """Drop a request, waiting or running; its blocks are freed. False if it was not live."""
        self._live.pop(request_id, None)
        self.adjustments.release(request_id)
        return self.scheduler.abort(request_id)

    @_serialised
    def abort_all(self) -> list[str]:
        """Drop every request (after a failed step) and the step in flight; returns their ids."""
        ids = list(dict.fromkeys([*self.scheduler.requests, *self._live]))
        for rid in ids:
            self.abort(rid)
        self._inflight = None
        return ids

    def has_unfinished(self) -> bool:
        """Whether a request is waiting or running, or a step's tokens are still to come."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    # -- one step ---------------------------------------------------------------------------------
    @_serialised
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; an output for every request that got a token (with
        asynchronous scheduling, the tokens of the step before, see the module docstring)."""
        batch = self.scheduler.schedule(self._drafts if self.speculator is not None else None)
        try:
            launched = self._launch(batch) if batch.rows else None
            if batch.copies and not batch.rows:  # (a preemption took back every row: the copies still run)
                self.runner.execute(batch)
        except BaseException:  # its copies may not have run: their blocks and slots hold no prefix
            self.scheduler.forget(batch)
            raise
        outputs = self._resolve(self._inflight) if self._inflight is not None else []
        self._inflight = None
        if launched is not None:
            self._book(launched)
            if self.async_scheduling:
                self._inflight = launched
            else:
                outputs += self._resolve(launched)
        return outputs

    def _launch(self, batch: StepBatch) -> _Launched:
        """Run ``batch`` and sample it on the device; the tokens' copy to the host is on its way."""
        pending = self._inflight.pending if self._inflight is not None else None
        logits = self.runner.execute(batch, pending)  # (n_sampled, V) float32
        lives = [self._live[rid] for rid in batch.sampled]
        structured = any(lv.matcher is not None for lv in lives)
        if structured and self._inflight is not None:
            self._feed(self._inflight)  # a grammar needs the step before's tokens: wait for them
        with torch.inference_mode():
            tokens, logprobs = self._sample(lives, logits)
            host = tokens.to("cpu", non_blocking=True)  # pinned on CUDA: the copy does not block
            logprobs = {rid: tuple(t.to("cpu", non_blocking=True) for t in v) for rid, v in logprobs.items()}
            prompt = {}
            for rid, (start, rows) in self.runner.prompt_logits.items():
                if (got := self._live[rid].prompt_logprobs(start, rows)) is not None:
                    prompt[rid] = (self._live[rid].request, start, got)
            judged, drafted = verified(self.runner.draft_logits, batch.rows, self._live)
            logprobs |= drafted  # (a drafted row's, for each position it fed)
        ready = torch.cuda.Event() if tokens.device.type == "cuda" else None
        if ready is not None:  # (on the tokens' device's stream: a cuda:1 engine's current device may be cuda:0)
            ready.record(torch.cuda.current_stream(tokens.device))
        self.steps += 1
        return _Launched(batch, tuple(lv.request for lv in lives), tokens, host, logprobs, ready, prompt, structured,
                         judged=judged)

    def _drafts(self, request: Request, k: int) -> list[int]:
        """The scheduler's drafts for a decode row (:mod:`kvtier.serve.speculate`)."""
        live, running = self._live.get(request.request_id), self.scheduler.num_running
        if live is None or not speculates(live) or (self.config.batch_invariant and not live.params.sampling.greedy):
            return []  # (batch-invariant: how many drafts a sampled row gets, so its draws, hang on the step)
        return self.speculator.propose(live, k, running)

    def _book(self, step: _Launched) -> None:
        """Book ``step`` in the scheduler, its sampled tokens as :data:`PENDING` (each its request's last
        until :meth:`_resolve`, run before the next booking); a drafting row its tokens (synchronously)."""
        sampled = dict.fromkeys(step.batch.sampled, PENDING)
        if step.judged:
            if step.ready is not None:
                step.ready.synchronize()
            step.given = {r.request_id: tuple(self.speculator.accept(r.token_ids[-r.draft:], step.judged[r.request_id].tolist()))
                          for r in step.batch.rows if r.draft}
            sampled |= step.given
        self.scheduler.update(step.batch, sampled)

    def _resolve(self, step: _Launched) -> list[RequestOutput]:
        """Wait for ``step``'s tokens; fill them in, run stops and text, one output each."""
        tokens = self._feed(step)
        now = time.monotonic()
        for rid, (req, start, got) in step.prompt_logprobs.items():
            live = self._live.get(rid)
            if live is not None and live.request is req:  # (not ended since)
                live.take_prompt(start, *(t.tolist() for t in got))
        outputs = []
        for req, token in zip(step.requests, tokens):
            rid = req.request_id
            live, given = self._live.get(rid), step.given.get(rid)
            if live is None or live.request is not req or (given is None and req.token_ids[-1] != PENDING):
                continue  # it ended before its booking or since (a stop, an abort): the token is dropped
            if given is None:
                self.scheduler.set_token(req, token)
            texts, reason, given = self._push_all(live, given or (token,))
            if rid in step.given:  # (drafts a stop cut off were not kept)
                self.speculator.kept(len(step.given[rid]), len(given))
            assert reason is not None or req.status is not RequestStatus.FINISHED
            if reason is not None:
                self.scheduler.finish(rid)  # a stop (a length finish has freed it already)
                del self._live[rid]
                self.adjustments.release(rid)
            live.first_token = live.first_token or now
            outputs.append(RequestOutput(
                rid, "".join(texts), given, reason, req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens,
                None if (lp := step.logprobs.get(rid)) is None else self._logprobs(given, *lp), live.arrival,
                live.first_token, now if reason is not None else None, live.give_prompt(), texts if len(texts) > 1 else ()))
        self.generation_tokens += sum(len(o.token_ids) for o in outputs)
        return outputs

    def _feed(self, step: _Launched) -> list[int]:
        """``step``'s tokens on the host, waited for once; each structured request given its own
        then (those :meth:`_resolve` will keep)."""
        if step.taken is None:
            if step.ready is not None:
                step.ready.synchronize()
            step.taken = step.host.tolist()
            for req, token in zip(step.requests, step.taken) if step.structured else ():
                live = self._live.get(req.request_id)
                if live is not None and live.matcher is not None and live.request is req and req.token_ids[-1] == PENDING:
                    live.matcher.take(token)
        return step.taken

    def stop_ids(self, params: RequestParams) -> frozenset[int]:
        """The ids that end a request of ``params``: its ``stop_token_ids``, and the tokenizer's
        end-of-sequence ids unless it ignores them."""
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)

    def _push_all(self, live: Live, tokens: tuple[int, ...]) -> tuple[tuple[str, ...], str | None, tuple[int, ...]]:
        """:meth:`_push` each of a row's tokens until one ends it: the text of each, the finish
        reason and the tokens pushed (those after the end leave the request's tokens)."""
        if len(tokens) == 1:  # (every row but a drafted one)
            text, reason = self._push(live, tokens[0])
            return (text,), reason, tokens
        texts = []
        for i, token in enumerate(tokens):
            text, reason = self._push(live, token)
            texts.append(text)
            if reason is not None:
                del live.request.token_ids[len(live.request.token_ids) - (len(tokens) - 1 - i):]
                return tuple(texts), reason, tokens[: i + 1]
        return tuple(texts), None, tokens

    def _push(self, live: Live, token: int) -> tuple[str, str | None]:
        if live.text.decoder is None:  # no tokenizer: ids only, stops by id and by length
            live.text.count += 1  # (the request may hold more: a row's kept drafts are booked first)
            if token in live.text.stop_ids:
                return "", "stop"
            return "", "length" if live.text.count >= live.text.max_tokens else None
        return live.text.push(token)

    def _sample(self, lives: Sequence[Live], logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """One token per sampled row on the device (greedy rows in one argmax), and for the
        rows that ask, the device tensors of their logprobs: the token's and the top ones."""
        if not lives:
            return torch.empty(0, dtype=torch.long, device=logits.device), {}
        # argmax over every row (one kernel, no index tensor); the rows that sample, or whose bias
        # or penalties move their logits (all such rows at once, on a copy: logprobs stay the
        # model's own), overwrite theirs
        picked = logits.argmax(dim=-1)  # (n_sampled,)
        moved = [i for i, lv in enumerate(lives) if self.adjustments.applies(lv)]
        rows: dict[int, torch.Tensor] = {}  # row -> its adjusted logits [1, V]
        if moved:
            out, index = self.adjustments.apply(logits, moved, [lives[i] for i in moved])
            if all(lives[i].params.sampling.greedy for i in moved):
                picked.index_copy_(0, index[0], out.argmax(dim=-1))
            else:
                for j, i in enumerate(moved):
                    rows[i] = out[j : j + 1]
                    if lives[i].params.sampling.greedy:
                        picked[i] = rows[i].argmax(dim=-1)[0]
        for i, lv in enumerate(lives):
            if not lv.params.sampling.greedy:
                picked[i] = sample(rows.get(i, logits[i : i + 1]), lv.params.sampling, lv.generator)[0]
        if moved:
            self.adjustments.count(index, picked)
        logprobs = {}
        for i, lv in enumerate(lives):
            top = lv.params.logprobs
            if top is None:
                continue
            lp = torch.log_softmax(logits[i].float(), dim=-1)  # (V,)
            vals, idx = lp.topk(top) if top else (lp[:0], picked[:0])
            logprobs[lv.request.request_id] = (lp[picked[i]], vals, idx)
        return picked, logprobs

    @staticmethod
    def _logprobs(tokens: tuple[int, ...], chosen, vals, idx) -> tuple[TokenLogprob, ...]:
        """The logprobs of ``tokens`` (a step's of one row: one, or a drafted row's) from host tensors."""
        if chosen.dim() == 0:
            chosen, vals, idx = chosen[None], vals[None], idx[None]
        return tuple(TokenLogprob(t, float(chosen[i]), tuple(zip(idx[i].tolist(), vals[i].tolist())))
                     for i, t in enumerate(tokens))

    # -- start-up -----------------------------------------------------------------------------------
    @_serialised
    def warm_up(self, new_tokens: int = 4) -> dict[str, int | float]:
        """Run made-up requests through each kind of step the engine takes, then forget them
        (:func:`kvtier.serve.warmup.warm_up` says which and why). A ``ValueError`` when a
        request is live (warm up before serving). Returns ``requests``, ``steps``,
        ``prompt_tokens`` and ``seconds``."""
        return warm_up(self, new_tokens)

    # -- figures ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float | str]:
        """Requests, blocks, prefix cache and token counters (a plain dict)."""
        bm, s = self.block_manager, self.scheduler
        return {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "max_waiting": s.config.max_waiting,
            "num_blocks": bm.num_blocks,
            "free_blocks": bm.num_free_blocks,
            "cached_blocks": bm.num_cached_blocks,
            "block_size": bm.block_size,
            "prefix_queries": bm.prefix_queries,
            "prefix_hits": bm.prefix_hits,
            "prefix_hit_rate": bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            "preemptions": s.num_preemptions, "released_blocks": s.released_blocks,
            **bm.host_figures(),
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "max_model_len": self.max_model_len,
            "kv_storage": self.runner.storage_mode,
            "kv_bytes": self.runner.nbytes,
        } | (self.speculator.stats() if self.speculator is not None else {})

    # -- convenience -----------------------------------------------------------------------------------
    @_serialised
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: RequestParams | Sequence[RequestParams] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` (token-id lists) to completion together; one merged output per prompt
        (all its tokens and text, its finish reason), in prompt order."""
        many = isinstance(params, Sequence)
        if many and len(params) != len(prompts):
            raise ValueError(f"{len(params)} params for {len(prompts)} prompts; give one or one each")
        rids: list[str] = []
        try:
            for i, p in enumerate(prompts):
                rids.append(self.add_request(p, params[i] if many else params))
        except BaseException:  # all or nothing: a refused prompt leaves none of the others queued
            for rid in rids:
                self.abort(rid)
            raise
        merged: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                prev = merged.get(out.request_id)
                if prev is not None:
                    lp = None if out.logprobs is None else (prev.logprobs or ()) + out.logprobs
                    out = replace(out, text=prev.text + out.text, token_ids=prev.token_ids + out.token_ids, pieces=(),
                                  logprobs=lp, first_token_time=prev.first_token_time,
                                  prompt_logprobs=prev.prompt_logprobs)
                merged[out.request_id] = out
        return [merged[r] for r in rids]
