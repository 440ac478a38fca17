"""AsyncLLMEngine: the engine's step loop in one background thread, streams for asyncio callers.

The engine is synchronous: a step is one forward pass, and nothing else may touch
the engine while it runs. :class:`AsyncLLMEngine` gives it one thread of its own.
Callers (the HTTP handlers, on the event loop) never call the engine: they post
commands to an inbox that the loop drains between steps, and receive each
request's :class:`~kvtier.serve.params.RequestOutput` objects through an
``asyncio.Queue`` filled with ``loop.call_soon_threadsafe``. So an admission error
(a full queue, a prompt too long) reaches the caller before any response starts,
and an abort (a client that went away) takes effect at the next step boundary.

A step that raises fails the requests in flight (their streams raise) and the loop
goes on serving new ones.

Example::

    engine = AsyncLLMEngine(LLMEngine(model, tokenizer))
    engine.start()
    rid = await engine.add_request(ids, RequestParams(max_tokens=16))   # QueueFull, ValueError
    async for out in engine.stream(rid):
        print(out.text, end="")
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from kvtier.serve.engine import LLMEngine
from kvtier.serve.params import RequestOutput, RequestParams

__all__ = ["AsyncLLMEngine", "EngineStepFailed", "RequestsEnded"]

_log = logging.getLogger("kvtier.serve")


class EngineStepFailed(RuntimeError):
    """A step of the engine raised; the requests in flight were dropped."""


class RequestsEnded(RuntimeError):
    """The requests in flight were ended from outside (:meth:`AsyncLLMEngine.end_all`: the
    server is shutting down)."""


class AsyncLLMEngine:
    """Runs ``engine`` in a background thread (see the module docstring).

    ``observers``: callables given every :class:`RequestOutput` in the loop thread
    (metrics). ``stats``: the engine's :meth:`~kvtier.serve.engine.LLMEngine.stats`
    as of the last step, safe to read from any thread.
    """

    def __init__(self, engine: LLMEngine, observers: Sequence[Callable[[RequestOutput], None]] = ()):
        self.engine = engine
        self.observers = list(observers)
        self.stats = engine.stats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams
        self._thread: threading.Thread | None = None

    # -- lifetime ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise ValueError("the engine loop is already running")
        if self._stop.is_set():
            raise ValueError("this engine loop was shut down; make a new AsyncLLMEngine")
        self._thread = threading.Thread(target=self._loop, name="kvtier-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the loop after its current step; requests in flight are dropped: their streams
        raise :class:`RequestsEnded`, and requests still being queued get it too. ``False`` when
        a step outlived ``timeout`` (the engine is then left alone), else ``True``."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():  # (a step still running: the engine is not ours to touch)
                return False
        ended = RequestsEnded("the engine was shut down; the request was dropped")
        while True:  # requests posted but not taken
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command[0] in ("add", "call") and command[-1].set_running_or_notify_cancel():
                command[-1].set_exception(ended if command[0] == "add" else
                                          RuntimeError("the engine loop was shut down before the call ran"))
        self.engine.abort_all()
        with self._lock:
            open_ = list(self._streams)
        for rid in open_:
            self._deliver(rid, ended)
        return True

    # -- the caller's side ---------------------------------------------------------------------
    async def add_request(self, prompt_token_ids: Sequence[int], params: RequestParams,
                          request_id: str | None = None) -> str:
        """Queue a request in the engine; returns its id once it is queued.

        Raises what :meth:`LLMEngine.add_request` raises (``ValueError``,
        :class:`~kvtier.serve.scheduler.QueueFull`); then nothing was queued. ``RuntimeError``
        before :meth:`start` and after :meth:`shutdown`.
        """
        if self._thread is None:
            raise RuntimeError("the engine loop is not running: call start() first"
                               if not self._stop.is_set() else "the engine loop was shut down")
        try:
            ids = list(prompt_token_ids)
        except TypeError:
            raise ValueError(f"prompt_token_ids must be a sequence of token ids, got "
                             f"{type(prompt_token_ids).__name__}") from None
        rid = request_id or uuid.uuid4().hex
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), asyncio.Queue())
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("add", rid, ids, params, added))
        try:
            await asyncio.wrap_future(added)
        except BaseException:  # refused, or the caller was cancelled while it waited
            self._drop(rid)
            raise
        return rid

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The outputs of a request queued by :meth:`add_request`, up to the finished one.

        Leaving early (a closed stream, a cancelled task) aborts the request.
        """
        with self._lock:
            _, outputs = self._streams[request_id]
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._drop(request_id, abort=not finished)

    def abort(self, request_id: str) -> None:
        """Drop a request at the next step boundary (a no-op for an unknown id)."""
        self._post(("abort", request_id))

    def discard(self, request_id: str) -> None:
        """Abort a queued request whose outputs will not be read (its stream never opened)."""
        self._drop(request_id)

    def end_all(self, why: str) -> None:
        """End every request in flight at the next step boundary: each stream raises
        :class:`RequestsEnded` with ``why`` (a server that stops answers them so)."""
        self._post(("end_all", why))

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the loop thread between two steps (nothing steps meanwhile: a
        periodic save of the prefix cache); its result or exception comes in the future.
        ``RuntimeError`` before :meth:`start` and after :meth:`shutdown`."""
        if self._thread is None:
            raise RuntimeError("the engine loop is not running: call start() first"
                               if not self._stop.is_set() else "the engine loop was shut down")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", fn, done))
        return done

    def _drop(self, rid: str, abort: bool = True) -> None:
        with self._lock:
            self._streams.pop(rid, None)
        if abort:
            self.abort(rid)

    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    # -- the loop thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self.stats = self.engine.stats()
                self._wake.wait(timeout=1.0)
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug or a device error: fail these requests, keep serving
                # the cause goes to the server's log; a client gets its kind alone (a rank's
                # broken connection under tensor parallel names peers' addresses, a device
                # error the memory's layout)
                _log.error("the engine step failed; the requests in flight were dropped", exc_info=e)
                failed = EngineStepFailed(f"the engine step failed ({type(e).__name__}); the request "
                                          "was dropped (the server's log holds the cause)")
                for rid in self.engine.abort_all():
                    self._deliver(rid, failed)
                continue
            for out in outputs:
                for observe in self.observers:
                    observe(out)
                self._deliver(out.request_id, out)
            self.stats = self.engine.stats()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "abort":
                self.engine.abort(command[1])
                continue
            if command[0] == "end_all":
                for rid in self.engine.abort_all():
                    self._deliver(rid, RequestsEnded(command[1]))
                continue
            if command[0] == "call":
                if command[2].set_running_or_notify_cancel():
                    try:
                        command[2].set_result(command[1](self.engine))
                    except Exception as e:
                        command[2].set_exception(e)
                continue
            _, rid, ids, params, added = command
            if not added.set_running_or_notify_cancel():
                continue  # the caller gave up before its request was taken
            try:
                self.engine.add_request(ids, params, request_id=rid)
            except Exception as e:  # ValueError, QueueFull: the caller's answer
                added.set_exception(e)
            else:
                added.set_result(rid)

    def _deliver(self, rid: str, item: RequestOutput | Exception) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is None:
            return  # the caller left; its abort is in the inbox
        loop, outputs = target
        with contextlib.suppress(RuntimeError):  # RuntimeError: the caller's event loop is closed
            loop.call_soon_threadsafe(outputs.put_nowait, item)
