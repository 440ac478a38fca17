"""The OpenAI request bodies the server accepts (pydantic), and their translation to
:class:`~kvtier.serve.params.RequestParams`.

Fields follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, with vLLM's
extensions ``top_k``, ``min_p`` and ``ignore_eos``. Fields the engine cannot honour
(``n > 1``, ``best_of > 1``, ``echo``, ``suffix``, penalties, ``logit_bias``,
``tools``) are refused with a 400 naming the field, never silently ignored. Unknown
fields are ignored, as OpenAI's clients send some (``user``, ``metadata``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.sampling import SamplingParams
from kvtier.serve.params import MAX_LOGPROBS, RequestParams

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "chat_messages", "request_params"]


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


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def check_supported(self) -> None:
        """400 for a field the engine cannot honour."""
        refused = (("n", self.n != 1, "n > 1 is not supported; send n requests (with different seeds)"),
                   ("presence_penalty", self.presence_penalty != 0, "penalties are not supported"),
                   ("frequency_penalty", self.frequency_penalty != 0, "penalties are not supported"),
                   ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"))
        for param, bad, message in refused:
            if bad:
                raise APIError(400, message, param=param, code="unsupported_parameter")


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for param, bad in (("echo", self.echo), ("best_of", (self.best_of or 1) != 1),
                           ("suffix", self.suffix is not None)):
            if bad:
                raise APIError(400, f"{param} is not supported", param=param, code="unsupported_parameter")

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a list of one prompt is taken apart); 400 for a batch."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise APIError(400, f"{len(p)} prompts in one request are not supported; send one "
                               "request per prompt", param="prompt", code="unsupported_parameter")
            p = p[0]
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools", code="unsupported_parameter")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them (text parts joined; ``developer`` is ``system``)."""
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def request_params(req: CompletionRequest | ChatCompletionRequest) -> RequestParams:
    """The engine's parameters of a request; 400 for values the sampler refuses."""
    req.check_supported()
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
    try:
        sampling = SamplingParams(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                                  min_p=req.min_p, seed=req.seed)
        return RequestParams(max_tokens=max_tokens, sampling=sampling, stop=stop,
                             ignore_eos=req.ignore_eos, logprobs=logprobs)
    except ValueError as e:  # the dataclasses' messages start with the field's name
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
