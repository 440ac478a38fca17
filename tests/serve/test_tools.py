"""Tool calls (kvtier.serve.tools): what tools and tool_choice ask of the answer, the calls read
back from it, and every refusal naming its field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.model.tokenizer import compile_chat_template
from kvtier.serve.tools import (
    FORMATS,
    MAX_TOOLS,
    CallFormat,
    CallReader,
    Piece,
    ToolError,
    call_format,
    chat_messages,
    describes_tools,
    tool_calls,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # (no parameters: an empty object)


def test_a_named_function_is_its_parameters_schema() -> None:
    calls = tool_calls([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert calls.named == "get_weather" and json.loads(calls.structure.spec) == WEATHER["function"]["parameters"]
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
    assert len({c["id"] for c in got}) == 2 and all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in got)
    assert calls.calls('[{"name": "get_time", "param') is None  # (cut by max_tokens: no calls)
    assert "maxItems" not in schema and json.loads(tool_calls([WEATHER], "required", parallel=False).structure.spec)[
        "maxItems"] == 1


def test_none_and_no_tools_are_text() -> None:
    assert tool_calls(None, None) is None and tool_calls([WEATHER], "none") is None
    with pytest.raises(ToolError, match="tools is an empty list"):  # (OpenAI's 400 too; was text)
        tool_calls([], "none")


@pytest.mark.parametrize("tools,choice,param,message", [
    ([WEATHER], None, "tool_choice", 'tool_choice "auto" (the default with tools) needs the model\'s tool-call format'),
    ([WEATHER], "auto", "tool_choice", "start it with --tool-call-parser {hermes,qwen3_coder,llama3_json}, or send tool_choice"),
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


# -- tool_choice "auto": calls written among text ------------------------------------------------

def answer(fmt: CallFormat) -> tuple[str, list[Piece]]:
    """An answer with text around two calls (one argument holds the format's own end and trigger),
    and its pieces."""
    args = json.dumps({"city": f"a{fmt.end}b{fmt.trigger}\\\"}}", "n": [1, {"x": None}]})
    parts = ["Let me check. ", fmt.write("get_weather", args), "\n", fmt.write("get_time", "{}"),
             " Done: <tool or {\"na"]
    return "".join(parts), [Piece("text", "Let me check. "), Piece("call", "get_weather", 0),
                            Piece("arguments", args, 0), Piece("text", "\n"), Piece("call", "get_time", 1),
                            Piece("arguments", "{}", 1), Piece("text", " Done: <tool or {\"na")]


def merged(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` with neighbours of one text or one call's arguments joined."""
    out: list[Piece] = []
    for p in pieces:
        if out and p.kind != "call" and (out[-1].kind, out[-1].call) == (p.kind, p.call):
            out[-1] = out[-1]._replace(text=out[-1].text + p.text)
        else:
            out.append(p)
    return out


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12))
def test_calls_read_as_they_stream_equal_the_whole_answers(name, cuts) -> None:
    fmt = FORMATS[name]
    text, pieces = answer(fmt)
    assert merged(CallReader(fmt).feed(text, final=True)) == pieces
    reader, got = CallReader(fmt), []
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(bounds, bounds[1:], strict=False):
        new = reader.feed(text[a:b])
        assert all(fmt.trigger not in p.text for p in new if p.kind == "text"), new  # (no call given out as text)
        got += new
    assert merged(got + reader.feed("", final=True)) == pieces and reader.made == 2


def test_arguments_stream_as_they_come_and_a_cut_call_stays_a_call() -> None:
    fmt = FORMATS["hermes"]
    head = fmt.begin + "get_weather" + fmt.arguments
    reader = CallReader(fmt)
    assert reader.feed("Hi " + head) == [Piece("text", "Hi ")]  # (the name is out once the arguments open)
    assert reader.feed(' {"ci') == [Piece("call", "get_weather", 0), Piece("arguments", '{"ci', 0)]
    assert reader.feed('ty": "Os') == [Piece("arguments", 'ty": "Os', 0)]
    assert reader.feed("", final=True) == [] and reader.made == 1  # (cut by max_tokens: a call, cut)
    whole = fmt.write("get_weather", '{"city": "Oslo"}')
    for cut in (len(whole) - 4, len(whole) - 1):  # (cut in the format's end: the call is whole)
        assert merged(CallReader(fmt).feed(whole[:cut], final=True)) == [
            Piece("call", "get_weather", 0), Piece("arguments", '{"city": "Oslo"}', 0)]


