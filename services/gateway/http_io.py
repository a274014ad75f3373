"""The gateway's HTTP plumbing around its routes: the SSE response of a streamed generation
(what happens to a client that stops reading), and the request body limit (below).

uvicorn's ``send`` waits while the connection's write buffer is above its high-water mark
(64 KiB), so a client that stops reading stops this response from pulling the next delta: what
is buffered for one stream is that buffer plus what the workers produce meanwhile. A client
that has read nothing for ``read_timeout_s`` is cut: its request is aborted on every worker
(blocks freed), counted (``tandem_request_failures_total{reason="slow_client"}``), logged once,
and its connection dropped by ``abort_connection`` (which the server that owns the socket
supplies; without one the response just ends and the server closes the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.services.gateway.core import Choices
from tandem.services.gateway.errors import GatewayError, bad_request, body_too_large
from tandem.services.gateway.openai_format import SSE_DONE, sse

log = logging.getLogger(__name__)

AbortConnection = Callable[[Scope], None]  # drop the connection that carries this request


class EventStream(StreamingResponse):
    def __init__(self, generation: Choices, events: AsyncGenerator[bytes, None],
                 read_timeout_s: float | None, abort_connection: AbortConnection | None) -> None:
        # The background task closes the generation even when the client leaves before the
        # body iterator ever starts (then ``_guarded``'s own cleanup never runs).
        self._chunks = _guarded(generation, events)
        super().__init__(self._chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                         background=BackgroundTask(generation.aclose))
        self.generation = generation
        self.read_timeout_s = read_timeout_s
        self.abort_connection = abort_connection
        self._scope: Scope | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async with contextlib.aclosing(self._chunks):
            async for chunk in self._chunks:
                try:
                    async with asyncio.timeout(self.read_timeout_s):
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                except TimeoutError:
                    assert self.read_timeout_s is not None
                    await self.generation.cut_slow_client(self.read_timeout_s)
                    if self.abort_connection is not None and self._scope is not None:
                        self.abort_connection(self._scope)
                        # The transport reports the lost connection on the loop's next turn;
                        # let it, so that the server sees a disconnect and not a half response.
                        await asyncio.sleep(0)
                    return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _guarded(generation: Choices, events: AsyncGenerator[bytes, None]
                   ) -> AsyncGenerator[bytes, None]:
    """Close the generation however the stream ends (done, failed, client gone); a failure after
    the headers went out becomes an SSE error event, as OpenAI-compatible servers send."""
    try:
        async with contextlib.aclosing(events):
            async for chunk in events:
                yield chunk
    except Exception as exc:
        if isinstance(exc, GatewayError):
            error = exc
        else:
            log.exception("stream failed", exc_info=exc)
            error = GatewayError(500, "Internal server error.", type="server_error")
        yield sse(error.to_json())
        yield SSE_DONE
    finally:
        await generation.aclose()


# -- Request body limit ------------------------------------------------------------------------
# ASGI middleware: refuse request bodies over a size limit with 413, before any parsing. A
# declared Content-Length over the limit is refused at once; a chunked body is counted as it
# arrives. Accepted bodies are buffered (they are small by definition) and replayed to the app,
# after which ``receive`` goes to the server again so disconnects are still seen.


Message = MutableMapping[str, Any]
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


# ASGI middleware: a request's ``X-Request-Id`` (visible ASCII, at most 128 characters) comes
# back on its response, refusals and errors included, so a client or proxy can match them; the
# server's own request ids stay its own (a client's id is never a key).
_MAX_REQUEST_ID = 128


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = next((value for name, value in scope.get("headers", ())
                      if name == b"x-request-id"), None) if scope["type"] == "http" else None
        if not given or len(given) > _MAX_REQUEST_ID or not all(33 <= b < 127 for b in given):
            await self.app(scope, receive, send)
            return

        async def echo(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, echo)


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


# -- Connection deadlines ----------------------------------------------------------------------
# uvicorn times out only an idle keep-alive connection: one that never finishes its headers,
# or announces a body and trickles it, would hold its connection (and its buffered bytes) for
# ever. These deadlines close it, with 408 when no response started.

_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                     b"content-length: 28\r\nconnection: close\r\n\r\n"
                     b"request not received in time")


def deadline_protocol(header_timeout_s: float, body_timeout_s: float,
                      on_cut: Callable[[str], None]) -> type:
    """uvicorn's httptools protocol with a deadline on each request's headers (from the
    connection's opening, then from each request's first byte) and on its body (from the end
    of its headers); ``on_cut(reason)`` counts each connection cut (header_timeout,
    body_timeout)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class DeadlineProtocol(HttpToolsProtocol):  # type: ignore[misc]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # noqa: ANN401
            super().connection_made(transport)
            self._arm(header_timeout_s, "header_timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm(header_timeout_s, "header_timeout")

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(body_timeout_s, "body_timeout")

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self, timeout_s: float, reason: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._cut, reason)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _cut(self, reason: str) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            cycle = getattr(self, "cycle", None)
            if cycle is None or not cycle.response_started:
                self.transport.write(_TIMEOUT_RESPONSE)
            log.info("connection from %s cut: %s", self.client, reason.replace("_", " "))
            on_cut(reason)
            self.transport.close()

    return DeadlineProtocol
