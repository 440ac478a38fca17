"""Tool calls in chat completions (OpenAI's ``tools`` and ``tool_choice``), made by structured
outputs: the answer is held to the JSON of the call, so it is always a well-formed call.

- ``tool_choice: {"type": "function", "function": {"name": NAME}}``: the answer is the arguments
  of NAME, held to its ``parameters`` schema; the message carries one tool call, and
  ``finish_reason`` is ``stop`` (as OpenAI answers a named function);
- ``tool_choice: "required"``: the answer is a JSON array of one or more ``{"name": ...,
  "parameters": {...}}`` (one with ``parallel_tool_calls: false``), each held to its function's
  schema; the message carries those calls, and ``finish_reason`` is ``tool_calls``;
- ``"none"`` (or no tools): text, as without tools.

``"auto"`` (OpenAI's default when tools are given) lets the model choose between text and a
call, which needs a parser of each model family's own call format; it is refused with a 400
that says what to send instead. The tools are given to the chat template (``tools``), as
transformers gives them, so a template that describes tools to the model does so.

Example::

    >>> calls = tool_calls([{"type": "function", "function": {"name": "get_weather",
    ...                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    ...                    {"type": "function", "function": {"name": "get_weather"}})
    >>> calls.structure.kind, calls.named
    ('json', 'get_weather')
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvtier.serve.structured import Structure

__all__ = ["MAX_TOOLS", "ToolCalls", "ToolError", "call_id", "tool_calls"]

#: tools one request may give
MAX_TOOLS = 128

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}}


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
    ``required``, the answer an array of calls), ``structure`` what holds the answer to it."""

    named: str | None
    structure: Structure

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The message's ``tool_calls`` from the answer's text; ``None`` where the text is not a
        whole call (an answer cut by ``max_tokens``)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        pairs = [(self.named, value)] if self.named is not None else [(c["name"], c["parameters"]) for c in value]
        return [{"id": call_id(), "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}} for name, args in pairs]


def tool_calls(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool = True) -> ToolCalls | None:
    """What ``tools`` and ``tool_choice`` ask of the answer (``None``: text; ``parallel``: OpenAI's
    ``parallel_tool_calls``, false for one call at most); :class:`ToolError` for a malformed tool,
    a choice naming no tool, or ``"auto"``."""
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
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        schemas[name] = params
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise ToolError(f"tool_choice {json.dumps(choice)} needs tools", "tool_choice")
    if choice == "auto":
        raise ToolError("tool_choice \"auto\" (the default with tools) is not supported: it needs a parser of this "
                        "model's own tool-call format; send tool_choice \"required\", a function's name "
                        "({\"type\": \"function\", \"function\": {\"name\": ...}}), or \"none\"", "tool_choice",
                        unsupported=True)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False} for n, p in schemas.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if parallel else {"maxItems": 1})}
        return ToolCalls(None, Structure("json", json.dumps(array)))
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in schemas:
        known = ", ".join(schemas)
        raise ToolError(f"tool_choice must be \"none\", \"required\" or {{\"type\": \"function\", \"function\": "
                        f"{{\"name\": ...}}}} naming one of the tools ({known}), got {json.dumps(choice)[:80]}",
                        "tool_choice")
    return ToolCalls(name, Structure("json", json.dumps(schemas[name])))
