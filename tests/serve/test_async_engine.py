"""AsyncLLMEngine's lifetime and refusals on a tiny random model: a request before start() or
after shutdown() is refused at once (both hung), a shutdown ends the streams open (one hung),
a prompt that is no sequence is a ValueError that leaves its id free (it stayed taken), and
the engine's own ids skip those a caller chose."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtier.model import ModelArgs, build_random
from kvtier.serve.async_engine import AsyncLLMEngine, EngineStepFailed, RequestsEnded
from kvtier.serve.engine import EngineConfig, LLMEngine
from kvtier.serve.params import RequestParams

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=128,
                 max_position_embeddings=256)
PROMPT = [5, 9, 17, 33]


def engine() -> LLMEngine:
    return LLMEngine(build_random(ARGS, dtype=torch.float32, std=0.3), None, EngineConfig(num_blocks=32))


def test_requests_before_start_and_after_shutdown_are_refused() -> None:
    eng = AsyncLLMEngine(engine())

    async def add():
        return await asyncio.wait_for(eng.add_request(PROMPT, RequestParams(max_tokens=2)), 10)

    with pytest.raises(RuntimeError, match="call start"):
        asyncio.run(add())
    eng.start()
    assert asyncio.run(add())  # (running: queued)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        asyncio.run(add())
    with pytest.raises(ValueError, match="make a new AsyncLLMEngine"):
        eng.start()


def test_a_shutdown_ends_the_streams_open() -> None:
    eng = AsyncLLMEngine(engine())
    eng.start()

    async def read() -> list[int]:
        rid = await eng.add_request(PROMPT, RequestParams(max_tokens=200, ignore_eos=True))
        seen = []
        async for out in eng.stream(rid):
            seen.append(out.completion_tokens)
            if len(seen) == 2:  # (the loop thread is stopped from another thread, as a server does)
                await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        return seen

    with pytest.raises(RequestsEnded, match="shut down"):
        asyncio.run(asyncio.wait_for(read(), 30))
    assert not eng.engine.has_unfinished()


def test_a_prompt_that_is_no_sequence_leaves_its_id_free() -> None:
    eng = AsyncLLMEngine(engine())
    eng.start()
    try:
        async def run():
            with pytest.raises(ValueError, match="prompt_token_ids must be a sequence"):
                await eng.add_request(None, RequestParams(max_tokens=2), request_id="x")
            rid = await eng.add_request(PROMPT, RequestParams(max_tokens=2), request_id="x")  # (was "in use")
            return [out async for out in eng.stream(rid)][-1]

        last = asyncio.run(asyncio.wait_for(run(), 30))
        assert last.finished and last.completion_tokens == 2
    finally:
        eng.shutdown()


def test_the_engines_ids_skip_those_a_caller_chose() -> None:
    eng = engine()
    eng.add_request(PROMPT, RequestParams(max_tokens=2), request_id="req-0")
    got = eng.add_request(PROMPT, RequestParams(max_tokens=2))  # was "request id 'req-0' is already in use"
    assert got != "req-0" and got.startswith("req-")
    outs = eng.generate([PROMPT], RequestParams(max_tokens=2))
    assert len(outs) == 1


def test_a_failed_step_tells_the_client_its_kind_and_the_log_its_cause(caplog) -> None:
    eng = engine()

    def fail():
        raise RuntimeError("[/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:44438")

    eng.step = fail
    async_eng = AsyncLLMEngine(eng)
    async_eng.start()
    try:
        async def run():
            rid = await async_eng.add_request(PROMPT, RequestParams(max_tokens=2))
            return [out async for out in async_eng.stream(rid)]

        with caplog.at_level("ERROR", logger="kvtier.serve"), \
                pytest.raises(EngineStepFailed) as e:
            asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        async_eng.shutdown()
    # before: the client's message carried the peer's address
    assert str(e.value) == ("the engine step failed (RuntimeError); the request was dropped (the server's "
                            "log holds the cause)")
    assert "127.0.0.1]:44438" in caplog.text


def test_a_call_runs_in_the_loop_between_steps() -> None:
    """``call``: the function runs in the loop's thread while no step runs (steps go on after it),
    its exception reaches the caller, and a call outside the loop's life is refused."""
    import threading

    eng = AsyncLLMEngine(engine())
    with pytest.raises(RuntimeError, match="call start"):
        eng.call(lambda e: None)
    eng.start()
    seen = []

    async def run():
        rid = await eng.add_request(PROMPT, RequestParams(max_tokens=40, ignore_eos=True))
        stream = eng.stream(rid)
        first = await stream.__anext__()
        done = eng.call(lambda e: seen.append((threading.current_thread().name, e.has_unfinished(), e.steps)) or 7)
        rest = [out async for out in stream]
        return first, await asyncio.wrap_future(done), rest

    first, result, rest = asyncio.run(asyncio.wait_for(run(), 60))
    assert result == 7 and seen[0][:2] == ("kvtier-engine", True)  # mid-request, in the loop's thread
    assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) == 40 and rest[-1].finished
    failing = eng.call(lambda e: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        eng.call(lambda e: None)
