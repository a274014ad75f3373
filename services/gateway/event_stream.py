"""The SSE response of a streamed generation, and what happens to a client that stops reading.

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
import logging
from collections.abc import AsyncGenerator, Callable

from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.services.gateway.choices import Choices
from tandem.services.gateway.errors import GatewayError
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
