"""tool_choice "auto" through a real ``kvtier serve``, one server a call format
(``--tool-call-parser hermes`` and ``llama3_json``): the model's own calls read out of its text,
whole and streamed, against its free answer to the same prompt."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai import AsyncOpenAI

from kvtier.serve.tools import FORMATS, CallFormat, CallReader
from server_support import running_server

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module", params=sorted(FORMATS))
def fmt(request) -> CallFormat:
    return FORMATS[request.param]


@pytest.fixture(scope="module")
def server(fmt, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"tools_{fmt.name}") / "serve.log"
    with running_server(log, "--num-blocks", "96", "--tool-call-parser", fmt.name) as url:
        yield url


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def auto_history(fmt: CallFormat, as_text: bool) -> list[dict]:
    """Two earlier turns that called get_weather and used its answer: the calls as OpenAI's
    ``tool_calls``, or (``as_text``) written into the assistant's text in ``fmt``."""
    out = []
    for i, (city, weather) in enumerate([("Paris", "sunny"), ("Berlin", "cloudy")]):
        args = json.dumps({"city": city})
        said = ({"content": fmt.write("get_weather", args)} if as_text else {"content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}]})
        out += [*ask(f"What is the weather in {city}?"), {"role": "assistant", **said},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"weather": weather})},
                {"role": "assistant", "content": f"It is {weather} in {city}."}]
    return out


CITY = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


QUESTIONS = (("What is the weather in Tokyo?", True), ("Tell me a joke.", False))


def test_auto_tool_choice_gives_the_models_own_calls_or_text(server, model, fmt) -> None:
    """``tool_choice`` left out (``"auto"``): SmolLM2's template ignores tools, so the server
    describes them in the format and writes earlier calls in it. The answer equals the model's
    free answer to that same prompt (tools written in by hand, ``tool_choice`` "none") read back
    by the format: a call where the free answer wrote one, text where it did not. Both questions'
    free, whole and streamed answers are asked at once (one batch)."""
    def asks(question: str) -> dict:
        return dict(model=model, temperature=0, max_tokens=40, tools=[CITY],
                    messages=[*auto_history(fmt, False), *ask(question)])

    async def all_at_once():
        async with AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            async def streamed(question):
                out = []
                async for chunk in await c.chat.completions.create(**asks(question), stream=True):
                    out += chunk.choices
                return out
            return await asyncio.gather(*(coro for q, _ in QUESTIONS for coro in (
                c.chat.completions.create(model=model, temperature=0, max_tokens=40, tools=[CITY], tool_choice="none",
                                          messages=[{"role": "system", "content": fmt.describe([CITY])},
                                                    *auto_history(fmt, True), *ask(q)]),
                c.chat.completions.create(**asks(q)), streamed(q))))

    got = asyncio.run(asyncio.wait_for(all_at_once(), 300))
    for k, (question, called) in enumerate(QUESTIONS):
        free, r, streamed = got[3 * k: 3 * k + 3]
        text, calls = CallReader(fmt).feed(free.choices[0].message.content, final=True)
        choice = r.choices[0]
        made = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        assert bool(calls) == called and made == calls, (question, free.choices[0].message.content, choice.message)
        assert choice.finish_reason == ("tool_calls" if called else free.choices[0].finish_reason)
        assert choice.message.content == (text.strip() or None if called else text)
        deltas = [d for c in streamed for d in c.delta.tool_calls or []]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
            (i, n, a) for i, (n, a) in enumerate(calls)] and all(d.id.startswith("call_") for d in deltas)
        assert "".join(c.delta.content or "" for c in streamed) == text
        assert streamed[-1].finish_reason == choice.finish_reason
        assert all(c.delta.role or c.delta.content or c.delta.tool_calls or c.finish_reason for c in streamed)  # (no empty chunk)
