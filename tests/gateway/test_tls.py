"""TLS on the front ends: with ``tls_cert_file``/``tls_key_file`` the gateway serves HTTPS and
gRPC over TLS only, on its usual ports; the settings are checked up front, by name.

Certificates are made here (``cryptography``); traffic stays on 127.0.0.1. The servers are the
gateway replica's own (``AppConfig.server_tls()`` into ``FrontEnds``), without Ray."""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.cli import main as tandem
from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import GatewayServer, ServeAddresses
from tandem.services.serving.config import AppConfig, ConfigError
from tandem.services.serving.up import Stop, _wait_healthy, ready_line
from tandem.services.tls import TLSConfigError
from tests.certs import Credentials, issue
from tests.gateway.helpers import engine_tokens

MAX_TOKENS = 4
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tls")


@pytest.fixture(scope="module")
def loopback(certs: Path) -> Credentials:
    """Self-signed, for 127.0.0.1: what a client here can verify by name."""
    return issue(certs, "loopback", "127.0.0.1",
                  [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])[0]


@pytest.fixture(scope="module")
def tls_server(gateway: Gateway, loopback: Credentials) -> Iterator[ServeAddresses]:
    tls = loopback.config().server_tls()
    assert tls is not None
    server = GatewayServer(gateway, http_port=0, grpc_port=0, tls=tls)
    try:
        yield server.start()
    finally:
        server.stop()


def _client(server: ServeAddresses, verify: ssl.SSLContext | bool) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{server.http_url}/v1", max_retries=0,
                         timeout=60, http_client=httpx.Client(verify=verify, timeout=60))


def test_the_openai_client_gets_a_completion_over_https(tls_server: ServeAddresses,
                                                        loopback: Credentials,
                                                        gateway: Gateway,
                                                        async_engine: AsyncEngine) -> None:
    assert tls_server.http_url.startswith("https://127.0.0.1:")
    with _client(tls_server, ssl.create_default_context(cafile=loopback.cert_file)) as client:
        reply = client.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
    expected = engine_tokens(async_engine, gateway.tokenizer.encode(PROMPT), MAX_TOKENS,
                             ignore_eos=True)
    assert reply.choices[0].text == gateway.tokenizer.decode(expected)
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected)


def test_a_client_that_does_not_trust_the_certificate_is_refused(
        tls_server: ServeAddresses) -> None:
    with _client(tls_server, ssl.create_default_context()) as client, \
            pytest.raises(openai.APIConnectionError) as refused:
        client.models.list()
    assert isinstance(refused.value.__cause__, httpx.ConnectError)
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value.__cause__)


def test_plaintext_http_is_not_served(tls_server: ServeAddresses) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{tls_server.http_port}/health", timeout=10)


def test_grpc_over_tls_and_not_in_the_clear(tls_server: ServeAddresses, loopback: Credentials,
                                            gateway: Gateway,
                                            async_engine: AsyncEngine) -> None:
    request = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingOptions(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    credentials = grpc.ssl_channel_credentials(root_certificates=loopback.cert)
    with grpc.secure_channel(tls_server.grpc_target, credentials) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
    expected = engine_tokens(async_engine, gateway.tokenizer.encode(PROMPT), MAX_TOKENS,
                             ignore_eos=True)
    assert [t for r in responses for t in r.token_ids] == expected
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(tls_server.grpc_target) as channel, \
            pytest.raises(grpc.RpcError) as plaintext:
        list(pb_grpc.GenerationStub(channel).Generate(request, timeout=10))
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(("settings", "message"), [
    ({"tls_cert_file": "cert.pem"}, "tls_cert_file needs tls_key_file"),
    ({"tls_key_file": "key.pem"}, "tls_key_file needs tls_cert_file"),
    ({"tls_cert_file": 1, "tls_key_file": "key.pem"}, "tls_cert_file must be str"),
])
def test_tls_takes_both_files_or_neither(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AppConfig.from_dict(settings, "test")
    assert AppConfig().server_tls() is None


def test_a_file_that_cannot_be_used_fails_at_start_naming_the_setting(
        certs: Path, loopback: Credentials) -> None:
    missing = str(certs / "missing.pem")
    other = issue(certs, "other", "other", [])[0]
    (certs / "garbage.pem").write_text("not a certificate\n")
    for cert_file, key_file, message in [
        (missing, loopback.key_file, f"cannot read tls_cert_file {missing}: No such file"),
        (loopback.cert_file, str(certs), f"cannot read tls_key_file {certs}: Is a directory"),
        (loopback.cert_file, other.key_file, "are not a PEM certificate chain and its "
                                             "unencrypted private key"),
        (str(certs / "garbage.pem"), loopback.key_file, "tls_cert_file .*garbage.pem and "
                                                        "tls_key_file"),
    ]:
        config = AppConfig(tls_cert_file=cert_file, tls_key_file=key_file)
        with pytest.raises(TLSConfigError, match=message):
            config.server_tls()


def test_tandem_up_refuses_bad_tls_settings_before_starting_anything(
        certs: Path, loopback: Credentials, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(certs / "missing.pem")
    assert tandem(["up", "--tls-cert-file", missing, "--tls-key-file", loopback.key_file]) == 2
    assert f"tandem: error: cannot read tls_cert_file {missing}" in capsys.readouterr().err
    assert tandem(["up", "--tls-key-file", loopback.key_file]) == 2
    assert "tls_key_file needs tls_cert_file" in capsys.readouterr().err


def test_the_ready_line_says_https() -> None:
    line = ready_line(AppConfig(tls_cert_file="c.pem", tls_key_file="k.pem"))
    assert "HTTP https://127.0.0.1:8000/v1  gRPC 127.0.0.1:50051 (TLS)  (" in line
    assert "HTTP http://127.0.0.1:8000/v1  gRPC 127.0.0.1:50051  (" in ready_line(AppConfig())


def test_tandem_up_polls_health_trusting_the_served_certificate(
        certs: Path, async_engine: AsyncEngine, gateway: Gateway) -> None:
    """A CA-issued certificate for the service's name (as on Kubernetes), the file holding the
    leaf only: the loopback health poll trusts that certificate, whatever name it carries, and
    stops at once with a clear error on a certificate it cannot verify."""
    ca = issue(certs, "ca", "Tandem test CA", [], ca=True)
    service = issue(certs, "service", "tandem.serving.svc",
                     [x509.DNSName("tandem.serving.svc")], issuer=ca[1:])[0]
    tls = service.config().server_tls()
    assert tls is not None
    server = GatewayServer(Gateway(EngineBackend(async_engine), gateway.tokenizer),
                           http_port=0, grpc_port=0, tls=tls)
    addresses = server.start()
    try:
        _wait_healthy(service.config(port=addresses.http_port), Stop())
        stranger = issue(certs, "stranger", "127.0.0.1", [])[0]
        with pytest.raises(RuntimeError, match=r"certificate \(tls_cert_file\) does not verify"):
            _wait_healthy(stranger.config(port=addresses.http_port), Stop())
    finally:
        server.stop()
