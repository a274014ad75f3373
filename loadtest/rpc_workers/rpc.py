"""JSON RPC over TCP: ``{"id", "method", "params"}`` in, ``{"id", "result"}`` or
``{"id", "error": {"type", "message"}}`` out, one frame each (see kv_transfer.framing).
A call made inside a trace also carries ``"trace": {"traceparent": ...}``; the server then runs
the handler in a ``control.<method>`` span under it.

A connection carries one call at a time; the client keeps a pool for concurrent calls. When
a client drops a connection mid-call, the server cancels that call (a closed stream aborts).

With a ``ClusterKey`` (the cluster secret, services/protocol/handoff.py), each connection starts
with the cluster handshake: a client that cannot prove the secret is answered with the reason
and disconnected before any call is read (counted in ``refused``, logged once per
connection); a server that cannot prove it is not called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from tandem.services import tracing
from tandem.services.kv_transfer.framing import FrameError, encode_frame, read_frame
from tandem.services.protocol import handoff
from tandem.services.protocol.handoff import ClusterKey

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class RpcError(RuntimeError):
    """The remote side failed with an error this client does not map to a local type."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type


class RpcServer:
    def __init__(self, handlers: Mapping[str, Handler], host: str = "127.0.0.1",
                 port: int = 0, key: ClusterKey | None = None) -> None:
        self.handlers = dict(handlers)
        self.host = host
        self.port = port
        self.key = key
        self.refused = 0  # connections that failed the handshake
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if self.key is not None and not await self._authenticate(reader, writer):
                return
            while (request := await read_frame(reader)) is not None:
                reply = await self._dispatch(request, reader)
                if reply is None:  # the client went away mid-call
                    return
                writer.write(encode_frame(reply))
                await writer.drain()
        except (OSError, FrameError, asyncio.IncompleteReadError) as exc:
            log.debug("RPC connection ended: %s", exc)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _authenticate(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> bool:
        assert self.key is not None

        async def send(frame: dict[str, Any]) -> None:
            writer.write(encode_frame(frame))
            await writer.drain()

        try:
            await handoff.accept(self.key, "control", send, lambda: read_frame(reader))
        except (handoff.AuthError, TimeoutError, FrameError) as exc:
            self.refused += 1
            log.warning("control connection from %s refused: %s",
                        writer.get_extra_info("peername"), exc or "handshake timed out")
            return False
        return True

    async def _dispatch(self, request: dict[str, Any], reader: asyncio.StreamReader
                        ) -> dict[str, Any] | None:
        call_id, method, params = request.get("id"), request.get("method"), request.get("params")
        handler = self.handlers.get(method) if isinstance(method, str) else None
        if handler is None:
            return _error(call_id, "RpcError", f"unknown method {method!r}")
        if not isinstance(params, dict):
            return _error(call_id, "RpcError", "params must be a JSON object")
        call = asyncio.create_task(_traced(method, handler, params, request.get("trace")))
        hangup = asyncio.create_task(reader.read(1))  # only EOF can come while a call runs
        try:
            await asyncio.wait({call, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await call
            hangup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await hangup
        if call.cancelled():
            return None
        exc = call.exception()
        if exc is not None:
            if not isinstance(exc, ValueError | RuntimeError | LookupError | OSError):
                log.exception("RPC %s failed", method, exc_info=exc)
            return _error(call_id, type(exc).__name__, str(exc))
        return {"id": call_id, "result": call.result()}


async def _traced(method: str, handler: Handler, params: dict[str, Any], carrier: Any) -> Any:
    with tracing.served(f"control.{method}", carrier):
        return await handler(params)


def _error(call_id: object, error_type: str, message: str) -> dict[str, Any]:
    return {"id": call_id, "error": {"type": error_type, "message": message}}


class RpcClient:
    def __init__(self, host: str, port: int,
                 errors: Mapping[str, type[Exception]] | None = None,
                 connect_timeout_s: float = 5.0, key: ClusterKey | None = None,
                 name: str = "client") -> None:
        """``key``, ``name``: prove the cluster secret under this name on each connection."""
        self.host = host
        self.port = port
        self.errors = dict(errors or {})
        self.connect_timeout_s = connect_timeout_s
        self.key = key
        self.name = name
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._next_id = 0

    async def call(self, method: str, params: Mapping[str, Any] | None = None,
                   timeout_s: float | None = None) -> Any:
        conn = self._idle.pop() if self._idle else await self._connect()
        self._next_id += 1
        call_id = self._next_id
        reusable = False
        frame = {"id": call_id, "method": method, "params": dict(params or {})}
        if (carrier := tracing.inject()) is not None:
            frame["trace"] = carrier
        try:
            async with asyncio.timeout(timeout_s):
                conn[1].write(encode_frame(frame))
                await conn[1].drain()
                reply = await read_frame(conn[0])
            if reply is not None and "hello" in reply:
                raise handoff.AuthError(f"RPC {method}: the server asks for the cluster "
                                     f"handshake; this client has no cluster secret")
            if reply is None or reply.get("id") != call_id:
                raise ConnectionError(f"RPC {method}: the server closed the connection")
            reusable = True
        finally:
            if reusable:
                self._idle.append(conn)
            else:
                conn[1].close()
        error = reply.get("error")
        if error is not None:
            error_type = str(error.get("type"))
            cls = self.errors.get(error_type)
            message = str(error.get("message"))
            raise cls(message) if cls is not None else RpcError(error_type, message)
        return reply.get("result")

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with asyncio.timeout(self.connect_timeout_s):
            reader, writer = await asyncio.open_connection(self.host, self.port)
        if self.key is None:
            return reader, writer

        async def send(frame: dict[str, Any]) -> None:
            writer.write(encode_frame(frame))
            await writer.drain()

        try:
            await handoff.connect(self.key, "control", self.name, send, lambda: read_frame(reader))
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()
