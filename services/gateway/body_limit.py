"""ASGI middleware: refuse request bodies over a size limit with 413, before any parsing.

A declared Content-Length over the limit is refused at once; a chunked body is counted as it
arrives. Accepted bodies are buffered (they are small by definition) and replayed to the app,
after which ``receive`` goes to the server again so disconnects are still seen.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tandem.services.gateway.errors import GatewayError, bad_request, body_too_large

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Before refusing a body, read and drop up to this much of it: a client still uploading (most
# read nothing until they have sent everything) then gets the 413 instead of a reset connection.
# The server stops handing out the body once a response is complete, so this must come first.
_DRAIN_LIMIT = 64 * 1024 * 1024


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int,
                 on_refusal: Callable[[Scope, GatewayError], None] | None = None) -> None:
        """``on_refusal``: told of each request refused here (to count and log it)."""
        self.app = app
        self.max_bytes = max_bytes
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if isinstance(declared, GatewayError):
            await self._reject(scope, send, declared)
            return
        if declared is not None and declared > self.max_bytes:
            await _drain(receive, declared)
            await self._reject(scope, send, body_too_large(self.max_bytes))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body was in
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, _DRAIN_LIMIT)
                await self._reject(scope, send, body_too_large(self.max_bytes))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _reject(self, scope: Scope, send: Send, error: GatewayError) -> None:
        if self.on_refusal is not None:
            self.on_refusal(scope, error)
        await _respond(send, error)


def _content_length(scope: Scope) -> int | GatewayError | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                length = -1
            if length < 0:
                return bad_request("Content-Length is not a valid length")
            return length
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _respond(send: Send, error: GatewayError) -> None:
    body = json.dumps(error.to_json()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _drain(receive: Receive, limit: int) -> None:
    drained = 0
    while drained <= min(limit, _DRAIN_LIMIT):
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        drained += len(message.get("body", b""))
