"""Requests refused before admission (bad JSON or field, unknown model, body over the limit,
missing or wrong API key) count once in ``tandem_request_failures_total`` under the right reason
and tenant, and are logged once; failures after admission still count once. Over real HTTP and
gRPC servers on a colocated engine, with API keys on."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import MAX_CHOICES, REFUSAL_LOG_INTERVAL_S, Gateway, LogSampler
from tandem.services.gateway.errors import (
    bad_request,
    body_too_large,
    model_not_found,
    overloaded,
    unauthorized,
)
from tandem.services.gateway.metrics import FAILURE_REASONS, failure_reason
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tandem.services.gateway.tenants import Tenants
from tests.gateway.helpers import serving, wait_until

SECRET = b"s" * 32
KEY = "key-a1"
KEYS = {KEY: "acme", "key-b": "bolt"}
AUTH = {"authorization": f"Bearer {KEY}"}
WRONG = "not-a-key-123"
WRONG_KEY = {"authorization": f"Bearer {WRONG}"}
ACME, UNKNOWN = "acme", "unknown"
# n=2 over this bound: choice 0 is admitted, choice 1 refused with 429 (counted by its timer).
MAX_IN_FLIGHT = 1
MAX_BODY = 4096

Failures = dict[tuple[str, str], float]


@pytest.fixture(scope="module")
def gateway(async_engine: AsyncEngine, loaded_model: LoadedModel) -> Gateway:
    config = GatewayConfig(max_in_flight=MAX_IN_FLIGHT, max_body_bytes=MAX_BODY)
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer, config,
                      Tenants(KEYS, SECRET))
    # Each case here checks its own line; test_a_flood_of_refusals_is_logged_sparingly checks
    # the sampling that the gateway does by default.
    gateway.refusal_log = LogSampler(0.0)
    return gateway


@pytest.fixture(scope="module")
def server(gateway: Gateway) -> Iterator[ServeAddresses]:
    with serving(gateway) as addresses:
        yield addresses


@pytest.fixture
def refusal_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="tandem.services.gateway")
    return caplog


def failures(server: ServeAddresses) -> Failures:
    """``tandem_request_failures_total`` by (tenant, reason), as /metrics shows it."""
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    return {(s.labels["tenant"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "tandem_request_failures_total"}


def assert_counted_once(before: Failures, after: Failures, tenant: str, reason: str) -> None:
    """Exactly one failure more, under (tenant, reason), and no other series moved."""
    changed = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert changed == {(tenant, reason): 1.0}


def refusal_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("tandem.services.gateway")]


def assert_logged_once(caplog: pytest.LogCaptureFixture, status: int, words: str) -> None:
    records = refusal_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    record = records[0]
    assert record.levelno in (logging.INFO, logging.WARNING) and record.exc_info is None
    message = record.getMessage()
    assert f": {status} " in message and words in message
    assert KEY not in message and WRONG not in message  # keys are never logged


def assert_served(server: ServeAddresses, gateway: Gateway) -> None:
    wait_until(lambda: gateway.in_flight == 0, "earlier requests to end")  # MAX_IN_FLIGHT
    response = httpx.post(f"{server.http_url}/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_reasons_by_status() -> None:
    assert failure_reason(bad_request("x", param="n")) == "invalid"
    assert failure_reason(model_not_found("m")) == "invalid"
    assert failure_reason(body_too_large(1)) == "invalid"
    assert failure_reason(unauthorized()) == "unauthenticated"
    assert failure_reason(overloaded("busy", 1)) == "rejected"


def test_every_series_is_there_from_the_start(server: ServeAddresses) -> None:
    series = failures(server)
    for tenant in ("acme", "bolt"):
        assert {reason for t, reason in series if t == tenant} == set(FAILURE_REASONS)
    # Refusals before the key is known: never under a string the client sent.
    assert {(t, r) for t, r in series if t not in ("acme", "bolt")} == {
        (UNKNOWN, "invalid"), (UNKNOWN, "unauthenticated")}


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, headers, kwargs, status, param, words, tenant, reason", [
    (COMPLETIONS, AUTH, {"content": b'{"prompt": "Hi", "max_tokens": '}, 400, None,
     "not valid JSON", ACME, "invalid"),
    (CHAT, AUTH, {"json": {"messages": HI, "temperature": "hot"}}, 400, "temperature",
     "temperature", ACME, "invalid"),
    (CHAT, AUTH, {"json": {"messages": HI, "n": 0}}, 400, "n", "n:", ACME, "invalid"),
    (COMPLETIONS, AUTH, {"json": {"prompt": "Hi", "model": "no-such-model"}}, 404, "model",
     "no-such-model", ACME, "invalid"),
    (COMPLETIONS, AUTH, {"json": {"prompt": "x" * MAX_BODY}}, 413, None, "larger than the limit",
     ACME, "invalid"),
    (CHAT, {}, {"json": {"messages": HI}}, 401, None, "API key", UNKNOWN, "unauthenticated"),
    (COMPLETIONS, WRONG_KEY, {"json": {"prompt": "Hi"}}, 401, None, "API key", UNKNOWN,
     "unauthenticated"),
    (CHAT, WRONG_KEY, {"json": {"messages": HI, "pad": "x" * MAX_BODY}}, 413, None,
     "larger than the limit", UNKNOWN, "invalid"),
], ids=["invalid-json", "temperature-hot", "n-0", "unknown-model", "too-large", "no-key",
        "wrong-key", "too-large-wrong-key"])
def test_http_refusal_is_counted_and_logged_once(
        server: ServeAddresses, gateway: Gateway, refusal_logs: pytest.LogCaptureFixture,
        path: str, headers: dict[str, str], kwargs: dict[str, object], status: int,
        param: str | None, words: str, tenant: str, reason: str) -> None:
    before = failures(server)
    refusal_logs.clear()
    response = httpx.post(f"{server.http_url}{path}", timeout=60,
                          headers={"content-type": "application/json", **headers},
                          **kwargs)  # type: ignore[arg-type]
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param
    assert_logged_once(refusal_logs, status, words)
    assert_counted_once(before, failures(server), tenant, reason)
    assert_served(server, gateway)


def test_other_endpoints_refusals_are_not_generation_failures(
        server: ServeAddresses, refusal_logs: pytest.LogCaptureFixture) -> None:
    """/tokenize is no generation request: neither its successes nor its refusals count."""
    before = failures(server)
    response = httpx.post(f"{server.http_url}/tokenize", headers=AUTH, timeout=60,
                          json={"prompt": "Hi", "model": "no-such-model"})
    assert response.status_code == 404
    assert failures(server) == before and not refusal_records(refusal_logs)


def grpc_refusal(server: ServeAddresses, request: pb.GenerateRequest | bytes,
                 metadata: tuple[tuple[str, str], ...]) -> grpc.RpcError:
    """The error a Generate call of ``request`` (raw bytes: sent as they are) ends with."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        generate = (channel.unary_stream("/tandem.v1.Generation/Generate")
                    if isinstance(request, bytes) else pb_grpc.GenerationStub(channel).Generate)
        with pytest.raises(grpc.RpcError) as info:
            list(generate(request, timeout=60, metadata=metadata))
    return info.value


GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)


@pytest.mark.parametrize("request_, metadata, code, words, tenant, reason", [
    (pb.GenerateRequest(prompt="Hi", n=MAX_CHOICES + 1), GRPC_AUTH,
     grpc.StatusCode.INVALID_ARGUMENT, "n must be", ACME, "invalid"),
    (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(temperature=3.0)), GRPC_AUTH,
     grpc.StatusCode.INVALID_ARGUMENT, "temperature", ACME, "invalid"),
    (pb.GenerateRequest(prompt="Hi", model="no-such-model"), GRPC_AUTH,
     grpc.StatusCode.NOT_FOUND, "no-such-model", ACME, "invalid"),
    (pb.GenerateRequest(prompt="Hi"), (), grpc.StatusCode.UNAUTHENTICATED, "API key", UNKNOWN,
     "unauthenticated"),
    (pb.GenerateRequest(prompt="Hi"), (("authorization", f"Bearer {WRONG}"),),
     grpc.StatusCode.UNAUTHENTICATED, "API key", UNKNOWN, "unauthenticated"),
], ids=["n-too-many", "temperature-3", "unknown-model", "no-key", "wrong-key"])
def test_grpc_refusal_is_counted_and_logged_once(
        server: ServeAddresses, gateway: Gateway, refusal_logs: pytest.LogCaptureFixture,
        request_: pb.GenerateRequest, metadata: tuple[tuple[str, str], ...],
        code: grpc.StatusCode, words: str, tenant: str, reason: str) -> None:
    before = failures(server)
    refusal_logs.clear()
    error = grpc_refusal(server, request_, metadata)
    assert error.code() == code and words in (error.details() or "")
    assert_logged_once(refusal_logs, {grpc.StatusCode.INVALID_ARGUMENT: 400,
                                      grpc.StatusCode.NOT_FOUND: 404,
                                      grpc.StatusCode.UNAUTHENTICATED: 401}[code], words)
    assert_counted_once(before, failures(server), tenant, reason)
    assert_served(server, gateway)


