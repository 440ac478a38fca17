"""Structured outputs through a real ``kvtier serve``: the official client's ``parse`` with a
pydantic model, OpenAI's ``response_format`` (``json_object``, ``json_schema``, streamed and
with ``n``), vLLM's ``guided_regex`` / ``guided_grammar`` / ``guided_json`` and
``structured_outputs``; and every malformed constraint a 400 naming its field."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from pydantic import BaseModel, Field

from server_support import running_server

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("structured") / "serve.log", "--num-blocks", "96") as url:
        yield url


class City(BaseModel):
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)
    rank: int = Field(ge=1, le=9)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_the_clients_parse_gives_the_pydantic_model(client, model) -> None:
    got = client.chat.completions.parse(model=model, messages=ask("Name a big city, its country and its rank."),
                                        response_format=City, temperature=0, max_tokens=64)
    choice = got.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_a_streamed_schema_with_n(client, model) -> None:
    r = client.chat.completions.create(model=model, messages=ask("Describe Paris as JSON."), max_tokens=96,
                                       temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # (a long answer may run out of tokens first)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    texts = ["", ""]
    stream = client.chat.completions.create(model=model, messages=ask("Is the sky blue?"), max_tokens=48, n=2,
                                            temperature=0.9, seed=5, stream=True, response_format=fmt)
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(json.loads(t)["answer"] in ("yes", "no") for t in texts), texts


def test_vllm_guided_fields_and_structured_outputs(client, model) -> None:
    phone = client.completions.create(model=model, prompt="My phone number is", max_tokens=24, temperature=0,
                                      extra_body={"guided_regex": r" \(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", phone.choices[0].text), phone.choices[0].text
    grammar = 'root ::= " " ("red" | "green" | "blue") "."'
    color = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0,
                                      extra_body={"guided_grammar": grammar})
    assert color.choices[0].text == " blue."
    same = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"grammar": grammar}})
    assert same.choices[0].text == " blue."
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for body in ({"guided_json": schema}, {"guided_json": json.dumps(schema)}, {"structured_outputs": {"json": schema}}):
        r = client.chat.completions.create(model=model, messages=ask("Pick a digit."), max_tokens=32,
                                           temperature=0, extra_body=body)
        assert 0 <= json.loads(r.choices[0].message.content)["n"] <= 9
    # structural tags: xgrammar's format in response_format, vLLM's older form as structured_outputs' JSON text
    tag = {"type": "tag", "begin": "<pick>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</pick>"}
    r = client.chat.completions.create(model=model, messages=ask("Pick a digit."), max_tokens=32, temperature=0,
                                       response_format={"type": "structural_tag", "format": tag})
    text = r.choices[0].message.content
    assert text.startswith("<pick>") and text.endswith("</pick>") and 0 <= json.loads(text[6:-7])["n"] <= 9, text
    older = {"structures": [{"begin": "<pick>", "schema": schema, "end": "</pick>"}], "triggers": ["<pick"]}
    free = client.completions.create(model=model, prompt="The sky is", max_tokens=12, temperature=0)
    held = client.completions.create(model=model, prompt="The sky is", max_tokens=12, temperature=0,
                                     extra_body={"structured_outputs": {"structural_tag": json.dumps(older)}})
    assert held.choices[0].text == free.choices[0].text  # (no trigger written: the text is free)


@pytest.mark.parametrize("body,param,message", [
    ({"guided_regex": "[a-"}, "guided_regex", "guided_regex: the regular expression does not compile"),
    ({"guided_json": {"type": 3}}, "guided_json", "guided_json: the JSON schema does not compile"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json: the schema is not JSON"),
    ({"guided_json": [1]}, "guided_json", "must be a JSON schema"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "guided_grammar: the grammar does not compile"),
    ({"guided_grammar": ""}, "guided_grammar", "must be a grammar as a non-empty string"),
    ({"guided_grammar": "root ::= root"}, "guided_grammar", "guided_grammar: the grammar admits no answer"),
    ({"guided_regex": "a", "guided_json": {}}, "guided_regex", "give one structured output, not guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one structured output"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "give one structured output, not response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "response_format structural_tag needs format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format",
     "response_format: the structural tag does not compile: Invalid structural tag error: Format type not recognized"),
    ({"structured_outputs": {"structural_tag": "{not"}}, "structured_outputs",
     "structured_outputs: the structural tag is not JSON"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "json_object must be true"),
    ({"guided_regex": "[0-9]+", "ignore_eos": True}, "guided_regex", "give stop_token_ids"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format",
     "structured outputs end the answer with a stop id"),  # was "response_formatd outputs"
    ({"structured_outputs": {"regex": "[0-9]+", "json_object": True}}, "structured_outputs",
     "not structured_outputs.regex and structured_outputs.json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {"type": "string"}}}}},
     "response_format", "response_format: the schema uses not at $, which the grammar would ignore"),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "guided_json",
     "the schema uses uniqueItems at $"),
    ({"guided_regex": "[0-9]+", "min_tokens": 2}, "guided_regex", "guided_regex chooses which tokens may come itself"),
    ({"guided_regex": "a" * 70_000}, "guided_regex", "guided_regex holds 70000 characters; at most 65536"),
])
def test_malformed_constraints_are_400s(server, body, param, message) -> None:
    for route, head in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": ask("x")})):
        r = httpx.post(f"{server}/v1/{route}", json={**head, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err
    assert httpx.get(f"{server}/health").json()["running"] == 0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}}


def test_a_named_tool_choice_gives_one_call_streamed_or_not(client, model) -> None:
    asks = dict(model=model, messages=ask("What is the weather in Paris?"), tools=[WEATHER, TIME], temperature=0,
                max_tokens=48, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**asks)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert finish == "stop" and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    ids, names, streamed, finishes = set(), [], "", []
    for chunk in client.chat.completions.create(**asks, stream=True):
        for c in chunk.choices:
            finishes.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                ids.add(d.id) if d.id else None
                names.append(d.function.name) if d.function.name else None
                streamed += d.function.arguments or ""
    assert len(ids) == 1 and names == ["get_weather"] and streamed == call.function.arguments and finishes[-1] == "stop"
    # (cut by max_tokens: the call stays, its arguments cut, whole and streamed alike)
    cut = client.chat.completions.create(**{**asks, "max_tokens": 4}).choices[0]
    chunks = [c for chunk in client.chat.completions.create(**{**asks, "max_tokens": 4}, stream=True) for c in chunk.choices]
    (part,) = cut.message.tool_calls
    assert cut.finish_reason == chunks[-1].finish_reason == "length" and cut.message.content is None
    assert part.function.name == "get_weather" and call.function.arguments.startswith(part.function.arguments)
    assert part.function.arguments == "".join(d.function.arguments for c in chunks for d in c.delta.tool_calls or [])
    assert 0 < len(part.function.arguments) < len(call.function.arguments)


def test_required_tool_calls_and_a_conversation_that_carries_them(client, model) -> None:
    asks = dict(model=model, messages=ask("What is the weather in Oslo?"), tools=[WEATHER, TIME],
                tool_choice="required", temperature=0, max_tokens=96)
    r = client.chat.completions.create(**asks)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    streamed = [c for chunk in client.chat.completions.create(**asks, stream=True) for c in chunk.choices]
    calls = [d for c in streamed for d in c.delta.tool_calls or []]
    assert streamed[-1].finish_reason == "tool_calls"
    assert [(d.function.name, d.function.arguments) for d in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    history = [*asks["messages"], {"role": "assistant", "content": None, "tool_calls": [
        c.model_dump() for c in choice.message.tool_calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "content": "12:00"} for c in choice.message.tool_calls]
    after = client.chat.completions.create(model=model, messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                           temperature=0, max_tokens=16)
    assert after.choices[0].message.content and not after.choices[0].message.tool_calls
    # (this question's free array repeats one call past 200 tokens; parallel_tool_calls false: one)
    one = client.chat.completions.create(**{**asks, "messages": ask("What time is it in Tokyo, and the weather in Oslo?")},
                                         parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("body,param,message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "naming one of the tools (get_weather)"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools", "tools[0] must be"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "give one structured output, not guided_regex and tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     'not response_format and tool_choice; tool calls are one (with tool_choice "auto", the default with tools, '
     'only response_format may join them): send tool_choice "none" for an answer held to response_format'),
    ({"tools": [WEATHER], "guided_regex": "a"}, "tool_choice", "give one structured output, not guided_regex"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools and tool_choice"),
])
def test_tools_not_served_are_400s(server, body, param, message) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": ask("x"), "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err

