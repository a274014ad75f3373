"""Serve a gateway's HTTP and gRPC front ends on one event loop in a background thread.

For colocated runs (``tandem up --colocated``) and tests; under Ray Serve the proxies own the
sockets and this is not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from services.gateway.core import Gateway
from services.gateway.grpc_service import create_grpc_server
from services.gateway.http_app import create_http_app


@dataclass(frozen=True)
class ServeAddresses:
    host: str
    http_port: int
    grpc_port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"


class GatewayServer:
    """``start()`` returns once both front ends accept connections; ``stop()`` shuts them down.

    Port 0 picks a free port; the bound ones are in ``addresses``.
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", http_port: int = 8000,
                 grpc_port: int = 50051, log_level: str = "warning",
                 graceful_shutdown_s: float = 5.0) -> None:
        self.gateway = gateway
        self._host = host
        self._http_socket = _bind(host, http_port)
        config = uvicorn.Config(create_http_app(gateway), log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=int(graceful_shutdown_s) or None)
        self._http = uvicorn.Server(config)
        self._grpc_port = grpc_port
        self._grace_s = graceful_shutdown_s
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
        self._http.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(); the thread must not die silently
            self._error = exc
        finally:
            self._http_socket.close()
            self._ready.set()

    async def _serve(self) -> None:
        grpc_front = create_grpc_server(self.gateway, f"{self._host}:{self._grpc_port}")
        await grpc_front.start()
        http_task = asyncio.create_task(self._http.serve(sockets=[self._http_socket]))
        try:
            await self._wait_http_started(http_task)
            self.addresses = ServeAddresses(self._host, self._http_socket.getsockname()[1],
                                            grpc_front.port)
            self._ready.set()
            await http_task
        finally:
            if not http_task.done():
                self._http.should_exit = True
                with contextlib.suppress(BaseException):
                    await http_task
            await grpc_front.stop(self._grace_s)

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


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