def test_grpc_bytes_that_are_not_a_request_count_once(
        server: ServeAddresses, gateway: Gateway, refusal_logs: pytest.LogCaptureFixture) -> None:
    before = failures(server)
    refusal_logs.clear()
    error = grpc_refusal(server, b"\xff\xff\xff", GRPC_AUTH)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid GenerateRequest" in (error.details() or "")
    assert_logged_once(refusal_logs, 400, "not a valid GenerateRequest")
    assert_counted_once(before, failures(server), ACME, "invalid")
    assert_served(server, gateway)


def test_a_failure_after_admission_still_counts_once(
        server: ServeAddresses, gateway: Gateway, refusal_logs: pytest.LogCaptureFixture) -> None:
    """n=2 over the in-flight bound of 1: choice 1 is refused with 429 by ``Gateway.start``,
    whose timer counts it; the refusal path must not count it again."""
    wait_until(lambda: gateway.in_flight == 0, "earlier requests to end")
    before = failures(server)
    response = httpx.post(f"{server.http_url}{COMPLETIONS}", headers=AUTH, timeout=60,
                          json={"prompt": "Hi", "max_tokens": 2, "n": 2})
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "engine_overloaded"
    after = failures(server)
    assert_counted_once(before, after, ACME, "rejected")
    assert_served(server, gateway)

    before = failures(server)
    error = grpc_refusal(server, pb.GenerateRequest(
        prompt="Hi", n=2, sampling=pb.SamplingOptions(max_tokens=2)), GRPC_AUTH)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_counted_once(before, failures(server), ACME, "rejected")
    assert not [r for r in refusal_records(refusal_logs) if "refused" in r.getMessage()]
    assert_served(server, gateway)


def test_a_flood_of_refusals_is_logged_sparingly(
        server: ServeAddresses, gateway: Gateway, refusal_logs: pytest.LogCaptureFixture
) -> None:
    """Every refusal is counted; a burst of like ones is one log line, and the next line after
    the interval says how many were left out (a tenant's flood of refused requests must not
    make the gateway write hundreds of lines a second)."""
    now = [0.0]
    gateway.refusal_log = LogSampler(REFUSAL_LOG_INTERVAL_S, clock=lambda: now[0])
    try:
        before = failures(server)
        refusal_logs.clear()
        for _ in range(30):
            response = httpx.post(f"{server.http_url}{COMPLETIONS}", headers=WRONG_KEY,
                                  json={"prompt": "Hi"}, timeout=60)
            assert response.status_code == 401
        assert failures(server)[(UNKNOWN, "unauthenticated")] == \
            before[(UNKNOWN, "unauthenticated")] + 30
        assert len(refusal_records(refusal_logs)) == 1
        now[0] += REFUSAL_LOG_INTERVAL_S
        response = httpx.post(f"{server.http_url}{COMPLETIONS}", headers=WRONG_KEY,
                              json={"prompt": "Hi"}, timeout=60)
        assert response.status_code == 401
        records = refusal_records(refusal_logs)
        assert len(records) == 2
        assert "(and 29 more like it in the last 10 s)" in records[1].getMessage()
        # Another tenant's refusals are their own line at once.
        response = httpx.post(f"{server.http_url}{CHAT}", headers=AUTH,
                              json={"messages": HI, "n": 0}, timeout=60)
        assert response.status_code == 400
        assert len(refusal_records(refusal_logs)) == 3
    finally:
        gateway.refusal_log = LogSampler(0.0)
