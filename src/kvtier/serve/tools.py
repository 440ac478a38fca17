"""Tool calls in chat completions (OpenAI's ``tools`` and ``tool_choice``), made by structured
outputs: the answer is held to the JSON of the call, so it is always a well-formed call.

- ``tool_choice: {"type": "function", "function": {"name": NAME}}``: the answer is the arguments
  of NAME, held to its ``parameters`` schema; the message carries one tool call, and
  ``finish_reason`` is ``stop`` (as OpenAI answers a named function);
- ``tool_choice: "required"``: the answer is a JSON array of one or more ``{"name": ...,
  "parameters": {...}}`` (one with ``parallel_tool_calls: false``), each held to its function's
  schema; the message carries those calls, and ``finish_reason`` is ``tool_calls``;
- ``"none"`` (or no tools): text, as without tools.

- ``"auto"`` (OpenAI's default when tools are given): the model writes text, calls, or both, in
  its family's own call format (:class:`CallFormat`: ``hermes``, Qwen's and Hermes'
  ``<tool_call>`` JSON; ``qwen3_coder``, Qwen3-Coder's ``<parameter=NAME>`` elements;
  ``llama3_json``, Llama 3's bare JSON). The answer is free text until the
  format's trigger, then held to a call of one of the tools (xgrammar's structural tags), so
  every call written is well formed; :class:`CallReader` reads the calls back as the text
  streams (a call's name once its arguments open, then the arguments as they come). Without a format (the server's ``--tool-call-parser none``) ``"auto"`` is a 400.

The tools are given to the chat template (``tools``), as transformers gives them, so a template
that describes tools to the model does so. A template that ignores them (SmolLM2's) is given a
system message describing them in the format, and earlier calls written in it
(:func:`chat_messages`).

Example::

    >>> calls = tool_calls([{"type": "function", "function": {"name": "get_weather",
    ...                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    ...                    {"type": "function", "function": {"name": "get_weather"}})
    >>> calls.structure.kind, calls.named
    ('json', 'get_weather')
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvtier.generate import split_at_stop
from kvtier.serve.structured import Structure

__all__ = ["FORMATS", "MAX_TOOLS", "CallFormat", "CallReader", "Piece", "ToolCalls", "ToolError", "call_format", "call_id",
           "chat_messages", "tool_calls"]

#: tools one request may give
MAX_TOOLS = 128

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")
_PARAM, _PARAM_END = "<parameter=", "</parameter>"
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class CallFormat:
    """How a model family writes a tool call: ``begin``, the function's name, ``arguments``, the
    arguments (a JSON object, or with ``xml`` Qwen3-Coder's ``<parameter=NAME>`` elements, one
    a line), ``end``; ``trigger`` (a prefix of ``begin``) starts every call, and
    ``instructions`` (with ``{tools}``, the tools' JSON a line) tell a model the format."""

    name: str
    trigger: str
    begin: str
    arguments: str
    end: str
    instructions: str
    xml: bool = False

    def write(self, name: str, arguments: str) -> str:
        """One call, as the model writes it (``arguments``: the JSON object's text)."""
        if self.xml:
            try:
                value = json.loads(arguments)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                arguments = "".join(f"{_PARAM}{k}>\n{v if isinstance(v, str) else json.dumps(v)}\n{_PARAM_END}\n"
                                    for k, v in value.items())
        return f"{self.begin}{name}{self.arguments}{arguments}{self.end}"

    def structure(self, schemas: dict[str, Any], parallel: bool, answer: dict[str, Any] | None = None) -> Structure:
        """Free text in which each call, once its trigger is written, is held to one of the tools
        and its ``parameters`` schema (one call at most unless ``parallel``). With ``answer`` (a
        JSON schema), the answer is either JSON held to it or calls alone, a line apart."""
        tags = [{"type": "tag", "begin": f"{self.begin}{name}{self.arguments}", "end": self.end,
                 "content": {"type": "qwen_xml_parameter" if self.xml else "json_schema", "json_schema": schema}}
                for name, schema in schemas.items()]
        calls = {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags, "at_least_one": False,
                 "stop_after_first": not parallel}
        if answer is not None:
            calls = {"type": "or", "elements": [{"type": "json_schema", "json_schema": answer}, {
                "type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                "stop_after_first": not parallel}]}
        return Structure("structural_tag", json.dumps({"type": "structural_tag", "format": calls}))

    def describe(self, tools: list[dict[str, Any]]) -> str:
        return self.instructions.format(tools="\n".join(json.dumps(t) for t in tools))


#: the call formats ``tool_choice: "auto"`` reads, by ``--tool-call-parser`` name (vLLM's names)
FORMATS = {
    "hermes": CallFormat(  # Qwen2.5 / Qwen3, Hermes 2 and 3, SmolLM3
        "hermes", "<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>",
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
        "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
        "function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}}\n</tool_call>"),
    "qwen3_coder": CallFormat(  # Qwen3-Coder: <parameter=NAME> elements, not JSON
        "qwen3_coder", "<tool_call>", "<tool_call>\n<function=", ">\n", "</function>\n</tool_call>",
        "# Tools\n\nThese functions may be called:\n\n<tools>\n{tools}\n</tools>\n\nTo call one, answer with "
        "this and nothing after it, a parameter element for each argument:\n<tool_call>\n<function=NAME>\n"
        "<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call>", xml=True),
    "llama3_json": CallFormat(  # Llama 3.1 to 3.3
        "llama3_json", '{"name": ', '{"name": "', '", "parameters": ', "}",
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\nRespond in the format {{\"name\": function name, "
        "\"parameters\": dictionary of argument name and its value}}. Do not use variables.\n\n{tools}"),
}

_PROBE = {"type": "function", "function": {"name": "kvtier_probe_tool", "parameters": _NO_PARAMETERS}}


def describes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes the ``tools`` it is given into the prompt."""
    try:
        return "kvtier_probe_tool" in tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                                                      tools=[_PROBE])
    except Exception:  # (a template that fails on tools describes none; a chat with tools is then its 400)
        return False


def call_format(parser: str | None, tokenizer) -> CallFormat | None:
    """The call format of ``--tool-call-parser`` (``"none"``: none, so ``"auto"`` is refused); by
    default ``qwen3_coder`` where the chat template writes ``<function=``, ``hermes`` where it
    writes ``<tool_call>`` or ignores tools (the server then describes them in that format), none
    where it describes tools some other way."""
    if parser is not None:
        if parser != "none" and parser not in FORMATS:
            raise ValueError(f"tool call parser must be one of {', '.join(FORMATS)} or none, got {parser!r}")
        return FORMATS.get(parser)
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<function=" in template:
        return FORMATS["qwen3_coder"]
    return FORMATS["hermes"] if "<tool_call>" in template or not describes_tools(tokenizer) else None


def chat_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]], fmt: CallFormat | None,
                  describe: bool) -> list[dict[str, Any]]:
    """``messages`` for a template that ignores tools (``fmt`` given): the tools described in the
    system message (where ``describe``) and assistant turns' ``tool_calls`` written into their
    text in ``fmt``; unchanged otherwise."""
    if fmt is None:
        return messages
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            written = [fmt.write(c.get("function", {}).get("name", ""), c.get("function", {}).get("arguments", "{}"))
                       for c in m["tool_calls"] if isinstance(c, dict)]
            m = {**m, "content": "\n".join(([m["content"]] if m["content"] else []) + written)}
        out.append(m)
    if describe and tools:
        text = fmt.describe(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


class Piece(NamedTuple):
    """A part of an answer read by :class:`CallReader`: ``kind`` ``"text"`` (outside calls),
    ``"call"`` (a call begins; ``text`` its function's name) or ``"arguments"`` (``text`` the next
    part of the call's arguments, JSON as written); ``call`` the call's index in the answer."""

    kind: str
    text: str
    call: int = -1


class CallReader:
    """Reads an answer written under :meth:`CallFormat.structure` as it streams: :meth:`feed`
    gives the text outside calls (holding back an end that may begin a trigger), each call's name
    once its arguments begin, and the arguments as they come (JSON as written; Qwen3-Coder's
    parameters as a JSON object, one member once its element is whole, typed by ``schemas``, the
    tools' ``parameters``). ``final`` gives out what is held: a trigger not followed by a call is
    text; a call cut inside its arguments (``max_tokens``, a stop string) stays a call with the
    arguments written so far, as OpenAI's stream leaves it."""

    def __init__(self, fmt: CallFormat, schemas: dict[str, Any] | None = None):
        self.fmt, self.schemas, self.held, self.made = fmt, schemas or {}, "", 0
        self._at = "text"  # where the answer is: "text", a call's "arguments" or the call's "end"
        self._depth, self._string, self._escape = 0, False, False
        self._name, self._members = "", 0  # (the XML call's function, and its members given out)

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        """The pieces ``text`` completes, in order (``final``: the answer's end)."""
        self.held += text
        out: list[Piece] = []
        trigger, end = self.fmt.trigger, self.fmt.end
        while self.held:
            if self._at == "arguments" and self.fmt.xml:
                if not self._parameters(out, final):
                    break
                continue
            if self._at == "arguments":  # the arguments, as they come, up to their object's close
                cut = self._scan()
                out.append(Piece("arguments", self.held[:cut], self.made - 1))
                self.held = self.held[cut:]
                if self._depth:
                    break
                self._at = "end"
                continue
            if self._at == "end":  # the format's end of the call, once written
                i = 0
                while i < len(self.held) and self.held[i].isspace() and not end.startswith(self.held[i]):
                    i += 1
                if self.held.startswith(end, i) or not end.startswith(self.held[i:]):
                    self.held = self.held[i + len(end):] if self.held.startswith(end, i) else self.held
                    self._at = "text"
                    continue
                if final:  # (a call whose end was cut: the call stands, its end's start is no text)
                    self.held = ""
                break
            before, _, found = split_at_stop(self.held, (trigger,), hold=not final)  # (an end that may begin it held)
            out.append(Piece("text", before))
            self.held = self.held[len(before):]
            if not found:
                break
            got = self._head()
            if got is None:  # not decided yet
                if final:
                    out.append(Piece("text", self.held))
                    self.held = ""
                break
            if got is False:  # not a call after all: the trigger is text
                out.append(Piece("text", trigger))
                self.held = self.held[len(trigger):]
                continue
            name, used = got
            out.append(Piece("call", name, self.made))
            self.made += 1
            self.held, self._at, self._name, self._members = self.held[used:], "arguments", name, 0
        return [p for p in out if p.text or p.kind == "call"]

    @property
    def cut(self) -> bool:
        """Whether the answer ended inside a call's arguments (after :meth:`feed` with ``final``)."""
        return self._at == "arguments"

    def _head(self) -> tuple[str, int] | bool | None:
        """The call beginning ``held``: ``(name, characters before its arguments)``; ``None``
        where it is not decided yet, ``False`` where it is no call."""
        f, held = self.fmt, self.held
        if not held.startswith(f.begin):
            return None if f.begin.startswith(held) else False
        start = len(f.begin)
        stop = _NAME_CHARS.match(held, start).end()
        name = held[start:stop]
        if len(name) > 64:
            return False
        if stop == len(held) or not held.startswith(f.arguments, stop):
            return None if f.arguments.startswith(held[stop:]) else False
        if not _NAME.fullmatch(name):
            return False
        i = stop + len(f.arguments)
        if f.xml:
            return name, i
        i += len(held[i:]) - len(held[i:].lstrip())
        if i == len(held):
            return None
        return (name, i) if held[i] == "{" else False

    def _scan(self) -> int:
        """How much of ``held`` belongs to the arguments (all of it while their object is open)."""
        depth, string, escape = self._depth, self._string, self._escape
        for j, c in enumerate(self.held):
            if string:
                escape, string = (False, True) if escape else (c == "\\", c != '"')
            elif c == '"':
                string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self._depth, self._string, self._escape = 0, False, False
                    return j + 1
        self._depth, self._string, self._escape = depth, string, escape
        return len(self.held)

    def _parameters(self, out: list[Piece], final: bool) -> bool:
        """Qwen3-Coder's parameters at the start of ``held``: each whole element given out as the
        next member of the arguments' JSON object, the call's end as its close; False where more
        text must come first."""
        end, call = self.fmt.end, self.made - 1
        closed = Piece("arguments", "}" if self._members else "{}", call)  # (the object's close)
        i = len(self.held) - len(self.held.lstrip())
        if self.held.startswith(end, i):  # (the call is whole)
            out.append(closed)
            self.held, self._at = self.held[i + len(end):], "text"
            return True
        if self.held.startswith(_PARAM, i):
            head = self.held.find(">", i)
            close = self.held.find(_PARAM_END, head) if head >= 0 else -1
            if close < 0:
                return False
            key, value = self.held[i + len(_PARAM):head], self.held[head + 1:close]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            kind = ((self.schemas.get(self._name) or {}).get("properties") or {}).get(key, {}).get("type")
            if kind != "string":
                with contextlib.suppress(json.JSONDecodeError):
                    value = json.loads(value)
            out.append(Piece("arguments", ("{" if not self._members else ", ") + f"{json.dumps(key)}: "
                             f"{json.dumps(value)}", call))
            self._members += 1
            self.held = self.held[close + len(_PARAM_END):]
            return True
        rest = self.held[i:]
        if not final and (end.startswith(rest) or _PARAM.startswith(rest)):
            return False
        if not final:  # (not the format after all: the call ends here; what follows is text)
            out.append(closed)
            self._at = "text"
            return True
        self.held = ""  # (cut by the answer's end: the arguments so far)
        return False


def check_messages(messages) -> None:
    """:class:`ToolError` for a chat message OpenAI refuses: a message other than an assistant's
    without ``content``, ``content`` an empty list, a tool result without ``tool_call_id``, or an
    assistant's ``tool_calls`` entry without ``function.name`` and ``function.arguments`` (text)."""
    for i, m in enumerate(messages):
        if m.content == []:
            raise ToolError(f"messages[{i}].content is an empty list; give its text, or at least one text part",
                            f"messages.{i}.content")
        if m.content is None and m.role != "assistant":
            raise ToolError(f"messages[{i}] (a {m.role!r} message) has no content; give its text",
                            f"messages.{i}.content")
        if m.role == "tool" and not m.tool_call_id:
            raise ToolError(f"messages[{i}] is a tool result without tool_call_id; give the id of the call it "
                            "answers", f"messages.{i}.tool_call_id")
        for j, c in enumerate(m.tool_calls or []):
            fn = c.get("function") if isinstance(c, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
                raise ToolError(f"messages[{i}].tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                                "\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}, got "
                                f"{json.dumps(c)[:80]}", f"messages.{i}.tool_calls")


def call_id() -> str:
    """A fresh tool call id, as OpenAI writes them (``call_`` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be served; ``param`` is the field."""

    def __init__(self, message: str, param: str, unsupported: bool = False):
        super().__init__(message)
        self.param, self.unsupported = param, unsupported


@dataclass(frozen=True)
class ToolCalls:
    """How a request's answer becomes tool calls: ``named`` the one function called (``None``:
    ``required``, the answer an array of calls, or ``auto``), ``structure`` what holds the answer
    to it; ``auto``: the format of calls written among text (``tool_choice: "auto"``)."""

    named: str | None
    structure: Structure
    auto: CallFormat | None = None
    schemas: dict[str, Any] | None = None  # the tools' parameters, by name (``auto``'s, to type XML values)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The message's ``tool_calls`` from a ``"required"`` answer's array; ``None`` where the
        text is not a whole array (an answer cut by ``max_tokens``)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [{"id": call_id(), "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["parameters"])}}
                for c in value]


def tool_calls(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool = True,
               fmt: CallFormat | None = None, answer: dict[str, Any] | None = None) -> ToolCalls | None:
    """What ``tools`` and ``tool_choice`` ask of the answer (``None``: text; ``parallel``: OpenAI's
    ``parallel_tool_calls``, false for one call at most; ``fmt``: the model's call format, which
    ``"auto"`` needs; ``answer``: with ``"auto"``, the JSON schema of an answer that is no call,
    OpenAI's ``response_format`` beside tools); :class:`ToolError` for a malformed tool, a choice
    naming no tool, or ``"auto"`` without a format."""
    if tools is not None and not tools:
        raise ToolError("tools is an empty list; give at least one tool, or leave tools out", "tools")
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are accepted", "tools")
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with a "
                            "name of 1 to 64 letters, digits, _ or -", "tools")
        params = fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema of an object (\"type\": "
                            f"\"object\"): a call's arguments are one, got {json.dumps(params)[:80]}", "tools")
        if name in schemas:
            raise ToolError(f"tools[{i}] is named {name!r} as an earlier tool is; give each tool its own name", "tools")
        schemas[name] = params
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise ToolError(f"tool_choice {json.dumps(choice)} needs tools", "tool_choice")
    if choice == "auto":
        if fmt is None:
            raise ToolError("tool_choice \"auto\" (the default with tools) needs the model's tool-call format, and "
                            "this server reads none: start it with --tool-call-parser "
                            f"{{{','.join(FORMATS)}}}, or send tool_choice \"required\", a function's name "
                            "({\"type\": \"function\", \"function\": {\"name\": ...}}), or \"none\"", "tool_choice",
                            unsupported=True)
        return ToolCalls(None, fmt.structure(schemas, parallel, answer), auto=fmt, schemas=schemas)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False} for n, p in schemas.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if parallel else {"maxItems": 1})}
        return ToolCalls(None, Structure("json", json.dumps(array)))
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in schemas:
        known = ", ".join(schemas)
        raise ToolError(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": "
                        f"{{\"name\": ...}}}} naming one of the tools ({known}), got {json.dumps(choice)[:80]}",
                        "tool_choice")
    return ToolCalls(name, Structure("json", json.dumps(schemas[name])))
