"""Slow clients: a stream whose client stops reading is cut after ``client_read_timeout_s``.

Real sockets on loopback: an HTTP client with a small receive buffer that sends its request and
then reads nothing, and a gRPC client that never asks for the next message. The server's
writes back up (uvicorn's flow control; the HTTP/2 window), the gateway cuts the stream: the
request is aborted (every KV block free again), counted as ``slow_client``, and the connection
dropped; the next request is served.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import grpc
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import serving, wait_engine_idle, wait_until

READ_TIMEOUT_S = 1.0
# Each streamed token carries 20 top logprobs (~1 KB of JSON): the server's buffers fill long
# before the request could finish.
MAX_TOKENS = 600
PROMPT = "Count slowly from one to one thousand:"


@pytest.fixture(scope="module")
def slow(async_engine: AsyncEngine, loaded_model: LoadedModel
         ) -> Iterator[tuple[Gateway, ServeAddresses]]:
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                      GatewayConfig(client_read_timeout_s=READ_TIMEOUT_S))
    with serving(gateway) as addresses:
        yield gateway, addresses


def _slow_clients(gateway: Gateway) -> float:
    failures = gateway.metrics.failures.labels(gateway.model_name, "default", "slow_client")
    return failures._value.get()


def _stalled_http_stream(addresses: ServeAddresses) -> socket.socket:
    """Send a streaming request, read nothing."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True, "logprobs": 20}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect((addresses.host, addresses.http_port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """What the server sent before it dropped the connection."""
    sock.settimeout(30)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass  # the server aborted the connection (RST)
    return received


def test_an_http_client_that_stops_reading_is_cut(slow: tuple[Gateway, ServeAddresses],
                                                  async_engine: AsyncEngine) -> None:
    gateway, addresses = slow
    before = _slow_clients(gateway)
    sock = _stalled_http_stream(addresses)
    try:
        wait_until(lambda: _slow_clients(gateway) == before + 1, "the slow client to be cut",
                   timeout_s=120)
        wait_engine_idle(async_engine)  # aborted, not run to its end: every block free
        received = _read_all(sock)
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 200"), received[:100]
    assert b"data: [DONE]" not in received  # cut mid-stream, not finished
    assert received.count(b"data: ") < MAX_TOKENS
    _served_normally(addresses)


def test_a_grpc_client_that_stops_reading_is_cut(slow: tuple[Gateway, ServeAddresses],
                                                 async_engine: AsyncEngine) -> None:
    gateway, addresses = slow
    before = _slow_clients(gateway)
    # No BDP probing: the call's HTTP/2 window stays at 64 KiB, as a client on a slow link.
    with grpc.insecure_channel(addresses.grpc_target,
                               options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        call = stub.Generate(pb.GenerateRequest(
            model=gateway.model_name, prompt=PROMPT,
            sampling=pb.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0,
                                        ignore_eos=True, logprobs=20)), timeout=120)
        wait_until(lambda: _slow_clients(gateway) == before + 1, "the slow client to be cut",
                   timeout_s=120)
        wait_engine_idle(async_engine)
        with pytest.raises(grpc.RpcError) as failed:
            for _ in call:
                pass
        assert failed.value.code() == grpc.StatusCode.CANCELLED, failed.value
        assert "read nothing" in (failed.value.details() or "")
    _served_normally(addresses)


def _served_normally(addresses: ServeAddresses) -> None:
    import httpx

    response = httpx.post(f"{addresses.http_url}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
