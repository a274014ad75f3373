"""Connection hygiene on both front ends (issue 40): a connection that does not send a request's
headers, or its announced body, in time gets 408 and is closed (and counted); beyond
max_connections HTTP answers 503, beyond max_grpc_streams gRPC RESOURCE_EXHAUSTED. Raw sockets
on loopback play the slow clients."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import httpx
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import serving

DEADLINE_S = 0.5


@pytest.fixture(scope="module")
def strict(async_engine: AsyncEngine, loaded_model: LoadedModel
           ) -> Iterator[tuple[Gateway, ServeAddresses]]:
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer, GatewayConfig(
        header_timeout_s=DEADLINE_S, body_timeout_s=DEADLINE_S, max_connections=4,
        max_grpc_streams=1))
    with serving(gateway) as addresses:
        yield gateway, addresses


def cut(gateway: Gateway, reason: str) -> float:
    value = gateway.metrics.registry.get_sample_value(
        "tandem_http_connections_cut_total", {"model_name": gateway.model_name, "reason": reason})
    assert value is not None
    return value


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded: 30 s)."""
    sock.settimeout(30)
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


def connect(addresses: ServeAddresses) -> socket.socket:
    return socket.create_connection((addresses.host, addresses.http_port), timeout=30)


@pytest.mark.parametrize(("sent", "reason"), [
    (b"", "header_timeout"),  # connected, silent
    (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n", "header_timeout"),  # headers trickle
    (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\n"
     b"content-length: 100\r\n\r\n{\"prompt\":", "body_timeout"),  # a body announced, not sent
])
def test_a_request_not_sent_in_time_gets_408_and_its_connection_closed(
        strict: tuple[Gateway, ServeAddresses], sent: bytes, reason: str) -> None:
    gateway, addresses = strict
    before = cut(gateway, reason)
    with connect(addresses) as sock:
        sock.sendall(sent)
        answer = until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout")
    assert cut(gateway, reason) == before + 1
    assert httpx.get(f"{addresses.http_url}/health", timeout=30).status_code == 200


def test_requests_sent_promptly_are_served_on_a_kept_alive_connection(
        strict: tuple[Gateway, ServeAddresses]) -> None:
    _, addresses = strict
    with httpx.Client(base_url=addresses.http_url, timeout=60) as client:
        for _ in range(2):
            response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert response.status_code == 200


def test_beyond_max_connections_http_answers_503(strict: tuple[Gateway, ServeAddresses]
                                                 ) -> None:
    _, addresses = strict
    held = [connect(addresses) for _ in range(4)]
    try:
        with connect(addresses) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            sock.settimeout(30)
            assert sock.recv(4096).startswith(b"HTTP/1.1 503")
    finally:
        for sock in held:
            sock.close()


def test_beyond_max_grpc_streams_a_call_is_refused(strict: tuple[Gateway, ServeAddresses]
                                                   ) -> None:
    _, addresses = strict
    with grpc.insecure_channel(addresses.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        long = stub.Generate(pb.GenerateRequest(prompt="Count:", sampling=pb.SamplingOptions(
            max_tokens=200, ignore_eos=True)), timeout=120)
        next(long)  # the one allowed call is streaming
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(prompt="Hi"), timeout=60))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        long.cancel()
