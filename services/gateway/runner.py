"""Serve a gateway's HTTP and gRPC front ends: ``FrontEnds`` on the running event loop (the
gateway's Serve replica), ``GatewayServer`` on a loop of its own in a thread (tests, embedding).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from starlette.types import Scope

from tandem.services.gateway.core import Gateway
from tandem.services.gateway.grpc_service import create_grpc_server
from tandem.services.gateway.http_app import create_http_app, deadline_protocol
from tandem.services.tls import ServerTLS


@dataclass(frozen=True)
class ServeAddresses:
    host: str
    http_port: int
    grpc_port: int
    tls: bool = False  # HTTPS, and gRPC over TLS

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"


class FrontEnds:
    """The HTTP (uvicorn) and gRPC servers of one gateway, on the running event loop.

    ``start()`` returns once both accept connections; port 0 picks a free port. The gateway's
    Serve replica runs these itself (Serve's HTTP proxy is off): uvicorn's flow control then
    reaches the gateway, which cuts clients that stop reading (http_app.py). With ``tls``
    both serve TLS only (HTTPS; gRPC over TLS).
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", http_port: int = 8000,
                 grpc_port: int = 50051, log_level: str = "warning",
                 graceful_shutdown_s: float = 5.0, configure_logging: bool = True,
                 tls: ServerTLS | None = None) -> None:
        self.gateway = gateway
        self._host = host
        self._tls = tls
        self._http_socket = _bind(host, http_port)
        app = self._app = create_http_app(gateway, self._abort_connection)
        limits = gateway.config
        cut = gateway.metrics.connections_cut
        protocol = deadline_protocol(limits.header_timeout_s, limits.body_timeout_s,
                                     lambda reason: cut.labels(gateway.model_name, reason).inc())
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", http=protocol,
                                limit_concurrency=limits.max_connections,
                                timeout_graceful_shutdown=int(graceful_shutdown_s) or None,
                                **({} if configure_logging else {"log_config": None}),
                                **({} if tls is None else {"ssl_certfile": tls.cert_file,
                                                           "ssl_keyfile": tls.key_file}))
        self._http = uvicorn.Server(config)
        self._http_task: asyncio.Task[None] | None = None
        self._grpc = create_grpc_server(gateway, f"{host}:{grpc_port}", tls)
        self._grace_s = graceful_shutdown_s
        self.addresses: ServeAddresses | None = None

    async def start(self) -> ServeAddresses:
        await self._grpc.start()
        self._http_task = asyncio.create_task(self._http.serve(sockets=[self._http_socket]))
        await self._wait_http_started(self._http_task)
        self.addresses = ServeAddresses(self._host, self._http_socket.getsockname()[1],
                                        self._grpc.port, self._tls is not None)
        return self.addresses

    async def serve_until_stopped(self) -> None:
        """Wait until the HTTP server exits (``stop()`` or a signal)."""
        assert self._http_task is not None
        await self._http_task

    def request_stop(self) -> None:
        """Ask the HTTP server to exit (from any thread); ``serve_until_stopped`` returns."""
        self._http.should_exit = True

    async def stop(self) -> None:
        self.request_stop()
        try:
            if self._http_task is not None:
                with contextlib.suppress(BaseException):
                    await self._http_task
        finally:
            self._http_socket.close()
            await self._grpc.stop(self._grace_s)
            await self._app.state.responses.close()

    def _abort_connection(self, scope: Scope) -> None:
        """Drop the connection now carrying the request of ``scope`` (not a graceful close,
        which would wait for a client that does not read to take the buffered bytes)."""
        for connection in list(self._http.server_state.connections):
            if getattr(connection, "scope", None) is scope:
                connection.transport.abort()

    async def _wait_http_started(self, http_task: asyncio.Task[None]) -> None:
        # uvicorn offers no startup event; its `started` flag flips once it listens.
        deadline = time.monotonic() + 30.0
        while not self._http.started:
            if http_task.done():
                http_task.result()  # raises the startup failure
                raise RuntimeError("the HTTP server exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("the HTTP server did not start within 30 s")
            await asyncio.sleep(0.01)


class GatewayServer:
    """``FrontEnds`` on their own event loop in a background thread (colocated runs, tests).

    ``start()`` returns once both front ends accept connections; ``stop()`` shuts them down.
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", http_port: int = 8000,
                 grpc_port: int = 50051, log_level: str = "warning",
                 graceful_shutdown_s: float = 5.0, tls: ServerTLS | None = None) -> None:
        self.gateway = gateway
        self._args = (gateway, host, http_port, grpc_port, log_level, graceful_shutdown_s)
        self._tls = tls
        self._fronts: FrontEnds | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tandem-gateway", daemon=True)
        self.addresses: ServeAddresses | None = None

    def start(self, timeout_s: float = 30.0) -> ServeAddresses:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the gateway did not start within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError("the gateway failed to start") from self._error
        assert self.addresses is not None
        return self.addresses

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._fronts is not None:
            self._fronts.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(); the thread must not die silently
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._fronts = FrontEnds(*self._args, tls=self._tls)
        try:
            self.addresses = await self._fronts.start()
            self._ready.set()
            await self._fronts.serve_until_stopped()
        finally:
            await self._fronts.stop()


# The kernel's send buffer per HTTP connection (accepted sockets inherit the listening socket's;
# Linux doubles it). Autotuned, it grows to 4 MiB for a client that does not read; a stream's
# text is small, and a non-streamed body still leaves at ~SEND_BUFFER_BYTES per round trip.
SEND_BUFFER_BYTES = 32 * 1024


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
