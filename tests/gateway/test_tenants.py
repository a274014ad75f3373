"""API keys and tenants: authentication on both front ends, per-tenant prefix-cache isolation
(the salt is the server's), per-tenant rate limits, the tenant label on request metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.errors import GatewayError
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tandem.services.gateway.tenants import (
    KEYS_RELOAD_S,
    TenantConfigError,
    Tenants,
    parse_api_keys,
    read_api_keys,
)
from tests.gateway.helpers import cached_tokens, serving, wait_engine_idle

SECRET = b"s" * 32
KEYS = {"key-a1": "acme", "key-a2": "acme", "key-b": "bolt"}


def test_keys_file_lines() -> None:
    text = "# comment\nacme:key-a1\n\n acme : key-a2 \nbare-key\n"
    assert parse_api_keys(text) == {"key-a1": "acme", "key-a2": "acme", "bare-key": "default"}
    for bad in ("acme:", "acme:k\nbolt:k", "unknown:k"):
        with pytest.raises(TenantConfigError, match="line"):
            parse_api_keys(bad)
    with pytest.raises(TenantConfigError, match="cluster secret"):
        Tenants(KEYS)


def test_rate_limit_buckets_refill_and_refund() -> None:
    now = [0.0]
    tenants = Tenants(KEYS, SECRET, requests_per_minute=2, tokens_per_minute=600,
                      clock=lambda: now[0])
    assert tenants.admit("acme", 100) == 100
    charged = tenants.admit("acme", 400)
    with pytest.raises(GatewayError) as info:
        tenants.admit("acme", 10)  # 2 requests a minute: the third waits 30 s
    assert info.value.status == 429 and info.value.retry_after_s == 30
    assert tenants.admit("bolt", 500) == 500  # another tenant's buckets
    now[0] = 30.0  # one request refilled; tokens: 100 left + 300 refilled
    tenants.settle("acme", charged, 50)  # it used 50 of 400: 350 back (capped at 600)
    assert tenants.admit("acme", 600) == 600
    with pytest.raises(GatewayError, match="per minute"):
        tenants.admit("acme", 1)


def test_a_request_larger_than_the_bucket_is_refused_not_overdrawn() -> None:
    tenants = Tenants(KEYS, SECRET, tokens_per_minute=600, clock=lambda: 0.0)
    with pytest.raises(GatewayError) as info:
        tenants.admit("acme", 601)
    assert info.value.status == 429 and info.value.code == "request_too_large"
    assert "601" in info.value.message and "600" in info.value.message
    assert tenants.admit("acme", 600) == 600  # nothing was charged for the refused one


def test_keys_file_changes_take_effect_while_running(
        tmp_path: Path, async_engine: AsyncEngine, loaded_model: LoadedModel,
        caplog: pytest.LogCaptureFixture) -> None:
    """A key taken out of the file is refused once the gateway looks again (every
    KEYS_RELOAD_S), one added works, and a broken file keeps the keys in force."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("acme:key-old\nbolt:key-b\n")
    now = [0.0]
    tenants = Tenants(read_api_keys(keys_file), SECRET, keys_file=keys_file,
                      clock=lambda: now[0])
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer, tenants=tenants)
    with serving(gateway) as served:
        def status(key: str) -> int:
            return httpx.get(f"{served.http_url}/v1/models",
                             headers={"authorization": f"Bearer {key}"}).status_code

        assert (status("key-old"), status("key-new")) == (200, 401)
        keys_file.write_text("acme:key-new\nbolt:key-b\n")
        now[0] += KEYS_RELOAD_S / 2
        assert status("key-old") == 200  # not looked at yet
        now[0] += KEYS_RELOAD_S
        assert (status("key-old"), status("key-new"), status("key-b")) == (401, 200, 200)
        keys_file.write_text("acme:\n")  # broken: logged, the keys in force kept
        now[0] += KEYS_RELOAD_S
        assert (status("key-new"), status("key-b")) == (200, 200)
        assert "cannot be used, keeping the 2 key(s)" in caplog.text
        assert "key-new" not in caplog.text  # keys are never logged


def test_salts_are_the_servers() -> None:
    tenants = Tenants(KEYS, SECRET)
    assert tenants.cache_salt("acme", None) != tenants.cache_salt("bolt", None)
    assert tenants.cache_salt("acme", "x") != tenants.cache_salt("bolt", "x")
    assert tenants.cache_salt("acme", "x") != "x"
    assert Tenants().cache_salt("default", "x") == "x"  # no keys, no secret: as before


