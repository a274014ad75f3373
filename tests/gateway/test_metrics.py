from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.runner import ServeAddresses

HISTOGRAMS = ("tandem_time_to_first_token_seconds", "tandem_inter_token_latency_seconds",
              "tandem_e2e_request_latency_seconds")
ENGINE_METRICS = ("tandem_num_requests_running", "tandem_num_requests_waiting",
                  "tandem_kv_cache_usage_perc", "tandem_prefix_cache_queries",
                  "tandem_prefix_cache_hits")


def scrape(server: ServeAddresses) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]],
                                                     float]]:
    response = httpx.get(f"{server.http_url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value
                                 for s in family.samples}
    return families


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and labels.items() <= dict(ls).items())


def test_metrics_count_requests_tokens_and_cache(client: openai.OpenAI, server: ServeAddresses,
                                                 gateway: Gateway) -> None:
    before = scrape(server)
    messages = [{"role": "system", "content": "You are a terse assistant. " * 8},
                {"role": "user", "content": "Say hi."}]
    for _ in range(2):  # the second request hits the prefix cache
        reply = client.chat.completions.create(model=gateway.model_name, messages=messages,
                                               max_tokens=4, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert reply.usage is not None
    after = scrape(server)

    for name in HISTOGRAMS:
        assert name in after
    assert (total(after["tandem_time_to_first_token_seconds"],
                  "tandem_time_to_first_token_seconds_count")
            - total(before["tandem_time_to_first_token_seconds"],
                    "tandem_time_to_first_token_seconds_count")) == 2
    assert (total(after["tandem_inter_token_latency_seconds"],
                  "tandem_inter_token_latency_seconds_count")
            - total(before["tandem_inter_token_latency_seconds"],
                    "tandem_inter_token_latency_seconds_count")) == 2 * 3

    def grew(family: str, sample: str, **labels: str) -> float:
        return (total(after[family], sample, **labels)
                - total(before.get(family, {}), sample, **labels))

    assert grew("tandem_request_success", "tandem_request_success_total",
                finished_reason="length") == 2
    assert grew("tandem_prompt_tokens", "tandem_prompt_tokens_total") == (
        2 * reply.usage.prompt_tokens)
    assert grew("tandem_generation_tokens", "tandem_generation_tokens_total") == 8
    cached = reply.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached and cached > 0
    assert grew("tandem_prefix_cache_hits", "tandem_prefix_cache_hits_total",
                worker="colocated") >= cached
    assert grew("tandem_prefix_cache_queries", "tandem_prefix_cache_queries_total",
                worker="colocated") > 0
    for name in ENGINE_METRICS:
        labels = {dict(ls)["worker"] for _, ls in after[name]}
        assert labels == {"colocated"}, name


def test_each_gateway_has_its_own_registry(async_engine: AsyncEngine,
                                           loaded_model: LoadedModel) -> None:
    first = Gateway(EngineBackend(async_engine), loaded_model.tokenizer)
    second = Gateway(EngineBackend(async_engine), loaded_model.tokenizer)
    assert first.metrics.registry is not second.metrics.registry
    first.metrics.start_request().end("stop", 3, 4)
    series = b'tandem_prompt_tokens_total{model_name="SmolLM2-135M-Instruct",tenant="default"}'
    assert series + b" 3.0" in first.metrics.render()[0]
    assert b"tandem_prompt_tokens_total{" not in second.metrics.render()[0]


def test_a_scrape_refreshes_lazily_polled_stats_first(server: ServeAddresses,
                                                      gateway: Gateway) -> None:
    # The disaggregated gateway hooks its cluster view here (an idle cluster polls its
    # workers every few seconds): /metrics awaits the hook before it renders.
    calls: list[int] = []

    async def refresh() -> None:
        gateway.metrics.in_flight.labels(gateway.model_name).set(7)
        calls.append(1)

    gateway.refresh_stats = refresh
    try:
        samples = scrape(server)["tandem_requests_in_flight"]
        assert total(samples, "tandem_requests_in_flight") == 7
        assert calls == [1]
    finally:
        gateway.refresh_stats = None
        gateway.metrics.in_flight.labels(gateway.model_name).set(gateway.in_flight)
