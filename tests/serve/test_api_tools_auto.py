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


def read(fmt: CallFormat, text: str) -> tuple[str, list[tuple[str, str]]]:
    """A whole answer's text outside calls, and its calls ``(name, arguments as written)``."""
    out, calls = "", []
    for p in CallReader(fmt).feed(text, final=True):
        if p.kind == "text":
            out += p.text
        elif p.kind == "call":
            calls.append((p.text, ""))
        else:
            calls[p.call] = (calls[p.call][0], calls[p.call][1] + p.text)
    return out, calls


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
        text, calls = read(fmt, free.choices[0].message.content)
        choice = r.choices[0]
        made = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert bool(calls) == called and made == calls, (question, free.choices[0].message.content, choice.message)
        assert choice.finish_reason == ("tool_calls" if called else free.choices[0].finish_reason)
        assert choice.message.content == (text.strip() or None if called else text)
        deltas = [d for c in streamed for d in c.delta.tool_calls or []]
        parts: dict[int, list[str]] = {}
        for d in deltas:  # (a call's first delta names it; its arguments come in pieces)
            if d.id is not None:
                assert d.id.startswith("call_") and d.index not in parts
                parts[d.index] = [d.function.name, ""]
            parts[d.index][1] += d.function.arguments or ""
        assert [tuple(parts[i]) for i in sorted(parts)] == calls
        assert len(deltas) > 2 * len(calls) if called else not deltas  # (arguments as they come)
        assert "".join(c.delta.content or "" for c in streamed) == text
        assert streamed[-1].finish_reason == choice.finish_reason
        assert all(c.delta.role or c.delta.content or c.delta.tool_calls or c.finish_reason for c in streamed)  # (no empty chunk)


def test_a_call_cut_by_max_tokens_is_the_same_call_whole_and_streamed(server, model, fmt) -> None:
    """An answer cut inside a call's arguments keeps the call with the arguments written so far
    (``finish_reason`` ``length``), as OpenAI's stream leaves it; the whole answer gives what the
    stream gave."""
    asks = dict(model=model, temperature=0, tools=[CITY], messages=[*auto_history(fmt, False), *ask(QUESTIONS[0][0])])

    async def cut_answers():
        async with AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            full = await c.chat.completions.create(**asks, max_tokens=40)
            n = full.usage.completion_tokens

            async def streamed(limit):
                return [ch async for ch in await c.chat.completions.create(**asks, max_tokens=limit, stream=True)]
            limits = range(max(1, n - 8), n)
            got = await asyncio.gather(*(coro for k in limits for coro in (
                c.chat.completions.create(**asks, max_tokens=k), streamed(k))))
            return full, list(zip(limits, got[0::2], got[1::2], strict=True))

    full, runs = asyncio.run(asyncio.wait_for(cut_answers(), 300))
    whole_args = full.choices[0].message.tool_calls[0].function.arguments
    cut_inside = 0
    for limit, r, chunks in runs:
        choice = r.choices[0]
        assert choice.finish_reason == "length" and chunks[-1].choices[0].finish_reason == "length", limit
        made = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        streamed_args = "".join(d.function.arguments or "" for ch in chunks for d in ch.choices[0].delta.tool_calls or [])
        assert [a for _, a in made] == ([streamed_args] if made else []), limit
        assert all(n == "get_weather" and whole_args.startswith(a) for n, a in made), (limit, made)
        cut_inside += bool(made) and made[0][1] != whole_args
    assert cut_inside, [(limit, r.choices[0].message) for limit, r, _ in runs]  # (some cut fell inside the arguments)


@pytest.mark.parametrize("choice", ["auto", "named"])
def test_a_call_cut_by_a_stop_string_is_a_call_cut_short(server, model, fmt, choice) -> None:
    """A stop string met inside a call's arguments cuts them as ``max_tokens`` does: the call with
    the arguments before it, ``finish_reason`` ``length`` (was ``tool_calls`` or ``stop``, a cut
    call looking whole), whole and streamed alike."""
    tool_choice = "auto" if choice == "auto" else {"type": "function", "function": {"name": "get_weather"}}
    asks = dict(model=model, temperature=0, max_tokens=40, tools=[CITY], tool_choice=tool_choice,
                messages=[*auto_history(fmt, False), *ask(QUESTIONS[0][0])])

    async def answers():
        async with AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            full = await c.chat.completions.create(**asks)
            args = full.choices[0].message.tool_calls[0].function.arguments
            city = json.loads(args)["city"]
            cut = await c.chat.completions.create(**asks, stop=[city])
            chunks = [ch async for ch in await c.chat.completions.create(**asks, stop=[city], stream=True)]
            return full, args, city, cut, chunks

    full, args, city, cut, chunks = asyncio.run(asyncio.wait_for(answers(), 300))
    assert full.choices[0].finish_reason == ("tool_calls" if choice == "auto" else "stop") and city, full
    (call,) = cut.choices[0].message.tool_calls
    made = call.function.arguments  # (Qwen3-Coder's elements are given out whole: none of a cut one)
    assert call.function.name == "get_weather" and args.startswith(made) and city not in made, call
    assert made == args[:args.index(city)] or (fmt.xml and choice == "auto"), (made, args)
    assert cut.choices[0].finish_reason == "length" and chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(d.function.arguments or "" for ch in chunks for d in ch.choices[0].delta.tool_calls or [])
    assert streamed == call.function.arguments


ANSWER = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 24},
          "text": {"type": "string", "maxLength": 60}}, "required": ["topic", "text"], "additionalProperties": False}


JSON_QUESTIONS = (QUESTIONS[0], ('Tell me a joke, written as JSON: {"topic": ..., "text": ...}.', False))


def test_auto_beside_a_response_format_gives_calls_or_json_held_to_it(server, model, fmt) -> None:
    """``tools`` with ``response_format`` (OpenAI's pairing): the answer is calls alone or JSON held
    to the format, streamed as whole: a call for Tokyo, JSON for a joke (with Qwen3-Coder's format
    the 135M model calls the tool for the joke too, so the JSON there is the other formats')."""
    def asks(question: str) -> dict:
        return dict(model=model, temperature=0, max_tokens=80, tools=[CITY], messages=[*auto_history(fmt, False),
                    *ask(question)], response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})

    async def all_at_once():
        async with AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            async def streamed(question):
                return [ch async for ch in await c.chat.completions.create(**asks(question), stream=True)]
            return await asyncio.gather(*(coro for q, _ in JSON_QUESTIONS for coro in (
                c.chat.completions.create(**asks(q)), streamed(q))))

    got = asyncio.run(asyncio.wait_for(all_at_once(), 300))
    for k, (_, called) in enumerate(JSON_QUESTIONS):
        r, chunks = got[2 * k], got[2 * k + 1]
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        assert bool(calls) == (called or fmt.name == "qwen3_coder"), choice
        if calls:  # (calls alone, each its tool's)
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
            assert all(c.function.name == "get_weather" and set(json.loads(c.function.arguments)) == {"city"}
                       for c in calls)
        else:  # (JSON held to the format)
            answer = json.loads(choice.message.content)
            assert choice.finish_reason == "stop" and set(answer) == {"topic", "text"}, choice
        streamed_text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        streamed_args = "".join(d.function.arguments or "" for ch in chunks for d in ch.choices[0].delta.tool_calls or [])
        assert streamed_text == (choice.message.content or "") and streamed_args == "".join(
            c.function.arguments for c in calls) and chunks[-1].choices[0].finish_reason == choice.finish_reason