def test_qwen3_coders_parameters_become_json_typed_by_the_tools_schema() -> None:
    """Qwen3-Coder writes ``<parameter=NAME>`` elements: each whole element is the next member of
    the arguments' JSON object, its value typed by the tool's schema (a string stays a string)."""
    fmt = FORMATS["qwen3_coder"]
    whole = fmt.write("plan", json.dumps({"city": "Oslo", "code": "42", "days": 3, "tags": ["a", "b"], "x": None}))
    assert whole == ("<tool_call>\n<function=plan>\n<parameter=city>\nOslo\n</parameter>\n<parameter=code>\n42\n"
                     "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
                     "<parameter=x>\nnull\n</parameter>\n</function>\n</tool_call>")
    schemas = {"plan": {"type": "object", "properties": {"city": {"type": "string"}, "code": {"type": "string"},
                                                          "days": {"type": "integer"}}}}
    reader = CallReader(fmt, schemas)
    first = whole.index("<parameter=code>")  # (the first element whole)
    got = reader.feed("Planning. " + whole[:first])
    assert got == [Piece("text", "Planning. "), Piece("call", "plan", 0), Piece("arguments", '{"city": "Oslo"', 0)]
    rest = merged(reader.feed(whole[first:] + " Done.", final=True))
    args = '{"city": "Oslo"' + rest[0].text
    assert json.loads(args) == {"city": "Oslo", "code": "42", "days": 3, "tags": ["a", "b"], "x": None}
    assert rest[1:] == [Piece("text", " Done.")]
    assert json.loads(merged(CallReader(fmt).feed(whole, final=True))[1].text)["code"] == 42  # (no schema: JSON)
    cut = merged(CallReader(fmt, schemas).feed(whole[:whole.index("<parameter=days>") + 20], final=True))  # (in one)
    assert cut == [Piece("call", "plan", 0), Piece("arguments", '{"city": "Oslo", "code": "42"', 0)]
    assert merged(CallReader(fmt).feed(fmt.write("get_time", "{}"), final=True)) == [
        Piece("call", "get_time", 0), Piece("arguments", "{}", 0)]


def test_a_call_cut_before_its_arguments_or_misspelt_is_text() -> None:
    fmt = FORMATS["hermes"]
    whole = fmt.write("get_weather", '{"city": "Oslo"}')
    for cut in (5, len(fmt.begin) + 3, len(fmt.begin) + len("get_weather") + 4):
        reader = CallReader(fmt)
        assert reader.feed("Hi " + whole[:cut]) == [Piece("text", "Hi ")]  # (held: it may be a call)
        assert reader.feed("", final=True) == [Piece("text", whole[:cut])] and reader.made == 0
    for text in ("<tool_call> not json", '<tool_call>\n{"name": "has space", "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "<tool_call>\n{\"name\": \"" + "f" * 65):
        assert merged(CallReader(fmt).feed(text, final=True)) == [Piece("text", text)], text
    # (a call's end misspelt after whole arguments: the call stands, what follows is text)
    assert merged(CallReader(fmt).feed('<tool_call>\n{"name": "f", "arguments": {}} </tool_call>', final=True)) == [
        Piece("call", "f", 0), Piece("arguments", "{}", 0), Piece("text", "} </tool_call>")]


def test_auto_holds_each_call_to_its_tool_and_needs_a_format() -> None:
    fmt = FORMATS["llama3_json"]
    calls = tool_calls([WEATHER, TIME], "auto", fmt=fmt)
    assert calls.named is None and calls.auto is fmt and calls.structure.kind == "structural_tag"
    tag = json.loads(calls.structure.spec)["format"]
    assert tag["triggers"] == ['{"name": '] and not tag["stop_after_first"]
    assert [(t["begin"], t["content"]["json_schema"], t["end"]) for t in tag["tags"]] == [
        ('{"name": "get_weather", "parameters": ', WEATHER["function"]["parameters"], "}"),
        ('{"name": "get_time", "parameters": ', {"type": "object", "properties": {}}, "}")]
    assert json.loads(tool_calls([WEATHER], None, parallel=False, fmt=fmt).structure.spec)["format"]["stop_after_first"]
    assert tool_calls([WEATHER], "none", fmt=fmt) is None


class Template:
    """A tokenizer's chat side alone: renders with ``kvtier``'s Jinja environment."""

    def __init__(self, source: str):
        self.chat_template, self._t = source, compile_chat_template(source)

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra) -> str:
        return self._t.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


