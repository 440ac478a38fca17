"""Tool calls (kvtier.serve.tools): what tools and tool_choice ask of the answer, the calls read
back from it, and every refusal naming its field."""

from __future__ import annotations

import json

import pytest

from kvtier.serve.tools import MAX_TOOLS, ToolError, tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # (no parameters: an empty object)


def test_a_named_function_is_its_parameters_schema() -> None:
    calls = tool_calls([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert calls.named == "get_weather" and json.loads(calls.structure.spec) == WEATHER["function"]["parameters"]
    (call,) = calls.calls('{"city": "Paris"}')
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls.calls('{"city": "Par') is None  # (cut by max_tokens: no call)
    assert json.loads(tool_calls([TIME], {"type": "function", "function": {"name": "get_time"}}).structure.spec) == {
        "type": "object", "properties": {}}


def test_required_is_an_array_of_calls_of_any_tool() -> None:
    calls = tool_calls([WEATHER, TIME], "required")
    schema = json.loads(calls.structure.spec)
    assert calls.named is None and schema["type"] == "array" and schema["minItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "get_weather"}, {"const": "get_time"}]
    got = calls.calls('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [
        ("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert len({c["id"] for c in got}) == 2
    assert "maxItems" not in schema and json.loads(tool_calls([WEATHER], "required", parallel=False).structure.spec)[
        "maxItems"] == 1


def test_none_and_no_tools_are_text() -> None:
    assert tool_calls(None, None) is None and tool_calls([WEATHER], "none") is None and tool_calls([], "none") is None


@pytest.mark.parametrize("tools,choice,param,message", [
    ([WEATHER], None, "tool_choice", 'tool_choice "auto" (the default with tools) needs the model\'s tool-call format'),
    ([WEATHER], "auto", "tool_choice", "start it with --tool-call-parser {hermes,llama3_json}, or send tool_choice"),
    (None, "required", "tool_choice", 'tool_choice "required" needs tools'),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "naming one of the tools (get_weather)"),
    ([WEATHER], "always", "tool_choice", 'got "always"'),
    ([{"type": "function", "function": {"name": "has space"}}], "required", "tools", "tools[0] must be"),
    ([{"type": "code_interpreter"}], "required", "tools", "tools[0] must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required", "tools", "parameters must be"),
    ([WEATHER] * (MAX_TOOLS + 1), "required", "tools", f"at most {MAX_TOOLS}"),
])
def test_tools_and_choices_not_served_name_their_field(tools, choice, param, message) -> None:
    with pytest.raises(ToolError, match=None) as e:
        tool_calls(tools, choice)
    assert e.value.param == param and message in str(e.value), str(e.value)
