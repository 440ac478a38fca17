"""ASGI middleware of the HTTP layer: the request body's size limit and the API keys.

Both answer in OpenAI's error shape before any route runs: :class:`BodyLimit` a 413 (by
``Content-Length`` before any of the body is read, else as it arrives), :class:`ApiKeys` a 401
with ``code: invalid_api_key`` (the official clients raise ``AuthenticationError``) for a
request whose ``Authorization: Bearer ...`` is not one of the server's keys.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["OPEN_PATHS", "ApiKeys", "BodyLimit", "unread_body"]

#: what answers without a key: probes and scrapers, which send none
OPEN_PATHS = ("/health", "/metrics")


class BodyLimit:
    """A request body over ``limit`` bytes raises ``HTTPException(413)``, which the app's handler
    answers in OpenAI's shape. FastAPI's own ``max_body_size`` answers a declared length with
    plain text, hence this."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        counted = not declared.isdigit()  # no (usable) Content-Length: count what arrives
        received = 0 if counted else int(declared)

        async def limited():
            nonlocal received
            if received > self.limit:
                raise HTTPException(413, "request body too large")  # answered by build_app's handler
            message = await receive()
            if counted and message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    return await limited()
            return message

        await self.app(scope, limited, send)


class ApiKeys:
    """Every path but :data:`OPEN_PATHS` needs ``Authorization: Bearer <key>`` with one of
    ``keys`` (compared in constant time); otherwise a 401, counted by ``rejected(401)``."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], rejected: Callable[[int], None]):
        self.app, self.rejected = app, rejected
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        # (every key compared, so the time taken does not tell which one came close)
        if scheme.lower() == b"bearer" and sum(hmac.compare_digest(token.strip(), k) for k in self.keys):
            return await self.app(scope, receive, send)
        self.rejected(401)
        message = ("no API key given: send the header 'Authorization: Bearer <key>' (the openai client's "
                   "api_key)" if not given else "the API key given is not one of this server's keys")
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": "invalid_api_key"}}
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def unread_body(e: HTTPException) -> str:
    """FastAPI's "There was an error parsing the body" said plainly from its cause (a body not
    UTF-8, JSON nested past what the parser follows); other details as they are."""
    cause = e.__cause__
    if e.detail != "There was an error parsing the body" or cause is None:
        return str(e.detail)
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not UTF-8 text (byte {cause.object[cause.start]:#04x} at offset "
                f"{cause.start}); send the JSON encoded in UTF-8")
    if isinstance(cause, RecursionError):
        return "the request body's JSON nests deeper than the server reads; send a flatter body"
    return f"the request body could not be read as JSON ({type(cause).__name__}: {cause})"
