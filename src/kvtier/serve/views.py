"""How the server writes engine outputs as OpenAI's objects: completions and chat completions,
whole or as stream chunks, their logprobs (OpenAI's and vLLM's prompt logprobs), and a chat's
tool calls."""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import replace
from typing import NamedTuple

from kvtier.serve.params import RequestOutput, TokenLogprob
from kvtier.serve.reasoning import ReasoningReader
from kvtier.serve.tools import CallReader, ToolCalls, call_id

__all__ = ["Completion", "Unscored"]


def whole_json(text: str) -> bool:
    """Whether ``text`` is one whole JSON value (a named call's arguments not cut short)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class Unscored(NamedTuple):
    """The first prompt token's entry in echoed logprobs: nothing precedes it, so no logprob."""

    token_id: int
    logprob: None = None
    top: tuple = ()


class Completion:
    """Turns engine outputs into OpenAI's completion or chat completion objects.

    ``first``: the first choice of its prompt (``usage`` counts the prompt there); ``echo``:
    the prompt's text, put before the first text given out (with ``logprobs``, the ``prompt``
    ids' logprobs, ``top`` alternatives each, before the first logprobs); ``drop``: leave out
    what was generated (``max_tokens`` 0: the prompt alone); ``scored``: vLLM's
    ``prompt_logprobs``, that many alternatives a prompt token; ``tools``: the chat's answer
    is given as tool calls (:mod:`kvtier.serve.tools`)."""

    def __init__(self, tokenizer, model: str, rid: str, chat: bool, index: int = 0, *, first: bool = True,
                 echo: str | None = None, prompt: list[int] | None = None, drop: bool = False,
                 top: int | None = None, scored: int | None = None, tools: ToolCalls | None = None,
                 reasoning: ReasoningReader | None = None):
        self.tokenizer, self.model, self.id, self.chat, self.index = tokenizer, model, rid, chat, index
        self.first, self.echo, self.prompt, self.drop = first, echo, prompt, drop
        self.top, self.scored, self.tools = top, scored, tools
        self.call_id: str | None = None  # a named call's id, once its first chunk is out
        self.held = ""  # the answer of "required" calls, streamed: given out whole at its end; a named call's so far
        self.reader = CallReader(tools.auto, tools.schemas) if tools is not None and tools.auto is not None else None
        self.reasoning = reasoning  # splits a reasoning model's answer (its content is read on as above)
        self.created = int(time.time())
        self.offset = 0  # text offset of the next token (completions' logprobs): characters so far
        self._chars = codecs.getincrementaldecoder("utf-8")(errors="replace")  # of the tokens' bytes

    def envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def _token(self, i: int) -> tuple[str, bytes]:
        """A token's text and bytes. A token holding part of a character (byte-level pieces of
        an emoji) is written ``bytes:\\xf0\\x9f``, as vLLM writes it: its bytes stay distinct
        where each such piece alone would decode to U+FFFD. An id past the tokenizer's
        vocabulary (a model's padded rows) has no text."""
        b = self.tokenizer.token_bytes(i, padded=True)
        try:
            return b.decode("utf-8"), b
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{c:02x}" for c in b), b

    def parts(self, outs: list[RequestOutput]) -> tuple[str, list | None]:
        """The text and logprob entries of ``outs`` (one output streamed, or all of them): the
        echoed prompt first, if not given out yet; nothing generated where it is dropped."""
        lp = outs[-1].logprobs is not None
        text = "" if self.drop else "".join(o.text for o in outs)
        items = None if not lp else [] if self.drop else [x for o in outs for x in o.logprobs]
        if self.echo is not None:
            text, self.echo = self.echo + text, None
            scored = outs[0].prompt_logprobs
            if items is not None and scored is not None:  # (the engine's alternatives: the most asked for)
                items = [Unscored(self.prompt[0]), *(replace(x, top=x.top[: self.top]) for x in scored[1:]), *items]
        return text, items

    def vllm_prompt_logprobs(self, scored: tuple[TokenLogprob | None, ...]) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: ``None`` for the first token, then for each a dict from token
        id (a string) to ``{"logprob", "rank", "decoded_token"}``, the prompt's token first, then
        the ``scored`` most likely (rank 1 onwards)."""
        out: list[dict | None] = [None]
        for x in scored[1:]:
            entry = {str(x.token_id): {"logprob": x.logprob, "rank": x.rank, "decoded_token": self._token(x.token_id)[0]}}
            for rank, (t, lp) in enumerate(x.top[: self.scored], start=1):
                entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": self._token(t)[0]})
            out.append(entry)
        return out

    def logprobs(self, items: list[TokenLogprob | Unscored], text: str) -> dict | None:
        if self.chat:
            def entry(t, lp):
                s, b = self._token(t)
                return {"token": s, "logprob": lp, "bytes": list(b)}
            return {"content": [{**entry(x.token_id, x.logprob),
                                 "top_logprobs": [entry(t, lp) for t, lp in x.top]} for x in items]}
        tokens, offsets = [], []
        for x in items:
            s, b = self._token(x.token_id)
            tokens.append(s)
            offsets.append(self.offset)  # the characters the tokens before it complete
            self.offset += len(self._chars.decode(b))
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in items],
                "top_logprobs": [None if x.logprob is None else {self._token(t)[0]: lp for t, lp in x.top}
                                 for x in items],
                "text_offset": offsets}

    def choice(self, text: str, finish: str | None, items, chunk: bool, split: tuple[str, str] | None = None,
               pieces: tuple[str, ...] = ()) -> dict:
        lp = None if items is None else self.logprobs(items, text)
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}
        thought = None
        if self.reasoning is not None:  # (``split``: the reasoning and content of the whole answer, read already)
            thought, text = split if split is not None else self.read(pieces or (text,), finish is not None)
        body = {"content": text} if not chunk else ({"content": text} if text else {})
        if self.tools is not None:
            body, finish = self._tool_calls(text, finish, chunk, body)
        if thought or (thought is not None and not chunk):  # (vLLM's name, and DeepSeek's older one)
            body = {**body, "reasoning": thought or None, "reasoning_content": thought or None}
            if not chunk and body.get("content") == "":
                body["content"] = None
        key = "delta" if chunk else "message"
        if not chunk:
            body = {"role": "assistant", **body}
        return {"index": self.index, key: body, "logprobs": lp, "finish_reason": finish}

    def _tool_calls(self, text: str, finish: str | None, chunk: bool, body: dict) -> tuple[dict, str | None]:
        """The message (or delta) and finish reason of an answer given as tool calls: a named call's
        arguments streamed as they come (one cut by ``max_tokens`` or a stop string stays a call, its
        arguments cut, whole or streamed, ``finish_reason`` ``length``); "required" calls held until
        the answer is whole (an array cut short stays text)."""
        if self.reader is not None:
            return self._auto(text, finish, chunk, body)
        named = self.tools.named
        if named is not None:
            self.held = self.held + text if chunk else text
            if finish == "stop" and not whole_json(self.held):  # (a stop string cut its arguments)
                finish = "length"
            if not text:
                return ({} if chunk else body), finish
            call: dict = {"index": 0, "function": {"arguments": text}}
            if self.call_id is None:
                self.call_id = call_id()
                call = {"index": 0, "id": self.call_id, "type": "function", "function": {"name": named, "arguments": text}}
            if chunk:
                return {"tool_calls": [call]}, finish
            return {"content": None, "tool_calls": [{k: v for k, v in call.items() if k != "index"}]}, finish
        if chunk:
            self.held += text
            if finish is None:
                return {}, None
            text = self.held
        calls = self.tools.calls(text) if finish == "stop" else None
        if calls is None:
            return ({"content": text} if text or not chunk else {}), finish
        if chunk:
            return {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, "tool_calls"
        return {"content": None, "tool_calls": calls}, "tool_calls"

    def _auto(self, text: str, finish: str | None, chunk: bool, body: dict) -> tuple[dict, str | None]:
        """``tool_choice: "auto"``: the text outside calls as content (streamed as it comes, but an
        end that may begin a call), each call's name once its arguments begin and the arguments as
        they come; ``finish_reason`` ``tool_calls`` where the answer ended after calls. An answer
        without calls is the text alone."""
        pieces = self.reader.feed(text, final=finish is not None)
        if finish == "stop" and self.reader.made:  # (calls cut inside their arguments by a stop string: length)
            finish = "length" if self.reader.cut else "tool_calls"
        content = "".join(p.text for p in pieces if p.kind == "text")
        calls: dict[int, dict] = {}
        for p in pieces:
            if p.kind == "call":
                calls[p.call] = {"index": p.call, "id": call_id(), "type": "function",
                                 "function": {"name": p.text, "arguments": ""}}
            elif p.kind == "arguments":
                calls.setdefault(p.call, {"index": p.call, "function": {"arguments": ""}})["function"]["arguments"] += p.text
        if chunk:
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = list(calls.values())
            return delta, finish
        if not calls:
            return body, finish
        return {"content": content.strip() or None,
                "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls.values()]}, finish

    def read(self, texts, final: bool) -> tuple[str, str]:
        """The reasoning and the content of ``texts`` (a token's text each: the reader counts the
        reasoning's tokens), fed in turn, the last ``final``."""
        read = [self.reasoning.feed(t, final=final and k == len(texts) - 1) for k, t in enumerate(texts)]
        return "".join(r for r, _ in read), "".join(c for _, c in read)

    def whole(self, outs: list[RequestOutput]) -> dict:
        """This choice, non-streaming, from every output of its request."""
        text, items = self.parts(outs)
        split = None
        if self.reasoning is not None and self.chat:  # (a token at a time: the reader counts the reasoning's)
            split = self.read([p for o in outs for p in (o.pieces or (o.text,))], True)
        body = self.choice(text, outs[-1].finish_reason, items, chunk=False, split=split)
        if self.scored is not None and not self.chat:
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(outs[0].prompt_logprobs)
        return body
