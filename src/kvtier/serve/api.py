"""The OpenAI-compatible HTTP layer: FastAPI routes that translate and stream, nothing more.

Routes: ``GET`` (and ``HEAD``) ``/health``, ``GET /metrics`` (Prometheus text), ``GET /v1/models``
(and ``/v1/models/{id}``), vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``
(:mod:`kvtier.serve.tokens_api`),
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers
with server-sent events ending in ``data: [DONE]``). The app holds no cache state:
requests go to an :class:`~kvtier.serve.async_engine.AsyncLLMEngine`.

Errors are answered in OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, with a 4xx status for the caller's mistakes:

====== ======================================================================
status when
====== ======================================================================
400    malformed JSON, a field of the wrong type or range, an unsupported field
       (``suffix``, ``tools``), a prompt that does not fit the context
       (``code: context_length_exceeded``), ``n`` over the waiting queue's room
401    no API key or a wrong one, where the server has keys (``ServerConfig.api_keys``)
404    an unknown route, or a ``model`` other than the one served
405    a route asked with the wrong method
413    a request body over ``ServerConfig.max_request_bytes``
429    the waiting queue is full (``Retry-After`` header)
500    a failure inside the engine (a bug); the server keeps serving
====== ======================================================================

``n`` > 1 queues ``n`` requests of the same prompt (the prefix cache shares its
blocks); choice ``i`` samples with ``seed + i`` where a seed is given, so the
choices differ and each is reproducible. Streamed, their chunks interleave, each
naming its choice's ``index``; ``usage`` counts the prompt once and every choice's
tokens.

A client that disconnects (streaming or not) aborts its requests, which frees their
blocks at the next step.

Prompts are tokenized in a worker thread, without Python's interpreter lock, so a long text
does not stall the event loop or the engine's steps; a text prompt far longer than the
context is refused from its prefixes (:func:`encode_bounded`) instead of being tokenized
whole, unless ``truncate_prompt_tokens`` asks for its last tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from kvtier.serve.async_engine import AsyncLLMEngine, RequestsEnded
from kvtier.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kvtier.serve.middleware import ApiKeys, BodyLimit, unread_body
from kvtier.serve.params import RequestOutput, RequestParams
from kvtier.serve.prefix_file import check_prefix_file, engine_lifespan, save_figures
from kvtier.serve.reasoning import FORMATS as REASONING
from kvtier.serve.reasoning import ReasoningReader, grammar_after, prompt_state
from kvtier.serve.responses import add_responses_routes
from kvtier.serve.scheduler import QueueFull
from kvtier.serve.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    render_chat,
    request_params,
    structure,
    validation_error,
)
from kvtier.serve.structured import Structure, named
from kvtier.serve.tokens_api import add_tokenizer_routes
from kvtier.serve.tools import FORMATS, call_format, describes_tools
from kvtier.serve.views import Completion

__all__ = ["CHARS_PER_TOKEN_BOUND", "ServerConfig", "build_app", "encode_bounded"]

#: a text prompt longer than this many characters per token of context is tokenized by
#: growing prefixes first, and refused once a prefix alone overflows the context
CHARS_PER_TOKEN_BOUND = 16


@dataclass(frozen=True)
class ServerConfig:
    """Where the server listens and what it calls its model.

    ``served_model_name``: the ``model`` the API reports and accepts (default: the
    model file's name); ``retry_after_s``: the ``Retry-After`` of a 429;
    ``max_request_bytes``: the largest request body read (larger: HTTP 413); ``warmup``:
    run :meth:`~kvtier.serve.engine.LLMEngine.warm_up` before listening (``None``: when the
    model is on CUDA, whose first steps compile kernels).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    retry_after_s: int = 1
    max_request_bytes: int = 4 * 2**20
    warmup: bool | None = None
    #: seconds a stopping server (SIGTERM, Ctrl-C) waits for requests in flight before it
    #: ends them (``None``: until they finish)
    shutdown_timeout_s: float | None = None
    #: keys a request must bear (``Authorization: Bearer <key>``) on every route but /health and
    #: /metrics; none: no key asked for
    api_keys: tuple[str, ...] = ()
    #: Jinja text that renders chats in place of the model's own template (``kvtier serve
    #: --chat-template``; set on the tokenizer when the server starts)
    chat_template: str | None = None
    #: the model's tool-call format for ``tool_choice: "auto"`` (``kvtier serve --tool-call-parser``):
    #: a name of :data:`kvtier.serve.tools.FORMATS`, ``"none"``, or ``None`` to read it off the
    #: chat template (:func:`kvtier.serve.tools.call_format`)
    tool_call_parser: str | None = None
    #: the model's reasoning format (``kvtier serve --reasoning-parser``): a name of
    #: :data:`kvtier.serve.reasoning.FORMATS`, or ``None`` for answers without reasoning
    reasoning_parser: str | None = None
    #: vLLM's ``--enable-auto-tool-choice``: ``"auto"`` is served whenever a call format is read;
    #: with this the server refuses to start where none is
    auto_tool_choice: bool = False
    #: the prefix cache on disk (``kvtier serve --prefix-cache-file``, :mod:`kvtier.serve.prefix_file`):
    #: read after the warm-up when it exists, written when the server stops
    prefix_cache_file: str | None = None
    #: seconds between saves of the prefix cache file while serving (``--prefix-cache-save-interval``;
    #: between two steps, when a step ran since the last; ``None``: at the stop only)
    prefix_cache_save_interval_s: float | None = None
    #: read the prefix cache file at the start and never write it (``--prefix-cache-read-only``: a
    #: file shipped with the model and shared by replicas; its folder may be read-only)
    prefix_cache_read_only: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        for name in ("retry_after_s", "max_request_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        keys = self.api_keys
        if not isinstance(keys, tuple):
            raise ValueError(f"api_keys must be a tuple of keys, got {type(keys).__name__}")
        bad = next((i for i, k in enumerate(keys) if not (isinstance(k, str) and k and k.isascii() and k.isprintable()
                                                          and " " not in k)), None)
        if bad is not None:  # (the key itself is never written out)
            raise ValueError(f"API key {bad + 1} of {len(keys)} is {'empty' if keys[bad] == '' else 'not printable ASCII without spaces'}"
                             "; give keys of printable ASCII without spaces (--api-key, KVTIER_API_KEY)")
        name = self.served_model_name
        if name is not None and (not isinstance(name, str) or not name.strip() or name != name.strip()):
            raise ValueError(f"served_model_name {name!r} is no name (empty, or spaces around it): give the name "
                             "clients send as model, or leave --served-model-name out for the file's")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"chat_template must be Jinja text or None, got {type(self.chat_template).__name__}")
        if self.tool_call_parser is not None and self.tool_call_parser not in (*FORMATS, "none"):
            raise ValueError(f"tool_call_parser must be one of {', '.join(FORMATS)}, none or None, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING)} or None, got "
                             f"{self.reasoning_parser!r}")
        if not isinstance(self.auto_tool_choice, bool):
            raise ValueError(f"auto_tool_choice must be a bool, got {self.auto_tool_choice!r}")
        if self.warmup is not None and not isinstance(self.warmup, bool):
            raise ValueError(f"warmup must be a bool or None, got {self.warmup!r}")
        t = self.shutdown_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < math.inf):
            raise ValueError(f"shutdown_timeout_s must be a number of seconds >= 0 or None, got {t!r}")
        if not isinstance(self.prefix_cache_read_only, bool):
            raise ValueError(f"prefix_cache_read_only must be a bool, got {self.prefix_cache_read_only!r}")
        if self.prefix_cache_file is not None:
            if not isinstance(self.prefix_cache_file, str) or not self.prefix_cache_file:
                raise ValueError(f"prefix_cache_file (--prefix-cache-file) must be the path of a file such as "
                                 f"prefixes.safetensors, or None (no file), got {self.prefix_cache_file!r}")
            check_prefix_file(self.prefix_cache_file, read_only=self.prefix_cache_read_only)
        if self.prefix_cache_read_only and self.prefix_cache_file is None:
            raise ValueError("--prefix-cache-read-only reads the prefix cache file, and none is given: add "
                             "--prefix-cache-file PATH (prefix_cache_file)")
        t = self.prefix_cache_save_interval_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not 1 <= t < math.inf):
            raise ValueError(f"prefix_cache_save_interval_s (--prefix-cache-save-interval) must be a number of "
                             f"seconds >= 1 or None, got {t!r}")
        if t is not None and self.prefix_cache_file is None:
            raise ValueError("--prefix-cache-save-interval saves the prefix cache file, and none is given: add "
                             "--prefix-cache-file PATH (prefix_cache_file)")
        if t is not None and self.prefix_cache_read_only:
            raise ValueError("--prefix-cache-save-interval saves the prefix cache file, and "
                             "--prefix-cache-read-only never writes it: drop one of them")


