"""The OpenAI request bodies the server accepts (pydantic), and their translation to
:class:`~kvtier.serve.params.RequestParams`.

Fields follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, with vLLM's
extensions ``top_k``, ``min_p``, ``ignore_eos``, ``repetition_penalty``, ``min_tokens``,
``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words`` (at most
:data:`MAX_BAD_WORDS`, each spelled as it is and after a space), ``guided_choice`` (or, as
vLLM 0.12 names it, ``structured_outputs: {"choice": [...]}``; each choice
spelled in the tokens the tokenizer gives it), ``truncate_prompt_tokens`` (the prompt's last
tokens) and ``prompt_logprobs`` (not streamed); OpenAI's
``presence_penalty``, ``frequency_penalty`` and ``logit_bias``; ``n`` (at most :data:`MAX_CHOICES`)
asks for that many choices of each prompt; ``/v1/completions`` takes a batch of prompts (at
most :data:`MAX_PROMPTS`) and ``echo`` (the prompt before the completion, and with
``logprobs`` the prompt tokens' logprobs; ``max_tokens: 0`` with ``echo`` scores the prompt
alone), and ``best_of`` (that many completions, the ``n`` of highest mean token logprob
returned; not streamed). Structured outputs (one a request): OpenAI's ``response_format``
(``json_object``, ``json_schema``), vLLM's ``guided_json``, ``guided_regex``, ``guided_grammar``
and ``structured_outputs`` (``json``, ``regex``, ``grammar``, ``json_object``, ``choice``).
Chat's ``tools`` with ``tool_choice`` ``"required"`` or a named function give tool calls
(:mod:`kvtier.serve.tools`). Fields the engine cannot honour (``suffix``, ``tool_choice``
``"auto"``, ``functions``) are refused with a 400 naming the field, never silently ignored. Unknown fields are
ignored, as OpenAI's clients send some (``user``, ``metadata``).

Types are strict: ``true`` is not an integer, ``3.0`` is not a token count, ``"yes"``
is not a boolean and ``"0.5"`` is not a number. ``stop`` holds at most
:data:`MAX_STOP_STRINGS` strings of :data:`MAX_STOP_CHARS` characters in all (each is
checked against the text at every token).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator

from kvtier.model.tokenizer import NoChatTemplate
from kvtier.sampling import SamplingParams
from kvtier.serve.params import MAX_BAD_WORD_TOKENS, MAX_GUIDED_CHOICES, MAX_LOGPROBS, RequestParams
from kvtier.serve.structured import Structure, named, structural_tag
from kvtier.serve.tools import (
    CallFormat,
    ToolCalls,
    ToolError,
    chat_messages,
    check_messages,
    tool_calls,
)

__all__ = ["MAX_BAD_WORDS", "MAX_CHOICES", "MAX_WORDS_CHARS", "MAX_LOGIT_BIAS", "MAX_PROMPTS", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "NO_TEMPLATE", "APIError", "ChatCompletionRequest", "CompletionRequest",
           "DetokenizeRequest", "TokenizeRequest", "render_chat", "request_params", "structure", "validation_error"]

#: tokens one request's ``logit_bias`` may name
MAX_LOGIT_BIAS = 1024

#: the 400 of chat messages sent to a model without a chat template
NO_TEMPLATE = ("this model has no chat template: send the text to /v1/completions, or start the server with "
               "--chat-template FILE")

#: words one request's ``bad_words`` may hold
MAX_BAD_WORDS = 256

#: characters of ``bad_words`` and of ``guided_choice`` in all, checked before any is tokenized
MAX_WORDS_CHARS = 65536

#: choices one request may ask for (``n``; OpenAI's limit)
MAX_CHOICES = 128

#: prompts one ``/v1/completions`` request may hold (OpenAI's limit)
MAX_PROMPTS = 2048

#: stop strings one request may give, and their characters in all
MAX_STOP_STRINGS, MAX_STOP_CHARS = 128, 4096

#: vLLM's request fields the engine does not honour: given (not null or false), each is a 400
VLLM_REFUSED = ("use_beam_search",)

#: of vLLM's ``structured_outputs``, the constraints served (any other key given is a 400)
STRUCTURED_OUTPUTS = ("json", "regex", "grammar", "json_object", "structural_tag", "choice")

#: fields OpenAI's reference types "... or null": null takes the field's default
NULL_IS_DEFAULT = ("temperature", "top_p", "top_k", "min_p", "n", "stream", "ignore_eos", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "include_stop_str_in_output",
                   "echo", "logprobs", "max_tokens")

#: what a field of several accepted shapes takes, for the 400 when none of them fits
_SHAPES = {
    "prompt": "a string, a list of token ids, or a list holding one of those",
    "stop": "a string or a list of strings",
    "content": "a string, null, or a list of text parts ({\"type\": \"text\", \"text\": ...}); "
               "images and other parts are not supported",
}


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def validation_error(errors: list[dict[str, Any]], content_type: str | None = None) -> APIError:
    """The 400 for pydantic's ``errors`` of a request body (FastAPI's ``RequestValidationError``): the
    first error, its field as ``param``; a field of several shapes (``prompt``, ``stop``, ``content``)
    says which shapes it takes; a body not read as JSON names its ``content_type``."""
    first = errors[0] if errors else {}
    loc = [x for x in first.get("loc", ()) if x != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        where = f" at character {loc[0]}" if loc else ""
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        return APIError(400, f"the request body is not valid JSON ({reason}{where})")
    if not loc and content_type and "json" not in content_type.lower() and kind != "missing":
        return APIError(400, f"the request's Content-Type is {content_type!r}, so its body was not read as JSON; "
                             "send it with Content-Type: application/json")
    if not loc:
        what = "empty" if kind == "missing" else "not a JSON object"
        return APIError(400, f"the request body is {what}; send a JSON object with content-type "
                             "application/json")
    fields = []
    for x in loc:  # a union's members appear in loc as their types ("str", "list[int]", ...)
        if isinstance(x, str) and (x in ("str", "int", "float", "bool", "none") or "[" in x):
            break
        fields.append(str(x))
    param = ".".join(fields)
    if len(fields) < len(loc) and fields[-1] in _SHAPES:
        return APIError(400, f"{param} must be {_SHAPES[fields[-1]]}", param=param)
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: each chunk carries its choice's usage so far


class _Common(BaseModel):
    """Fields both endpoints share."""

    # NaN and infinities (JSON that Python's parser takes) are refused as not finite
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions: stop_token_ids, include_stop_str_in_output, allowed_token_ids, bad_words, the guided_*
    # constraints, truncate_prompt_tokens and prompt_logprobs are served; use_beam_search is refused, never ignored
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_STRINGS)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_GUIDED_CHOICES)
    structured_outputs: dict[str, Any] | None = None  # vLLM >= 0.12's name for the guided_* fields
    guided_grammar: Any = None
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object, json_schema
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: keep the prompt's last tokens
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    priority: int = Field(0, ge=-2**31, lt=2**31)  # vLLM's: lower first under --scheduling-policy priority
    use_beam_search: Any = None

    @field_validator(*NULL_IS_DEFAULT, mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's reference types these fields "or null", null meaning the default (the
        official client sends null for a None argument)."""
        return cls.model_fields[info.field_name].get_default() if value is None else value

    def check_supported(self) -> None:
        """400 for a field the engine cannot honour, or a stop list beyond the bounds."""
        refused = tuple((name, getattr(self, name) not in (None, False), f"{name} is not supported")
                        for name in VLLM_REFUSED)
        for param, bad, message in refused:
            if bad:
                raise APIError(400, message, param=param, code="unsupported_parameter")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs is not streamed; send stream: false (or, for completions, "
                           "echo: true with logprobs, which streams the prompt's logprobs first)",
                           param="prompt_logprobs")
        self._structured_choice()
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens 0 would leave no prompt; keep at least 1 token (or -1: "
                           "what the context leaves)", param="truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if "" in stop:
            raise APIError(400, "stop holds an empty string, which no text can be cut at; drop it", param="stop")
        for s in stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone UTF-16 surrogate: no text can ever hold it
                raise APIError(400, f"stop holds {s[e.start]!r}, a lone UTF-16 surrogate that is not "
                               "valid Unicode; send the whole pair", param="stop") from None
        chars = sum(map(len, stop))
        if len(stop) > MAX_STOP_STRINGS or chars > MAX_STOP_CHARS:
            raise APIError(400, f"stop holds {len(stop)} strings of {chars} characters in all; at most "
                           f"{MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters are accepted",
                           param="stop")

    def _structured_choice(self) -> None:
        """``structured_outputs: {"choice": [...]}`` taken as ``guided_choice``; 400 for a key not
        served, a choice that is not a list of strings, or both names."""
        so = {k: v for k, v in (self.structured_outputs or {}).items() if v not in (None, False)}
        other = sorted(set(so) - set(STRUCTURED_OUTPUTS))
        if other:
            raise APIError(400, f"structured_outputs.{other[0]} is not supported (of structured_outputs, "
                           f"{', '.join(STRUCTURED_OUTPUTS)} are)", param="structured_outputs",
                           code="unsupported_parameter")
        if "choice" in so:
            choice = so["choice"]
            if not (isinstance(choice, list) and 1 <= len(choice) <= MAX_GUIDED_CHOICES
                    and all(isinstance(c, str) for c in choice)):
                raise APIError(400, f"structured_outputs.choice must be a list of 1 to {MAX_GUIDED_CHOICES} "
                               "strings", param="structured_outputs")
            if self.guided_choice is not None and self.guided_choice is not choice:
                raise APIError(400, "give guided_choice or structured_outputs.choice, not both",
                               param="structured_outputs")
            self.guided_choice = choice


class CompletionRequest(_Common):
    """``POST /v1/completions``: a prompt (text or token ids) or a batch of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # null: 16, OpenAI's default here (not the rest of the context); 0 only with echo
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of {self.best_of} is below n {self.n}: best_of completions are made and "
                           "the n best returned; ask for best_of >= n", param="best_of")
        if (self.best_of or 1) > self.n and self.stream:
            raise APIError(400, "best_of is not streamed (the best are known once all are done); send stream: "
                           "false", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 generates nothing: ask for at least 1 token, or for echo: true "
                           "to have the prompt (and with logprobs its tokens' logprobs) alone",
                           param="max_tokens")

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or each of a batch (at most :data:`MAX_PROMPTS`); 400 for an empty one."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        if len(batch) > MAX_PROMPTS:
            raise APIError(400, f"{len(batch)} prompts in one request; at most {MAX_PROMPTS} are accepted",
                           param="prompt")
        for i, one in enumerate(batch):
            if not one:
                where = "" if len(batch) == 1 else f" (prompt {i} of the batch)"
                raise APIError(400, f"the prompt is empty{where}", param="prompt")
        return batch


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    # a conversation's earlier tool calls and their results, given to the chat template as they are
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    # vLLM's: how the chat template renders the messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's, given to the chat template as ``reasoning_effort`` (as vLLM gives it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # the server's: the model's tool-call format (``"auto"`` needs one), and whether its chat
    # template ignores tools, so they are described in a system message (kvtier.serve.tools)
    _calls: CallFormat | None = PrivateAttr(None)
    _describe: bool = PrivateAttr(False)

    def served(self, fmt: CallFormat | None, describe: bool) -> ChatCompletionRequest:
        """This request, read with the server's tool-call format (``describe``: its template
        ignores tools)."""
        self._calls, self._describe = fmt, describe
        return self

    def check_supported(self) -> None:
        super().check_supported()
        if self.functions:
            raise APIError(400, "functions is not supported (OpenAI's older name: send tools and tool_choice)",
                           param="functions", code="unsupported_parameter")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        try:
            check_messages(self.messages)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        self.tool_calls()

    def tool_calls(self, answer: dict[str, Any] | None = None) -> ToolCalls | None:
        """How the answer becomes tool calls (``None``: text; ``answer``: the JSON schema of an
        answer that is no call); 400 for tools or a tool_choice not served."""
        try:
            return tool_calls(self.tools, self.tool_choice, self.parallel_tool_calls is not False, self._calls, answer)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param, code="unsupported_parameter" if e.unsupported else None) from None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` rendered with the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give a prompt or messages to tokenize (one of them)", param="prompt")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids to text."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


def render_chat(req: ChatCompletionRequest | TokenizeRequest, tokenizer) -> str:
    """The request's messages rendered with the chat template (text parts joined; ``developer`` is
    ``system``), with vLLM's ``add_generation_prompt``, ``continue_final_message`` (the text ends
    with the last assistant message's, which the answer continues) and ``chat_template_kwargs``
    (given to the template, as ``enable_thinking``); 400 where the model has no template or the
    template refuses them."""
    cont, extra = req.continue_final_message, dict(req.chat_template_kwargs or {})
    if cont and req.add_generation_prompt:
        raise APIError(400, "continue_final_message continues the last message and add_generation_prompt starts a "
                       "new one: send add_generation_prompt false with it", param="continue_final_message")
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content,
                         **{k: v for k in ("tool_calls", "tool_call_id", "name") if (v := getattr(m, k)) is not None}})
    final_role, final_text = req.messages[-1].role, messages[-1]["content"].strip()
    if cont and (final_role != "assistant" or not final_text):
        got = f"the last is a {final_role!r} message" if final_role != "assistant" else "the last has no text"
        raise APIError(400, "continue_final_message continues the last message, which must be an assistant's with "
                       f"text ({got})", param="continue_final_message")
    clash = sorted({"messages", "add_generation_prompt", "tools", "raise_exception", "strftime_now",
                    *getattr(tokenizer, "special_tokens", {})} & set(extra))
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)}: the server sets it (the request's "
                       "own fields, or the model's special tokens)", param="chat_template_kwargs")
    if getattr(req, "reasoning_effort", None) is not None:
        extra["reasoning_effort"] = req.reasoning_effort
    tools = {"tools": req.tools} if getattr(req, "tools", None) else {}
    if isinstance(req, ChatCompletionRequest) and req._describe:  # a template that ignores tools
        messages = chat_messages(messages, req.tools or [], req._calls, describe=req.tool_choice != "none")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **extra, **tools)
    except NoChatTemplate:
        raise APIError(400, NO_TEMPLATE, param="messages") from None
    except (jinja2.TemplateError, ValueError, TypeError) as e:  # (TypeError: a value the template cannot take)
        raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None
    if not cont:
        return text
    at = text.rfind(final_text)
    if at < 0:
        raise APIError(400, "continue_final_message: the chat template does not write the last message's text as "
                       "given, so the answer cannot continue it", param="continue_final_message")
    return text[:at + len(final_text)]


def logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as strings, biases in [-100, 100]) as pairs; 400 for a
    key that is not a token id, a bias out of range, or more than :data:`MAX_LOGIT_BIAS` entries."""
    raw = raw or {}
    if len(raw) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias holds {len(raw)} tokens; at most {MAX_LOGIT_BIAS} are accepted",
                       param="logit_bias")
    pairs = []
    for key, bias in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias keys are token ids written as strings of digits, got {key!r}",
                           param="logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise APIError(400, f"logit_bias of token {key} is {bias!r}; a bias must be in [-100, 100]",
                           param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _short(text: str, n: int = 40) -> str:
    """``text`` quoted for a message, cut to its first ``n`` characters."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


def _bounded(texts: list[str] | None, param: str) -> None:
    chars = sum(map(len, texts or ()))
    if chars > MAX_WORDS_CHARS:
        raise APIError(400, f"{param} holds {chars} characters in all; at most {MAX_WORDS_CHARS} are accepted",
                       param=param)


def bad_words(words: list[str] | None, tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as the token sequences the engine bans: each word (leading spaces
    dropped) as it is and after a space, the text's start and its middle; 400 for an empty
    word or one of more than :data:`~kvtier.serve.params.MAX_BAD_WORD_TOKENS` tokens."""
    _bounded(words, "bad_words")
    out: dict[tuple[int, ...], None] = {}
    for word in words or ():
        bare = word.lstrip()
        if not bare:
            raise APIError(400, f"bad_words holds {_short(word)}, which has nothing but spaces", param="bad_words")
        for spelling in (bare, " " + bare):
            try:
                ids = tuple(tokenizer.encode(spelling, add_bos=False))
            except ValueError:  # (a lone UTF-16 surrogate)
                raise APIError(400, f"bad_words holds {_short(word)}, which is not valid Unicode (a lone UTF-16 "
                               "surrogate)", param="bad_words") from None
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise APIError(400, f"bad_words holds {_short(word)}, {len(ids)} tokens as {_short(spelling)}; a "
                               f"word of at most {MAX_BAD_WORD_TOKENS} tokens is accepted", param="bad_words")
            out[ids] = None
    return tuple(out)