IGNORES = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
HERMES = "{% if tools %}<tool_call>{{ tools | tojson }}{% endif %}" + IGNORES
OTHER = "{% if tools %}{{ tools | tojson }}{% endif %}" + IGNORES
CODER = "{% if tools %}<tool_call>\n<function=NAME>{{ tools | tojson }}{% endif %}" + IGNORES  # (Qwen3-Coder's shape)


def test_the_format_comes_from_the_flag_or_the_template() -> None:
    assert call_format("llama3_json", Template(IGNORES)) is FORMATS["llama3_json"]
    assert call_format("none", Template(HERMES)) is None
    assert call_format(None, Template(HERMES)) is FORMATS["hermes"] and describes_tools(Template(HERMES))
    assert call_format(None, Template(IGNORES)) is FORMATS["hermes"] and not describes_tools(Template(IGNORES))
    assert call_format(None, Template(OTHER)) is None  # (tools described some other way: no guess)
    assert call_format(None, Template(CODER)) is FORMATS["qwen3_coder"]
    with pytest.raises(ValueError, match="must be one of hermes, qwen3_coder, llama3_json or none, got 'mistral'"):
        call_format("mistral", Template(IGNORES))


def test_a_template_that_ignores_tools_is_given_them_and_the_calls_as_text() -> None:
    fmt = FORMATS["hermes"]
    earlier = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    msgs = [{"role": "user", "content": "Weather?"}, earlier, {"role": "tool", "content": "sunny"}]
    out = chat_messages(msgs, [WEATHER], fmt, describe=True)
    assert out[0] == {"role": "system", "content": fmt.describe([WEATHER])} and json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == fmt.write("get_weather", '{"city": "Oslo"}')
    assert out[1] == msgs[0] and out[3] == msgs[2] and msgs[1]["content"] is None  # (the request's own: unchanged)
    system = chat_messages([{"role": "system", "content": "Be brief."}, *msgs], [WEATHER], fmt, describe=False)
    assert system[0] == {"role": "system", "content": "Be brief."} and len(system) == 4
    kept = chat_messages([{"role": "system", "content": "Be brief."}], [WEATHER], fmt, describe=True)
    assert kept == [{"role": "system", "content": "Be brief.\n\n" + fmt.describe([WEATHER])}]
    assert chat_messages(msgs, [WEATHER], None, describe=True) is msgs


def test_the_flag_reaches_the_server_config_and_bad_names_are_refused(capsys) -> None:
    from kvtier import cli
    from kvtier.serve.api import ServerConfig
    from kvtier.serve.cli import configs_from_args

    parse = cli.build_parser().parse_args
    assert configs_from_args(parse(["serve", "--tool-call-parser", "llama3_json"]))[1].tool_call_parser == "llama3_json"
    assert configs_from_args(parse(["serve"]))[1].tool_call_parser is None
    with pytest.raises(SystemExit):
        parse(["serve", "--tool-call-parser", "mistral"])
    assert "invalid choice: 'mistral'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, qwen3_coder, llama3_json, none or None"):
        ServerConfig(tool_call_parser="mistral")


def test_vllms_enable_auto_tool_choice_is_taken_and_needs_a_format() -> None:
    """``--enable-auto-tool-choice`` (vLLM's command lines carry it): a server that reads no call
    format does not start, saying which flag to give."""
    import subprocess
    import sys

    from kvtier import cli
    from kvtier.serve.cli import configs_from_args

    assert configs_from_args(cli.build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))[1].auto_tool_choice
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--port", "0", "--tool-call-parser", "none",
                        "--enable-auto-tool-choice"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--enable-auto-tool-choice needs the model's tool-call format" in r.stderr, r.stderr