def encode_bounded(tokenizer, text: str, max_tokens: int, *, add_bos: bool | None = None) -> list[int]:
    """``tokenizer.encode(text)`` for a text that fits ``max_tokens``; a ``ValueError`` (naming the
    context) for one that does not, found without tokenizing all of a huge text.

    A text of more than ``CHARS_PER_TOKEN_BOUND * max_tokens`` characters is first
    tokenized by prefixes, each four times the last, and refused as soon as one is
    over ``max_tokens`` tokens: the work stays within a few times what the context
    itself costs to tokenize, however long the text.
    """
    limit = CHARS_PER_TOKEN_BOUND * max_tokens
    while len(text) > limit:
        head = len(tokenizer.encode(text[:limit], add_bos=add_bos))
        if head > max_tokens:
            raise ValueError(f"the prompt has {len(text)} characters; its first {limit} alone are {head} "
                             f"tokens but the context holds {max_tokens}; shorten the prompt")
        limit *= 4
    return tokenizer.encode(text, add_bos=add_bos)


def build_app(engine: AsyncLLMEngine, tokenizer, model_name: str,
              config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app over ``engine``; it starts the engine's loop on startup and stops it on
    shutdown. ``tokenizer`` encodes prompts and renders chat templates."""
    config = config or ServerConfig()
    metrics = ServerMetrics(lambda: engine.stats | save_figures(engine))
    engine.observers.append(metrics.observe)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        saved = None if config.prefix_cache_read_only else config.prefix_cache_file
        async with engine_lifespan(engine, saved, config.prefix_cache_save_interval_s):
            yield

    app = FastAPI(title="kvtier", lifespan=lifespan, redirect_slashes=False)  # (a 404, not a bare 307)
    app.add_middleware(BodyLimit, limit=config.max_request_bytes)
    if config.api_keys:  # (added last: runs first, before any body is read)
        app.add_middleware(ApiKeys, keys=config.api_keys, rejected=metrics.reject)
    created = int(time.time())
    # tool_choice "auto": the model's call format; a template that ignores tools gets them described
    calls = call_format(config.tool_call_parser, tokenizer)
    describe = calls is not None and not describes_tools(tokenizer)
    if config.auto_tool_choice and calls is None:
        raise ValueError("--enable-auto-tool-choice needs the model's tool-call format, and this server reads none "
                         f"(--tool-call-parser {config.tool_call_parser or 'unset: the chat template names none'}): "
                         f"give --tool-call-parser {{{','.join(FORMATS)}}}")
    thinks = None if config.reasoning_parser is None else REASONING[config.reasoning_parser]

    def fail(e: APIError) -> JSONResponse:
        metrics.reject(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return fail(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return fail(validation_error(list(e.errors()), request.headers.get("content-type")))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        if e.status_code == 413:
            return fail(APIError(413, f"the request body is over the {config.max_request_bytes} bytes this "
                                      "server reads (kvtier serve --max-request-mb)", code="request_too_large"))
        return fail(APIError(e.status_code, unread_body(e), type=kind, headers=e.headers))  # (a 405's Allow)

    @app.exception_handler(RequestsEnded)
    async def ended(request: Request, e: RequestsEnded):
        return fail(APIError(503, str(e), type="server_error", code="server_shutting_down"))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        return fail(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    # -- info ----------------------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD too
    async def health():
        s = engine.stats
        return {"status": "ok", **{k: s[k] for k in ("running", "waiting", "num_blocks", "free_blocks",
                                                     "cached_blocks", "max_model_len")}}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "kvtier",
                "max_model_len": engine.stats["max_model_len"]}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{name:path}", methods=["GET", "HEAD"])  # the official client's models.retrieve(name)
    async def one_model(name: str):
        check_model(name)
        return model_card()

    # -- generation ----------------------------------------------------------------------------
    def refused(e: ValueError, prompt_param: str) -> APIError:
        code = "context_length_exceeded" if "context" in str(e) else None
        field = str(e).split(" ", 1)[0]  # the engine's refusals of a field start with its name
        named = ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "guided_choice", "priority")
        return APIError(400, str(e), param=field if field in named else prompt_param,
                        code=code)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found", type="not_found_error")

    def check(req) -> None:
        check_model(req.model)

    async def compile_structure(req, params: RequestParams) -> None:
        """A structured output's grammar compiled in a worker thread (the engine's own compile finds
        it made, so the engine's steps never wait for one); 400 where it does not compile or the
        request has no stop id to end it."""
        grammars = engine.engine.grammars
        if params.structure is not None and grammars is not None:
            try:
                await asyncio.to_thread(grammars.matcher, params.structure, engine.engine.stop_ids(params))
            except ValueError as e:
                param = structure(req)[1]
                raise APIError(400, named(str(e), param), param=param) from None


    async def start(jobs: list[tuple[list[int], RequestParams]], n: int, prompt_param: str,
                    name: str = "n") -> list[str]:
        """Queue the request's choices, ``(prompt ids, params)`` each (``n`` a prompt, the field
        ``name``: ``n`` or ``best_of``); all or none (a refusal discards those queued)."""
        room = engine.stats["max_waiting"]
        if len(jobs) > room:
            prompts = len(jobs) // n
            what, fix = ((f"{name}={n} choices", f"ask for {name} <= {room}") if prompts == 1 else
                         (f"{len(jobs)} choices ({prompts} prompts, {name}={n})",
                          f"send fewer prompts or a smaller {name},"))
            raise APIError(400, f"{what} are more than the {room} requests this server queues at once; {fix} "
                           "or start it with a larger --max-waiting", param=name if n > 1 else "prompt")
        rids: list[str] = []
        try:
            for ids, params in jobs:
                rids.append(await engine.add_request(ids, params))
        except BaseException as e:
            for rid in rids:
                engine.discard(rid)
            if isinstance(e, QueueFull):
                raise APIError(429, str(e), code="rate_limit_exceeded", type="rate_limit_error",
                               headers={"Retry-After": str(config.retry_after_s)}) from None
            if isinstance(e, ValueError):
                raise refused(e, prompt_param) from None
            raise
        return rids

    def encode(text: str, prompt_param: str, add_bos: bool | None = None, keep: int | None = None) -> list[int]:
        """The text's tokens; with ``keep``, the last ``keep`` of the whole text's tokens (vLLM's
        truncate_prompt_tokens: a suffix of the text may be cut into other tokens)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON may carry a lone surrogate ("\ud800"); no tokenizer takes it
            raise APIError(400, f"the {prompt_param} holds {text[e.start]!r} at character {e.start}, a lone "
                           "UTF-16 surrogate that is not valid Unicode; send the whole pair",
                           param=prompt_param) from None
        try:
            if keep is not None:
                return tokenizer.encode(text, add_bos=add_bos)[-keep:]
            return encode_bounded(tokenizer, text, engine.stats["max_model_len"], add_bos=add_bos)
        except ValueError as e:
            raise refused(e, prompt_param) from None

    def kept_tokens(req, params: RequestParams) -> int | None:
        """vLLM's truncate_prompt_tokens as a count (-1: what the context leaves beside the
        request's ``max_tokens``, or beside one token without it); 400 past the context."""
        keep, context = req.truncate_prompt_tokens, engine.stats["max_model_len"]
        if keep is not None and keep > context:
            raise APIError(400, f"truncate_prompt_tokens {keep} is over the context of {context} tokens; keep at "
                           f"most {context} (or -1: what the context leaves beside max_tokens)",
                           param="truncate_prompt_tokens")
        if keep != -1:
            return keep
        left = context - (params.max_tokens or 1)
        if left < 1:
            raise APIError(400, f"truncate_prompt_tokens -1 keeps what the context of {context} tokens leaves beside "
                           f"max_tokens {params.max_tokens}, which is nothing: lower max_tokens", param="max_tokens")
        return left

    add_tokenizer_routes(app, tokenizer, lambda: engine.stats["max_model_len"], check_model, encode)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check(req)
        params = request_params(req, tokenizer)  # every 400 of the fields before the prompt's tokenizing
        await compile_structure(req, params)
        raw, keep = req.prompts(), kept_tokens(req, params)
        prompts = await asyncio.to_thread(lambda: [  # (one trip to the worker thread for the batch)
            encode(p, "prompt", None, keep) if isinstance(p, str) else list(p)[-keep:] if keep else list(p)
            for p in raw])
        k = max(req.best_of or 1, req.n)  # best_of: k made, the n best returned (ranked by their logprobs)
        run = params if k == req.n or params.logprobs is not None else replace(params, logprobs=0)
        rids = await start([(ids, choice_params(run, i)) for ids in prompts for i in range(k)], k, "prompt",
                           "n" if k == req.n else "best_of")
        views = []
        for i in range(len(rids)):  # choice i: prompt i // k, OpenAI's order
            p, ids = raw[i // k], prompts[i // k]
            echo = (p if isinstance(p, str) and keep is None else tokenizer.decode(ids, padded=True)) if req.echo else None
            views.append(Completion(tokenizer, model_name, f"cmpl-{rids[0]}", chat=False, index=i,
                                     first=i % k == 0, echo=echo, prompt=ids, drop=req.max_tokens == 0,
                                     top=req.logprobs, scored=req.prompt_logprobs))
        return await answer(views, rids, req, request, (k, req.n, params.logprobs is None) if k > req.n else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await chat_answer(req, request)

    async def chat_answer(req: ChatCompletionRequest, request: Request, chunks: bool = False):
        """The chat completion of ``req``: its whole object, or (streamed) the SSE response, or
        with ``chunks`` the chunks' objects as they come (the Responses route's)."""
        check(req.served(calls, describe))
        params = request_params(req, tokenizer)
        text = render_chat(req, tokenizer)
        state = None if thinks is None else prompt_state(thinks, text)
        if state is not None and params.guided_choice:  # (as a grammar, which can wait for the reasoning)
            params = replace(params, guided_choice=(), structure=Structure("grammar", "root ::= " + " | ".join(
                json.dumps(c, ensure_ascii=False) for c in req.guided_choice)))
        if state is not None and params.structure is not None:  # (its grammar from the reasoning's end on)
            params = replace(params, structure=replace(params.structure, after=grammar_after(thinks, state) or ""))
        await compile_structure(req, params)
        ids = await asyncio.to_thread(encode, text, "messages", False, kept_tokens(req, params))
        rids = await start([(ids, choice_params(params, i)) for i in range(req.n)], req.n, "messages")
        tools = req.tool_calls()
        views = [Completion(tokenizer, model_name, f"chatcmpl-{rids[0]}", chat=True, index=i, first=i == 0,
                            scored=req.prompt_logprobs, tools=tools,
                            reasoning=None if thinks is None else ReasoningReader(thinks, state)) for i in range(req.n)]
        return await answer(views, rids, req, request, chunks=chunks)

    add_responses_routes(app, chat_answer, lambda: model_name)

    async def counted(rid: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs; one that ends before it finished (its client left, the step
        failed) is counted as finished for the reason ``abort``."""
        finished = False
        try:
            async for out in engine.stream(rid):
                finished = finished or out.finished
                yield out
        finally:
            if not finished:
                metrics.aborted()

    async def answer(views: list[Completion], rids: list[str], req, request: Request, best: tuple | None = None,
                     chunks: bool = False):
        streams = [counted(rid) for rid in rids]
        if req.stream:
            so = req.stream_options
            usage = (so is not None and so.include_usage, so is not None and so.continuous_usage_stats)
            if chunks:
                return _chunks(views, streams, *usage)
            return StreamingResponse(_events(views, streams, *usage), media_type="text/event-stream")
        collect = asyncio.ensure_future(_collect(streams))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collect.done():  # the client left: cancelling the stream aborts the request
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            return Response(status_code=499)
        outs = collect.result()
        if best is None:
            return _whole(views, outs)
        usage = _usage(views, [o[-1] for o in outs])  # (every completion made counts)
        return {**_whole(*_best_of(views, outs, *best)), "usage": usage}

    return app


def choice_params(params: RequestParams, i: int) -> RequestParams:
    """Choice ``i``'s parameters: its seed ``seed + i`` (without a seed, the draws differ anyway)."""
    seed = params.sampling.seed
    return params if i == 0 or seed is None else replace(params, sampling=replace(params.sampling, seed=seed + i))


def _best_of(views: list[Completion], outs: list[list[RequestOutput]], k: int, n: int,
             strip: bool) -> tuple[list[Completion], list[list[RequestOutput]]]:
    """Of each prompt's ``k`` completions the ``n`` of highest mean token logprob (OpenAI's "highest
    log probability per token"), best first and numbered anew; ``strip``: their logprobs dropped
    (the request asked for none)."""
    def mean(o: list[RequestOutput]) -> float:
        lps = [x.logprob for out in o for x in out.logprobs or ()]
        return sum(lps) / max(1, len(lps))

    kept_views, kept_outs = [], []
    for p in range(0, len(views), k):
        for i in sorted(range(p, p + k), key=lambda i: -mean(outs[i]))[:n]:
            views[i].index = len(kept_views)
            kept_views.append(views[i])
            kept_outs.append([replace(o, logprobs=None) for o in outs[i]] if strip else outs[i])
    return kept_views, kept_outs


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(i, output)`` of the streams as their outputs come. Leaving early (or a stream's
    failure) closes every stream, so each unfinished request is aborted."""
    if len(streams) == 1:  # the usual request: no task and no wait a token
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[list[RequestOutput]]:
    outs: list[list[RequestOutput]] = [[] for _ in streams]
    async for i, out in _merged(streams):
        outs[i].append(out)
    return outs


def _usage(views: list[Completion], lasts: list[RequestOutput]) -> dict:
    """Each prompt once (as its first choice met it), the tokens of every choice (none where
    they were dropped: ``max_tokens`` 0)."""
    firsts = [last for v, last in zip(views, lasts, strict=True) if v.first]
    prompt = sum(last.prompt_tokens for last in firsts)
    completion = sum(0 if v.drop else last.completion_tokens for v, last in zip(views, lasts, strict=True))
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": sum(last.cached_tokens for last in firsts)}}
    if any(v.reasoning is not None for v in views):  # (OpenAI's count of the tokens that reasoned)
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(v.reasoning.tokens for v in views)}
    return usage


def _whole(views: list[Completion], outs: list[list[RequestOutput]]) -> dict:
    """The non-streaming answer: every choice's outputs joined (chat's ``prompt_logprobs``, of
    its one prompt, beside the choices, as vLLM puts them)."""
    body = views[0].envelope([v.whole(o) for v, o in zip(views, outs, strict=True)], chunk=False)
    if views[0].chat and views[0].scored is not None:
        body["prompt_logprobs"] = views[0].vllm_prompt_logprobs(outs[0][0].prompt_logprobs)
    return {**body, "usage": _usage(views, [o[-1] for o in outs])}


async def _events(views: list[Completion], streams: list[AsyncIterator[RequestOutput]],
                  include_usage: bool, continuous: bool = False) -> AsyncIterator[str]:
    """Server-sent events: one chunk per output with text (or logprobs) naming its choice, then
    ``[DONE]``."""
    async for chunk in _chunks(views, streams, include_usage, continuous):
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


async def _chunks(views: list[Completion], streams: list[AsyncIterator[RequestOutput]],
                  include_usage: bool, continuous: bool = False) -> AsyncIterator[dict]:
    """The stream's chunk objects (an error's, ``{"error": ...}``, last where the engine failed);
    ``continuous``: each chunk of an output with its choice's usage so far (vLLM's
    ``continuous_usage_stats``)."""
    if views[0].chat:
        for v in views:
            first = {"index": v.index, "delta": {"role": "assistant", "content": "" if v.tools is None else None},
                     "logprobs": None, "finish_reason": None}
            yield v.envelope([first], chunk=True)
    lasts: list[RequestOutput | None] = [None] * len(views)
    try:
        async for i, out in _merged(streams):
            lasts[i] = out
            v = views[i]
            if out.text or out.finished or out.logprobs is not None or v.echo is not None:
                text, items = v.parts([out])
                choice = v.choice(text, out.finish_reason, items, chunk=True, pieces=() if v.drop else out.pieces)
                if choice.get("delta", True) or choice["finish_reason"] or choice["logprobs"]:  # (not a held call's)
                    body = v.envelope([choice], chunk=True)
                    if continuous:
                        done = 0 if v.drop else out.completion_tokens
                        body["usage"] = {"prompt_tokens": out.prompt_tokens, "completion_tokens": done,
                                         "total_tokens": out.prompt_tokens + done}
                    yield body
    except RequestsEnded as e:  # the server is stopping: the status is sent already
        yield APIError(503, str(e), type="server_error", code="server_shutting_down").body()
    except Exception as e:  # the engine failed mid-stream: the status is sent already
        yield APIError(500, f"internal error: {e}", type="server_error").body()
    if include_usage and all(last is not None for last in lasts):
        yield {**views[0].envelope([], chunk=True), "usage": _usage(views, lasts)}


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
