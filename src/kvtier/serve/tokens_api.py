"""vLLM's tokenizer routes beside the OpenAI ones: ``POST /tokenize``, ``POST /detokenize`` and
``GET /tokenizer_info``, so that a client can count and cut prompts with the served model's own
tokenizer (lm-evaluation-harness's ``local-completions`` finds them and needs no local copy).

Example::

    $ curl -s localhost:8000/tokenize -H 'content-type: application/json' -d '{"prompt": "Hello world"}'
    {"count":2,"max_model_len":8192,"tokens":[19556,905],"token_strs":null}
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import FastAPI

from kvtier.serve.schemas import (
    APIError,
    DetokenizeRequest,
    TokenizeRequest,
    render_chat,
)

__all__ = ["add_tokenizer_routes"]


def add_tokenizer_routes(app: FastAPI, tokenizer, max_model_len: Callable[[], int],
                         check_model: Callable[[str | None], None], encode: Callable[..., list[int]]) -> None:
    """The three routes on ``app``; ``check_model`` answers a ``model`` other than the one served,
    ``encode(text, param, add_bos=...)`` tokenizes as the generation routes do (a text over the
    context is a 400 found from its prefixes, not tokenized whole: a text of megabytes would hold
    the server for seconds)."""

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        req.check()
        if req.messages is not None:
            text = render_chat(req, tokenizer)
            special = bool(req.add_special_tokens)  # the template writes its own special tokens
        else:
            text, special = req.prompt, req.add_special_tokens is not False
        ids = await asyncio.to_thread(encode, text, "prompt" if req.messages is None else "messages",
                                      None if special else False)
        strs = [tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len(), "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        try:
            return {"prompt": tokenizer.decode(req.tokens)}
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from None

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        special = tokenizer.special_tokens
        return {"tokenizer_class": "kvtier.model.Tokenizer", "bos_token": special.get("bos_token"),
                "eos_token": special.get("eos_token"), "pad_token": special.get("pad_token"),
                "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template,
                "model_max_length": max_model_len(), "vocab_size": tokenizer.vocab_size}
