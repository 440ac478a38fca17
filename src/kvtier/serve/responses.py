"""OpenAI's Responses API beside chat completions: ``POST /v1/responses`` (whole, or streamed as
its typed events), ``GET`` and ``DELETE /v1/responses/{id}`` of stored responses.

A request is read as the chat completion it stands for and served by the chat route's engine
path, then written back in the Responses shapes:

- ``input`` (a string, or items: messages with text parts, earlier ``function_call`` and
  ``function_call_output`` items, each output answering a call of the conversation) and
  ``instructions`` become the chat's messages (instructions as the system message);
  ``previous_response_id`` puts a stored response's conversation (its input and output, not
  its instructions) before them;
- ``tools`` (``{"type": "function", "name", "parameters"}``), ``tool_choice`` and
  ``parallel_tool_calls`` become chat tools, so calls, ``"auto"`` included, are made as for
  chat (:mod:`kvtier.serve.tools`) and given as ``function_call`` output items;
- a reasoning model's reasoning (``kvtier serve --reasoning-parser``) is given as a
  ``reasoning`` output item before the message (streamed as ``response.reasoning_text``
  events); ``reasoning`` items sent back in ``input`` are left out, as chat templates leave
  earlier reasoning out;
- ``text.format`` (``json_schema``, ``json_object``) becomes ``response_format``;
  ``max_output_tokens``, ``temperature``, ``top_p`` as named.

Responses are stored (``store``, true by default, as OpenAI's) in this process's memory, the
last :data:`MAX_STORED` of them, for ``previous_response_id`` and ``GET``; a restart loses them.
``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` gives the text's logprobs
(chat's). Fields the engine cannot honour (``background``, a ``reasoning`` summary, other
``include`` values, ``truncation``
``"auto"``, non-function tools, image and file inputs) are 400s naming the field. An answer cut
by ``max_output_tokens`` is ``"incomplete"``, and so is the output item it cut.

Example::

    >>> r = client.responses.create(model=model, input="Name a colour.")   # doctest: +SKIP
    >>> r.output_text                                                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.serve.schemas import APIError, ChatCompletionRequest, validation_error

__all__ = ["MAX_STORED", "ResponsesRequest", "add_responses_routes"]

#: responses kept in memory for ``previous_response_id`` and ``GET /v1/responses/{id}``
MAX_STORED = 1024

# the chat request's fields that a Responses request names otherwise (in its 400s)
_PARAMS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
           "reasoning_effort": "reasoning.effort"}


#: the one ``include`` served: the output text's tokens' logprobs
LOGPROBS = "message.output_text.logprobs"

# a function's name, as the chat route takes it (kvtier.serve.tools)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields served; others are ignored (clients send ``user``,
    ``metadata``, ``service_tier``), but those that change the answer and are not served are 400s."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def refuse_unserved(self) -> None:
        for name, given in (("background", self.background), ("include", set(self.include or ()) - {LOGPROBS}),
                            ("reasoning", self.reasoning and any(v is not None for k, v in self.reasoning.items()
                                                                 if k != "effort")),
                            ("truncation", self.truncation == "auto")):
            if given:
                raise APIError(400, f"{name} is not supported by this server (it runs no background jobs, "
                               "writes no reasoning summaries or extra outputs, and never drops input to fit; "
                               f"reasoning.effort and include {LOGPROBS} are served)", param=name,
                               code="unsupported_parameter")
        if self.top_logprobs is not None and LOGPROBS not in (self.include or ()):
            raise APIError(400, f"top_logprobs needs include [\"{LOGPROBS}\"]", param="top_logprobs")


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined; 400 for other parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param="input")
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}.content[{k}] is a {kind!r} part; only text parts (input_text, "
                           "output_text) are served", param="input", code="unsupported_parameter")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content[{k}] is an {kind!r} part without its text: give \"text\", a "
                           f"string, got {json.dumps(part)[:80]}", param="input")
        out.append(part["text"])
    return "".join(out)


def messages_of(items: str | list[dict[str, Any]], history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive ``function_call`` items one assistant turn with
    ``tool_calls``, each ``function_call_output`` a ``tool`` message, which must answer a
    ``function_call`` of the input or of ``history`` (the previous responses' conversation), as
    OpenAI's must."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    made = {c.get("id") for m in history for c in m.get("tool_calls") or [] if isinstance(c, dict)}
    made |= {item.get("call_id") for item in items if isinstance(item, dict) and item.get("type") == "function_call"}
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            out.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":  # (an earlier answer's reasoning, sent back: chat templates leave it out)
            continue
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            if item["call_id"] not in made:
                raise APIError(400, f"No tool call found for function call output with call_id {item['call_id']!r}: "
                               f"{where}.call_id names no function_call of the input"
                               f"{' or of the previous responses' if history else ''}; send the function_call "
                               "item (call_id, name, arguments) in input before its output, or previous_response_id "
                               "of the response that made the call", param="input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, where)})
        else:
            raise APIError(400, f"{where} must be a message (role user, system, developer or assistant), a "
                           f"function_call or a function_call_output, got {json.dumps(item)[:80]}", param="input")
    if not out:
        raise APIError(400, "input holds reasoning items alone, which are left out: give a message", param="input")
    return out


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion ``req`` stands for, after ``history`` (a stored conversation)."""
    req.refuse_unserved()
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    messages += messages_of(req.input, history)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if LOGPROBS in (req.include or ()):
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if (req.reasoning or {}).get("effort") is not None:
        body["reasoning_effort"] = req.reasoning["effort"]
    shape = '{"type": "function", "name": ..., "parameters": {...}}'
    for i, tool in enumerate(req.tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"tools[{i}] must be a function tool ({{\"type\": \"function\", \"name\": ...}}); "
                           "built-in tools are not served", param="tools", code="unsupported_parameter")
        if "function" in tool and "name" not in tool:
            raise APIError(400, f"tools[{i}] is in the chat completions shape ({{\"type\": \"function\", \"function\": "
                           f"{{...}}}}), which is not the Responses one: give {shape}, the function's fields beside "
                           f"type, got {json.dumps(tool)[:80]}", param="tools")
        if not (isinstance(tool.get("name"), str) and _NAME.fullmatch(tool["name"])):
            raise APIError(400, f"tools[{i}] must be {shape} with a name of 1 to 64 letters, digits, _ or -, got "
                           f"{json.dumps(tool)[:80]}", param="tools")
        if not isinstance(tool.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].parameters must be a JSON schema object, got "
                           f"{json.dumps(tool['parameters'])[:80]}", param="tools")
    if req.tools:
        body["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                         for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        names = [t.get("name") for t in req.tools or []]
        if choice.get("name") not in names:
            raise APIError(400, f"tool_choice {json.dumps(choice)[:80]} must name one of the tools "
                           f"({', '.join(map(str, names))})", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        body["tool_choice"] = choice
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format json_schema needs schema, a JSON schema object (and a name)",
                           param="text.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    elif fmt.get("type") != "text":
        body["response_format"] = fmt
    for mine, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(req, mine) is not None:
            body[theirs] = getattr(req, mine)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # (a message's part of the input, a tool's field)
        raise _renamed(validation_error(list(e.errors()))) from None


def _renamed(e: APIError) -> APIError:
    """``e`` naming the Responses field where it named the chat field made of it."""
    head = (e.param or "").split(".", 1)[0]
    if head in _PARAMS:
        e.param = _PARAMS[head]
        e.message = e.message.replace(head, _PARAMS[head], 1)
    return e


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {
                "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


def _message(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


class _Built:
    """One response's object as it is made: ``body(status, output, usage)``."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model = req, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())

    def body(self, status: str, output: list[dict], usage: dict | None = None, finish: str | None = None) -> dict:
        r = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id, "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
                "store": r.store is not False, "temperature": r.temperature, "top_p": r.top_p,
                "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
                "tool_choice": r.tool_choice if r.tool_choice is not None else ("auto" if r.tools else "none"),
                "tools": r.tools or [], "truncation": "disabled", "usage": usage, "metadata": r.metadata or {}}


def _said(output: list[dict]) -> dict:
    """The chat message that ``output`` items write (what a stored conversation keeps)."""
    text = "".join(o["content"][0]["text"] for o in output if o["type"] == "message")
    calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
             for o in output if o["type"] == "function_call"]
    return {"content": text or None, "tool_calls": calls}


def _output(message: dict, logprobs: list[dict] | None = None, cut: bool = False) -> list[dict]:
    """A chat message as output items: its reasoning and its text (each if any, the text with
    ``logprobs``, chat's entries), then its calls; the last ``"incomplete"`` where the answer was
    ``cut`` (by ``max_output_tokens``), as OpenAI marks the item it cut."""
    items = [_reasoning(message["reasoning"])] if message.get("reasoning") else []
    if message.get("content"):
        items.append(_message(message["content"]))
        items[-1]["content"][0]["logprobs"] = logprobs or []
    items += [_call(c) for c in message.get("tool_calls") or []]
    if cut and items:
        items[-1]["status"] = "incomplete"
    return items


def add_responses_routes(app: FastAPI, chat: Callable[..., Awaitable[Any]], model_name: Callable[[], str]) -> None:
    """The routes on ``app``; ``chat(req, request, chunks=)`` serves a chat completion (whole, or
    its chunks' objects as they come)."""
    stored: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()  # id: (response, conversation)

    def keep(req: ResponsesRequest, body: dict, chat_req: ChatCompletionRequest, message: dict) -> None:
        if req.store is False or body["status"] == "failed":
            return
        turns = [m.model_dump(exclude_none=True) for m in chat_req.messages]
        if req.instructions:
            turns = turns[1:]
        said = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            said["tool_calls"] = message["tool_calls"]
        stored[body["id"]] = (body, [*turns, said])
        while len(stored) > MAX_STORED:
            stored.popitem(last=False)

    def found(rid: str, param: str = "response_id") -> tuple[dict, list[dict]]:
        if rid not in stored:
            raise APIError(404, f"no stored response has the id {rid!r} (this server keeps the last {MAX_STORED} "
                           "responses made with store, in memory)", param=param, type="not_found_error")
        return stored[rid]

    @app.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request):
        if req.previous_response_id == "":
            raise APIError(400, "previous_response_id is empty (''): give the id of a stored response (resp_...), or "
                           "leave the field out for a new conversation", param="previous_response_id")
        history = found(req.previous_response_id, "previous_response_id")[1] if req.previous_response_id else []
        chat_req = chat_request(req, history)
        built = _Built(req, model_name())
        try:
            got = await chat(chat_req, request, chunks=True)
        except APIError as e:
            raise _renamed(e) from None
        if isinstance(got, Response):  # (the client left)
            return got
        if not req.stream:
            choice = got["choices"][0]
            body = built.body("incomplete" if choice["finish_reason"] == "length" else "completed",
                              _output(choice["message"], (choice.get("logprobs") or {}).get("content"),
                                      cut=choice["finish_reason"] == "length"),
                              _usage(got["usage"]), choice["finish_reason"])
            keep(req, body, chat_req, choice["message"])
            return body
        return StreamingResponse(_events(built, got, lambda body, message: keep(req, body, chat_req, message)),
                                 media_type="text/event-stream")

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str):
        return found(rid)[0]

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str):
        found(rid)
        del stored[rid]
        return {"id": rid, "object": "response", "deleted": True}


async def _events(built: _Built, chunks: AsyncIterator[dict], done: Callable[[dict, dict], None]) -> AsyncIterator[str]:
    """The Responses stream from the chat's chunks: ``response.created`` and ``in_progress``; for
    text a message item (added, its part added, text deltas, done); for each call a
    ``function_call`` item (added, argument deltas, done); then ``response.completed`` (or
    ``incomplete`` where ``max_output_tokens`` cut it, ``failed`` where the engine failed). One
    item is open at a time: each is done before the next is added, the one open at the end
    ``"incomplete"`` where the answer was cut (or failed), else ``"completed"``."""
    seq = 0
    output: list[dict] = []
    message: dict | None = None  # the open text item
    thought: dict | None = None  # the open reasoning item
    scored: list[dict] = []  # logprobs not yet given out with text
    calls: dict[int, dict] = {}  # the open call's item by its chat tool call index (one at most)
    finish, usage = None, None

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    def close_message(status: str = "completed") -> list[str]:
        nonlocal message
        if message is None:
            return []
        i, text = output.index(message), message["content"][0]["text"]
        message["status"] = status
        part = message["content"][0]
        part["logprobs"] += scored
        scored.clear()
        message = None
        return [event("response.output_text.done", item_id=output[i]["id"], output_index=i, content_index=0,
                      text=text, logprobs=part["logprobs"]),
                event("response.content_part.done", item_id=output[i]["id"], output_index=i, content_index=0,
                      part=part),
                event("response.output_item.done", output_index=i, item=output[i])]

    def close_thought(status: str = "completed") -> list[str]:
        nonlocal thought
        if thought is None:
            return []
        i, item, thought = output.index(thought), thought, None
        item["status"] = status
        return [event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                      text=item["content"][0]["text"]),
                event("response.output_item.done", output_index=i, item=item)]

    def added(item: dict, closing: list[str]) -> list[str]:
        """``closing`` (the open items' last events), then ``item`` opened at the output's end."""
        output.append(item)
        shown = item if item["type"] == "function_call" else {**item, "content": []}
        return [*closing, event("response.output_item.added", output_index=len(output) - 1, item=shown)]

    def close_calls(status: str = "completed") -> list[str]:
        out = []
        for item in calls.values():
            i = output.index(item)
            item["status"] = status
            out += [event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                          arguments=item["arguments"]),
                    event("response.output_item.done", output_index=i, item=item)]
        calls.clear()
        return out

    yield event("response.created", response=built.body("in_progress", []))
    yield event("response.in_progress", response=built.body("in_progress", []))
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if "error" in chunk:
                for e in close_thought("incomplete") + close_message("incomplete") + close_calls("incomplete"):
                    yield e
                yield event("response.failed", response={**built.body("failed", output), "error": {
                    "code": chunk["error"].get("code") or "server_error", "message": chunk["error"]["message"]}})
                return
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                scored += (choice.get("logprobs") or {}).get("content") or []
                if delta.get("reasoning"):
                    if thought is None:
                        closing = close_message() + close_calls()
                        thought = _reasoning("", "in_progress")
                        for e in added(thought, closing):
                            yield e
                    thought["content"][0]["text"] += delta["reasoning"]
                    yield event("response.reasoning_text.delta", item_id=thought["id"], output_index=output.index(thought),
                                content_index=0, delta=delta["reasoning"])
                if delta.get("content"):
                    if message is None:
                        closing = close_thought() + close_calls()
                        message = _message("", "in_progress")
                        for e in added(message, closing):
                            yield e
                        yield event("response.content_part.added", item_id=message["id"], output_index=len(output) - 1,
                                    content_index=0, part={**message["content"][0]})
                    message["content"][0]["text"] += delta["content"]
                    message["content"][0]["logprobs"] += scored
                    yield event("response.output_text.delta", item_id=message["id"], output_index=output.index(message),
                                content_index=0, delta=delta["content"], logprobs=list(scored))
                    scored.clear()
                for tc in delta.get("tool_calls") or []:
                    if tc.get("id"):  # a new call: the open item (an earlier call's too) done first
                        closing = close_thought() + close_message() + close_calls()
                        call = {"id": tc["id"], "type": "function",
                                "function": {"name": tc["function"]["name"], "arguments": ""}}
                        calls[tc["index"]] = _call(call, "in_progress")
                        for e in added(calls[tc["index"]], closing):
                            yield e
                    args = tc["function"].get("arguments") or ""
                    if args and tc["index"] in calls:
                        item = calls[tc["index"]]
                        item["arguments"] += args
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=output.index(item), delta=args)
                finish = choice["finish_reason"] or finish
    status = "incomplete" if finish == "length" else "completed"
    for e in close_thought(status) + close_message(status) + close_calls(status):
        yield e
    body = built.body(status, output, _usage(usage), finish)
    done(body, _said(output))
    yield event(f"response.{status}", response=body)