def guided_choice(choices: list[str] | None, tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``guided_choice`` as the token sequences the engine allows (each choice as the
    tokenizer spells it, no BOS); 400 for an empty choice."""
    _bounded(choices, "guided_choice")
    out: dict[tuple[int, ...], None] = {}
    for choice in choices or ():
        try:
            ids = tuple(tokenizer.encode(choice, add_bos=False))
        except ValueError:  # (a lone UTF-16 surrogate)
            ids = ()
        if not ids:
            raise APIError(400, f"guided_choice holds {_short(choice)}, which is no text (empty, or not valid "
                           "Unicode)", param="guided_choice")
        out[ids] = None
    return tuple(out)


def structure(req: CompletionRequest | ChatCompletionRequest) -> tuple[Structure | None, str | None]:
    """The request's structured output (``None`` for free text) and the field that asked for it;
    400 for a constraint of the wrong shape, or for more than one (``guided_choice`` included)."""
    rf = req.response_format or {}
    kind = rf.get("type", "text")
    if kind not in ("text", "json_object", "json_schema", "structural_tag"):
        raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, json_schema and "
                       "structural_tag are)", param="response_format", code="unsupported_parameter")
    schema = rf.get("json_schema") if kind == "json_schema" else None
    if kind == "json_schema" and not (isinstance(schema, dict) and isinstance(schema.get("schema"), dict)):
        raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                       param="response_format")
    so = {k: v for k, v in (req.structured_outputs or {}).items() if v not in (None, False)}
    calls = req.tool_calls() if isinstance(req, ChatCompletionRequest) else None
    given = [(name, kind_, value) for name, kind_, value in (
        ("response_format", "json_object", {} if kind == "json_object" else None),
        ("response_format", "json", schema["schema"] if schema else None),
        ("guided_json", "json", req.guided_json), ("guided_regex", "regex", req.guided_regex),
        ("guided_grammar", "grammar", req.guided_grammar), ("structured_outputs", "json", so.get("json")),
        ("structured_outputs", "regex", so.get("regex")), ("structured_outputs", "grammar", so.get("grammar")),
        ("structured_outputs", "json_object", so.get("json_object")),
        ("response_format", "structural_tag", {k: v for k, v in rf.items() if k != "type"}
         if kind == "structural_tag" else None),
        ("structured_outputs", "structural_tag", so.get("structural_tag")),
        ("tool_choice", "tools", calls.structure if calls else None),
        ("guided_choice", "choice", req.guided_choice)) if value is not None]
    if (calls is not None and calls.auto is not None and kind in ("json_object", "json_schema")
            and [g[0] for g in given] == ["response_format", "tool_choice"]):
        # "auto" beside a response_format: the answer is JSON held to it, or calls
        return req.tool_calls(answer=schema["schema"] if schema else {"type": "object"}).structure, "tool_choice"
    if len(given) > 1:
        why = ("; tool calls are one (with tool_choice \"auto\", the default with tools, only response_format "
               f"may join them): send tool_choice \"none\" for an answer held to {given[0][0]}"
               if given[1][0] == "tool_choice" else "")
        (a, ka, _), (b, kb, _) = given[:2]  # structured_outputs' keys by name: .regex, .json, ...
        a, b = (f"{n}.{k}" if n == "structured_outputs" else n for n, k in ((a, ka), (b, kb)))
        raise APIError(400, f"give one structured output, not {a} and {b}{why}", param=given[1][0])
    if not given or given[0][1] == "choice":
        return None, None
    param, kind, value = given[0]
    if kind == "json_object":
        if value is not True and param == "structured_outputs":
            raise APIError(400, "structured_outputs.json_object must be true", param=param)
        return Structure("json_object"), param
    if isinstance(value, Structure):  # (tool calls': made by kvtier.serve.tools)
        return value, param
    if kind == "structural_tag":
        try:  # (vLLM's structured_outputs.structural_tag: the tag as JSON text)
            return structural_tag(json.loads(value) if isinstance(value, str) else value), param
        except (ValueError, json.JSONDecodeError) as e:
            raise APIError(400, named(f"structure structural_tag: the structural tag is not JSON: {e}"
                                      if isinstance(e, json.JSONDecodeError)
                                      else str(e), param), param=param) from None
    if kind == "json" and isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str) or not value:
        what = "a JSON schema (an object, or its JSON text)" if kind == "json" else f"a {kind} as a non-empty string"
        raise APIError(400, f"{param} must be {what}", param=param)
    try:
        return Structure(kind, value), param
    except ValueError as e:
        raise APIError(400, named(str(e), param), param=param) from None


def request_params(req: CompletionRequest | ChatCompletionRequest, tokenizer=None) -> RequestParams:
    """The engine's parameters of a request; 400 for values the sampler refuses. ``tokenizer``
    spells ``bad_words`` as tokens (a request with bad words needs one)."""
    req.check_supported()
    for name in ("bad_words", "guided_choice"):
        if getattr(req, name) and tokenizer is None:
            raise APIError(400, f"{name} needs the model's tokenizer, and this server has none", param=name)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    structured, structured_param = structure(req)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
    # echo with logprobs: the prompt's tokens' too (the larger count where prompt_logprobs asks as well)
    asked = [k for k in (logprobs if getattr(req, "echo", False) else None, req.prompt_logprobs) if k is not None]
    prompt_logprobs, stop_ids, ignore_eos = max(asked, default=None), tuple(req.stop_token_ids or ()), req.ignore_eos
    if max_tokens == 0:  # one token run, which the answer drops: it ends by length, whatever it draws
        max_tokens, stop, stop_ids, ignore_eos = 1, (), (), True
    try:
        sampling = SamplingParams(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                                  min_p=req.min_p, seed=req.seed)
        return RequestParams(max_tokens=max_tokens, sampling=sampling, stop=stop,
                             stop_token_ids=stop_ids, ignore_eos=ignore_eos,
                             logprobs=logprobs, presence_penalty=req.presence_penalty,
                             frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                             logit_bias=logit_bias(req.logit_bias), min_tokens=req.min_tokens,
                             prompt_logprobs=prompt_logprobs,
                             include_stop_str_in_output=req.include_stop_str_in_output,
                             allowed_token_ids=tuple(req.allowed_token_ids or ()),
                             bad_words=bad_words(req.bad_words, tokenizer),
                             guided_choice=guided_choice(req.guided_choice, tokenizer),
                             structure=structured, priority=req.priority)
    except ValueError as e:  # the dataclasses' messages start with the field's name
        field = str(e).split(" ", 1)[0]
        if field == "structure":
            raise APIError(400, named(str(e), structured_param), param=structured_param) from None
        raise APIError(400, str(e), param=field) from None
