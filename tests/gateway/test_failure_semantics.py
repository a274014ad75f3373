"""Deadlines, admission, engine faults and health at the gateway, over real HTTP and gRPC
servers on a colocated engine (the disaggregated path: tests/e2e/test_faults.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.faults import ENV, fault_hook_from_env
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import serving, wait_engine_idle, wait_until

STEP_SEED, FATAL_SEED = 666, 667
MAX_IN_FLIGHT = 2
LONG = {"prompt": "Tell me a long story.", "max_tokens": 600, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(make_engine) -> Iterator[AsyncEngine]:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(make_engine(num_threads=1, num_kv_blocks=128, max_model_len=1024))
    engine.llm.fault_hook = fault_hook_from_env(
        environ={ENV: f"step={STEP_SEED},fatal={FATAL_SEED}"})
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def gateway(engine: AsyncEngine, loaded_model: LoadedModel) -> Gateway:
    config = GatewayConfig(max_in_flight=MAX_IN_FLIGHT, request_timeout_s=120.0)
    return Gateway(EngineBackend(engine), loaded_model.tokenizer, config)


@pytest.fixture(scope="module")
def server(gateway: Gateway) -> Iterator[ServeAddresses]:
    with serving(gateway) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def channel(server: ServeAddresses) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


def _post(server: ServeAddresses, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)


def _failures(gateway: Gateway, reason: str) -> float:
    value = gateway.metrics.failures.labels(gateway.model_name, "default", reason)._value.get()
    return float(value)


def _refused(gateway: Gateway) -> float:
    """Every failure counted, whatever its reason."""
    return sum(sample.value for metric in gateway.metrics.failures.collect()
               for sample in metric.samples if sample.name.endswith("_total"))


RETRY_POLICY = json.dumps({"methodConfig": [{
    "name": [{"service": "tandem.v1.Generation"}],
    "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.1s", "maxBackoff": "1s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]})


def _served(server: ServeAddresses, engine: AsyncEngine) -> None:
    wait_engine_idle(engine)
    response = _post(server, {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text


def test_the_deadline_ends_http_and_grpc_requests(server: ServeAddresses, gateway: Gateway,
                                                  engine: AsyncEngine,
                                                  channel: grpc.Channel) -> None:
    before = _failures(gateway, "timeout")
    response = _post(server, {**LONG, "timeout": 0.5})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    with httpx.stream("POST", f"{server.http_url}/v1/completions",
                      json={**LONG, "timeout": 0.5, "stream": True}, timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "timeout"
    request = pb.GenerateRequest(prompt="Tell me a long story.", sampling=pb.SamplingOptions(
        max_tokens=600, temperature=0.0, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as failed:
        list(pb_grpc.GenerationStub(channel).Generate(request, timeout=0.5))
    assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # The server aborted the gRPC request too (its deadline is the call's).
    wait_until(lambda: _failures(gateway, "timeout") == before + 3, "three timeouts counted")
    with pytest.raises(httpx.HTTPStatusError):
        _post(server, {**LONG, "timeout": 0}).raise_for_status()
    _served(server, engine)


def test_requests_over_the_in_flight_bound_get_429_before_any_work(
        server: ServeAddresses, gateway: Gateway, engine: AsyncEngine,
        channel: grpc.Channel) -> None:
    client = httpx.Client(base_url=server.http_url, timeout=60)
    streams = [client.stream("POST", "/v1/completions", json={**LONG, "stream": True})
               for _ in range(MAX_IN_FLIGHT)]
    opened = [s.__enter__() for s in streams]
    try:
        assert all(r.status_code == 200 for r in opened)
        assert gateway.in_flight == MAX_IN_FLIGHT
        refused = _post(server, {"prompt": "Hi", "max_tokens": 4})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "server_overloaded"
        request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(max_tokens=4))
        call = pb_grpc.GenerationStub(channel).Generate(request, timeout=30)
        with pytest.raises(grpc.RpcError) as failed:
            list(call)
        assert failed.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(failed.value.trailing_metadata() or ())
        # When to retry, as HTTP, gRPC's retry policies and Google's client libraries read it.
        assert (trailers["retry-after"], trailers["grpc-retry-pushback-ms"]) == ("1", "1000")
        status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        retry = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(retry) and retry.retry_delay.seconds == 1
        # A client whose retry policy retries RESOURCE_EXHAUSTED tries again (after the
        # pushback, which gRPC's retries wait): both of its attempts are refused here.
        before = _refused(gateway)
        with grpc.insecure_channel(server.grpc_target, options=[
                ("grpc.service_config", RETRY_POLICY)]) as retrying, pytest.raises(
                    grpc.RpcError) as again:
            list(pb_grpc.GenerationStub(retrying).Generate(request, timeout=30))
        assert again.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _refused(gateway) == before + 2
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)
        client.close()
    wait_until(lambda: gateway.in_flight == 0, "the closed streams to end")
    _served(server, engine)


def test_a_failed_step_fails_its_request_and_the_engine_serves_on(
        server: ServeAddresses, gateway: Gateway, engine: AsyncEngine) -> None:
    before = _failures(gateway, "engine_error")
    response = _post(server, {"prompt": "Hello", "max_tokens": 8, "seed": STEP_SEED})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "engine_error"
    assert _failures(gateway, "engine_error") == before + 1
    assert httpx.get(f"{server.http_url}/health").status_code == 200
    _served(server, engine)


def test_a_stopped_engine_makes_health_say_503(server: ServeAddresses, engine: AsyncEngine,
                                              channel: grpc.Channel) -> None:
    """Last in this module: the engine stops for good."""
    response = _post(server, {"prompt": "Hello", "max_tokens": 8, "seed": FATAL_SEED})
    assert response.status_code == 503
    assert "injected fatal fault" in response.json()["error"]["message"]
    health = httpx.get(f"{server.http_url}/health")
    assert health.status_code == 503 and "engine stopped" in health.json()["reason"]
    assert _post(server, {"prompt": "Hello", "max_tokens": 4}).status_code == 503
    checker = health_pb2_grpc.HealthStub(channel)

    def not_serving() -> bool:
        status = checker.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        return status == health_pb2.HealthCheckResponse.NOT_SERVING

    wait_until(not_serving, "gRPC health to say NOT_SERVING", timeout_s=10)
    stats = engine.stats
    assert stats.num_free_blocks == stats.num_blocks