@pytest.fixture(scope="module")
def tenant_gateway(async_engine: AsyncEngine, loaded_model: LoadedModel) -> Gateway:
    tenants = Tenants(KEYS, SECRET, requests_per_minute=1000, tokens_per_minute=None)
    return Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                   GatewayConfig(metrics_require_key=True), tenants)


@pytest.fixture(scope="module")
def addresses(tenant_gateway: Gateway) -> Iterator[ServeAddresses]:
    with serving(tenant_gateway) as served:
        yield served


def client(addresses: ServeAddresses, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{addresses.http_url}/v1", max_retries=0,
                         timeout=120)


def test_no_key_or_a_wrong_key_is_refused_before_any_work(
        addresses: ServeAddresses, tenant_gateway: Gateway, async_engine: AsyncEngine) -> None:
    queries = async_engine.stats.prefix_cache_queries
    wrong = client(addresses, "wrong")
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    url = addresses.http_url
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}).status_code == 401
    assert httpx.get(f"{url}/metrics").status_code == 401  # metrics_require_key
    assert httpx.get(f"{url}/metrics",
                     headers={"authorization": "Bearer key-b"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200  # probes never need one
    with grpc.insecure_channel(addresses.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(max_tokens=1))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as wrong_key:
            list(stub.Generate(request, timeout=30,
                               metadata=[("authorization", "Bearer key-x")]))
        assert wrong_key.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(stub.Generate(request, timeout=30,
                                     metadata=[("authorization", "Bearer key-a1")]))
        assert replies[-1].usage.completion_tokens == 1
    # Only the one authenticated request reached the engine.
    assert async_engine.stats.prefix_cache_queries == queries + len(
        tenant_gateway.tokenizer.encode("Hi"))


def test_a_tenant_never_sees_anothers_cache(addresses: ServeAddresses,
                                            async_engine: AsyncEngine) -> None:
    prompt = list(range(1000, 1512))  # 512 tokens no other test sends

    def cached(key: str, salt: str | None = None) -> int:
        return cached_tokens(client(addresses, key), prompt, salt)

    assert cached("key-a1", "team-1") == 0
    assert cached("key-a2", "team-1") == 496  # the same tenant, another of its keys
    assert cached("key-b") == 0  # another tenant: nothing cached for it
    assert cached("key-b", "team-1") == 0  # even with A's cache_salt
    assert cached("key-a1") == 0  # A without its salt: another part of A's cache
    wait_engine_idle(async_engine)


def test_tenant_rate_limits_and_metrics(async_engine: AsyncEngine,
                                        loaded_model: LoadedModel) -> None:
    tenants = Tenants(KEYS, SECRET, requests_per_minute=2, clock=lambda: 0.0)  # no refill
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer, tenants=tenants)
    with serving(gateway) as served:
        acme, bolt = client(served, "key-a1"), client(served, "key-b")
        for _ in range(2):
            acme.completions.create(model="", prompt="Hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as info:
            acme.completions.create(model="", prompt="Hi", max_tokens=1)
        assert int(info.value.response.headers["retry-after"]) == 30
        assert info.value.code == "rate_limit_exceeded" and "acme" in info.value.message
        bolt.completions.create(model="", prompt="Hi", max_tokens=1)  # unaffected
        registry = gateway.metrics.registry

        def sample(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {"model_name": gateway.model_name,
                                                    **labels})

        assert sample("tandem_request_success_total", tenant="acme",
                      finished_reason="length") == 2
        assert sample("tandem_request_success_total", tenant="bolt",
                      finished_reason="length") == 1
        assert sample("tandem_request_failures_total", tenant="acme", reason="rejected") == 1
        assert sample("tandem_request_failures_total", tenant="bolt", reason="rejected") == 0


def test_a_request_pays_for_the_tokens_it_used(async_engine: AsyncEngine,
                                                loaded_model: LoadedModel) -> None:
    """Charged prompt + max_tokens at admission, refunded what it did not generate."""
    tenants = Tenants(KEYS, SECRET, tokens_per_minute=10_000, clock=lambda: 0.0)  # no refill
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer, tenants=tenants)
    with serving(gateway) as served:
        reply = client(served, "key-b").completions.create(
            model="", prompt="Count: one, two,", max_tokens=200, stop=[","])
        used = reply.usage.prompt_tokens + reply.usage.completion_tokens
        assert reply.usage.completion_tokens < 200
    assert tenants._buckets[("bolt", "tokens")].level == 10_000 - used
