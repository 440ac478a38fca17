"""OpenAI's Responses API through a real ``kvtier serve`` and the official client: answers equal
to the chat route's for the same conversation (whole, streamed through the client's own event
accumulator, cut by max_output_tokens), stored responses and previous_response_id, text formats
and parse, function tools and their multi-turn items, and every field not served a 400."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from pydantic import BaseModel, Field

from server_support import running_server

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("responses") / "serve.log", "--num-blocks", "96") as url:
        yield url


def chat(client, model, messages, **kw):
    """The chat route's first choice, its ``usage`` beside it."""
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)
    r.choices[0].usage = r.usage
    return r.choices[0]


def test_text_answers_equal_the_chat_routes_whole_and_streamed(client, model) -> None:
    asks = [("What is the capital of France?", None, "What is the capital of France?"),
            ("Name a colour.", "Answer in one word.", "Name a colour."),
            ([{"role": "user", "content": "Hi, I am Ada."}, {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello Ada!"}]},
              {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}], None,
             None)]
    for given, instructions, question in asks:
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + (
            [{"role": "user", "content": question}] if question else [
                {"role": "user", "content": "Hi, I am Ada."}, {"role": "assistant", "content": "Hello Ada!"},
                {"role": "user", "content": "What is my name?"}])
        want = chat(client, model, messages, max_tokens=24)
        r = client.responses.create(model=model, input=given, instructions=instructions, temperature=0,
                                    max_output_tokens=24)
        assert r.status == "completed" and r.output_text == want.message.content and r.id.startswith("resp_")
        assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
        assert (r.usage.input_tokens, r.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
        assert r.instructions == instructions and r.model == model
        with client.responses.stream(model=model, input=given, instructions=instructions, temperature=0,
                                     max_output_tokens=24) as stream:
            events = list(stream)
            final = stream.get_final_response()
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.message.content
        assert final.output_text == want.message.content and final.usage.output_tokens == r.usage.output_tokens


def test_output_text_logprobs_are_the_chat_routes_whole_and_streamed(client, model) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the chat route's
    entries for the same conversation, on the message's text, whole, as streamed deltas and in
    ``output_text.done``."""
    question = [{"role": "user", "content": "Name three colours."}]
    want = chat(client, model, question, max_tokens=12, logprobs=True, top_logprobs=2)
    asks = dict(model=model, input="Name three colours.", temperature=0, max_output_tokens=12,
                include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**asks)
    got = r.output[0].content[0].logprobs
    assert [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in got] == [
        (x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in want.logprobs.content]
    assert len(got) == r.usage.output_tokens and all(len(x.top_logprobs) == 2 for x in got)
    with client.responses.stream(**asks) as stream:
        events = list(stream)
    final = events[-1].response  # (response.incomplete: 12 tokens cut the answer)
    deltas = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [x.token for x in deltas] == [x.token for x in done.logprobs] == [x.token for x in got]
    assert [x.logprob for x in final.output[0].content[0].logprobs] == [x.logprob for x in got]
    plain = client.responses.create(**{k: v for k, v in asks.items() if k not in ("include", "top_logprobs")})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text


def test_max_output_tokens_makes_an_incomplete_response(client, model) -> None:
    """A cut answer's response and the item it cut (a message, or a named call's arguments) are
    "incomplete", whole, in the streamed ``output_item.done`` and in the stream's last event."""
    cut = dict(model=model, input="Tell me a long story.", temperature=0, max_output_tokens=5)
    call = dict(model=model, input="Weather in Rome?", tools=[WEATHER], temperature=0, max_output_tokens=3,
                tool_choice={"type": "function", "name": "get_weather"})
    for asks, kind in ((cut, "message"), (call, "function_call")):
        r = client.responses.create(**asks)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == asks["max_output_tokens"]
        assert [(o.type, o.status) for o in r.output] == [(kind, "incomplete")]
        with client.responses.stream(**asks) as stream:
            events = list(stream)
        (done,) = [e for e in events if e.type == "response.output_item.done"]
        assert events[-1].type == "response.incomplete" and done.item.status == "incomplete"
        assert [(o.type, o.status) for o in events[-1].response.output] == [(kind, "incomplete")]
        assert events[-1].response.output_text == r.output_text


def test_stored_responses_carry_the_conversation(server, client, model) -> None:
    first = client.responses.create(model=model, input="What is the capital of France?", temperature=0,
                                    max_output_tokens=24, instructions="Be brief.")
    second = client.responses.create(model=model, input="And of Germany?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=24)
    # (the first's instructions are not carried over, as OpenAI's)
    want = chat(client, model, [{"role": "user", "content": "What is the capital of France?"},
                                {"role": "assistant", "content": first.output_text},
                                {"role": "user", "content": "And of Germany?"}], max_tokens=24)
    assert second.output_text == want.message.content and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    for rid in (first.id, "resp_unknown"):
        r = httpx.get(f"{server}/v1/responses/{rid}")
        assert r.status_code == 404 and rid in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/responses", json={"input": "x", "previous_response_id": first.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(model=model, input="Hi", store=False, max_output_tokens=4)
    assert httpx.get(f"{server}/v1/responses/{unstored.id}").status_code == 404


class Pick(BaseModel):
    colour: str = Field(max_length=12)
    count: int = Field(ge=0, le=9)


def test_text_formats_and_the_clients_parse(client, model) -> None:
    got = client.responses.parse(model=model, input="Pick a colour and a count.", text_format=Pick,
                                 temperature=0, max_output_tokens=40)
    assert isinstance(got.output_parsed, Pick)
    obj = client.responses.create(model=model, input="Describe Paris as JSON.", temperature=0, max_output_tokens=40,
                                  text={"format": {"type": "json_object"}})
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_function_tools_and_their_items(client, model) -> None:
    r = client.responses.create(model=model, input="What is the weather in Oslo?", tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False, temperature=0,
                                max_output_tokens=80)
    want = chat(client, model, [{"role": "user", "content": "What is the weather in Oslo?"}], tools=[CHAT_WEATHER],
                tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want.message.tool_calls]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    # the calls and their outputs given back as input items: the chat conversation with tool_calls
    items = [{"role": "user", "content": "What is the weather in Oslo?"},
             *({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls),
             *({"type": "function_call_output", "call_id": c.call_id, "output": '{"weather": "rain"}'} for c in calls)]
    after = client.responses.create(model=model, input=items, tools=[WEATHER], tool_choice="none", temperature=0,
                                    max_output_tokens=24)
    history = [{"role": "user", "content": "What is the weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                   for c in calls]},
               *({"role": "tool", "tool_call_id": c.call_id, "content": '{"weather": "rain"}'} for c in calls)]
    assert after.output_text == chat(client, model, history, tools=[CHAT_WEATHER], tool_choice="none",
                                     max_tokens=24).message.content
    named = dict(model=model, input="Weather in Rome?", tools=[WEATHER], temperature=0, max_output_tokens=40,
                 tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(**named)
    with client.responses.stream(**named) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = whole.output
    assert call.type == "function_call" and final.output[0].arguments == call.arguments
    assert call.status == final.output[0].status == "completed"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments


def test_streamed_calls_come_one_item_after_another(client, model) -> None:
    """Each call's item is closed (its arguments' ``.done`` and ``output_item.done``) before the
    next one's ``output_item.added``, as OpenAI streams them; the calls are the whole answer's."""
    asks = dict(model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", temperature=0,
                max_output_tokens=64)
    whole = client.responses.create(**asks)
    with client.responses.stream(**asks) as stream:
        events = list(stream)
    assert len(whole.output) >= 2, whole.output  # (this model calls twice here: the order is tested)
    items = [(e.type.removeprefix("response."), e.output_index) for e in events if hasattr(e, "output_index")]
    want = [(kind, i) for i in range(len(whole.output))
            for kind in ("output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
                         "output_item.done")]
    assert [x for k, x in enumerate(items) if k == 0 or x != items[k - 1]] == want  # (deltas run together)
    final = events[-1].response
    assert [(o.name, o.arguments, o.status) for o in final.output] == [
        (o.name, o.arguments, o.status) for o in whole.output]


def test_function_call_outputs_answer_a_call_of_the_conversation(server, client, model) -> None:
    """A function_call_output answers a function_call of the input or of the previous responses'
    conversation (two back here); one that answers none is a 400, as OpenAI's."""
    first = client.responses.create(model=model, input="Weather in Rome?", tools=[WEATHER], temperature=0,
                                    max_output_tokens=40, tool_choice={"type": "function", "name": "get_weather"})
    (call,) = first.output
    second = client.responses.create(model=model, input="Thanks.", previous_response_id=first.id, temperature=0,
                                     max_output_tokens=4)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": '{"weather": "sunny"}'}
    third = client.responses.create(model=model, input=[answer], previous_response_id=second.id, temperature=0,
                                    max_output_tokens=4)
    assert third.previous_response_id == second.id and third.output
    r = httpx.post(f"{server}/v1/responses", json={"input": [answer], "max_output_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and err["message"].startswith(
        f"No tool call found for function call output with call_id {call.call_id!r}"), err


def test_auto_tool_choice_reads_the_models_calls(client, model) -> None:
    """The Responses route's "auto" is the chat route's: the same history, the same call."""
    items, history = [], []
    for i, (city, weather) in enumerate([("Paris", "sunny"), ("Berlin", "cloudy")]):
        args, cid = json.dumps({"city": city}), f"call_{i}"
        items += [{"role": "user", "content": f"What is the weather in {city}?"},
                  {"type": "function_call", "call_id": cid, "name": "get_weather", "arguments": args},
                  {"type": "function_call_output", "call_id": cid, "output": json.dumps({"weather": weather})},
                  {"role": "assistant", "content": f"It is {weather} in {city}."}]
        history += [{"role": "user", "content": f"What is the weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": cid, "content": json.dumps({"weather": weather})},
                    {"role": "assistant", "content": f"It is {weather} in {city}."}]
    ask = {"role": "user", "content": "What is the weather in Tokyo?"}
    want = chat(client, model, [*history, ask], tools=[CHAT_WEATHER], max_tokens=60)
    r = client.responses.create(model=model, input=[*items, ask], tools=[WEATHER], temperature=0, max_output_tokens=60)
    assert want.message.tool_calls and [(o.name, json.loads(o.arguments)) for o in r.output] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want.message.tool_calls]


@pytest.mark.parametrize("body,param,message", [
    ({"background": True}, "background", "background is not supported"),
    ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning", "reasoning is not supported"),
    ({"reasoning": {"effort": "very"}}, "reasoning.effort", "Input should be"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "include message.output_text.logprobs are served"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input", "reasoning items alone"),
    ({"top_logprobs": 3}, "top_logprobs", 'top_logprobs needs include ["message.output_text.logprobs"]'),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs", "less than or equal to 20"),
    ({"truncation": "auto"}, "truncation", "truncation is not supported"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools", "tools[0] must be a function tool"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     'tools[0] is in the chat completions shape ({"type": "function", "function": {...}}), which is not the '
     'Responses one: give {"type": "function", "name": ..., "parameters": {...}}'),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools",
     'tools[0] must be {"type": "function", "name": ..., "parameters": {...}} with a name of 1 to 64'),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools",
     "tools[0].parameters must be a JSON schema object"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input",
     "input[0].content[0] is an 'input_text' part without its text: give \"text\", a string"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "input",
     "No tool call found for function call output with call_id 'call_nope'"),
    ({"input": [{"type": "function_call", "call_id": "call_a", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_b", "output": "x"}]}, "input",
     "No tool call found for function call output with call_id 'call_b'"),
    ({"previous_response_id": ""}, "previous_response_id", "previous_response_id is empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].content[0] is a 'input_image' part"),
    ({"input": [{"type": "file_search_call"}]}, "input", "input[0] must be a message"),
    ({"input": []}, "input", "a non-empty list of items"),
    ({"input": 3}, "input", "input"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "text.format json_schema needs schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format", "text.format type 'yaml' is not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     'tool_choice {"type": "function", "name": "nope"} must name one of the tools (get_weather)'),
    ({"input": "\udfff"}, "input", "the input holds '\\udfff' at character"),
    ({"input": [{"role": "user", "content": "x" * 40_000}]}, "input", "but the context holds"),
    ({"model": "gpt-4o"}, "model", "does not exist"),
])
def test_fields_not_served_are_400s_naming_them(server, body, param, message) -> None:
    r = httpx.post(f"{server}/v1/responses", content=json.dumps({"input": "x", "max_output_tokens": 4, **body}),
                   headers={"content-type": "application/json"}, timeout=60)  # (json.dumps escapes a surrogate)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_a_client_that_leaves_mid_stream_ends_its_request(server, model) -> None:
    with httpx.stream("POST", f"{server}/v1/responses", json={"input": "Tell me a long story.", "stream": True,
                                                               "max_output_tokens": 2000}, timeout=60) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break
    deadline = time.monotonic() + 30
    while httpx.get(f"{server}/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server}/health").json()["running"] == 0
