"""The doctor reads what the real collectors write: the settings from tandem_config_info (no
secrets, no paths), the router's prefix counters, histograms as differences of two reads."""

from __future__ import annotations

from dataclasses import fields

from prometheus_client.exposition import generate_latest

from tandem.router import InProcessEventBus, InProcessRegistry, Router, RouterConfig
from tandem.services.doctor.evidence import EMPTY, Evidence, Scrape
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.handoff.decode import DecodeMetrics
from tandem.services.handoff.prefill import PrefillMetrics
from tandem.services.protocol.block_hash import HashSettings
from tandem.services.protocol.outputs import EngineStats
from tandem.services.serving import metrics as serving_metrics
from tandem.services.serving.cluster_view import WorkerSnapshot
from tandem.services.serving.config import AppConfig


def exposition(config: AppConfig, gateway: GatewayMetrics) -> str:
    stats = EngineStats(**{f.name: 0 for f in fields(EngineStats)})
    snapshots = [WorkerSnapshot("p", "prefill", stats, PrefillMetrics().snapshot()),
                 WorkerSnapshot("d", "decode", stats, DecodeMetrics().snapshot())]
    settings = HashSettings(16, "model")
    router = Router(RouterConfig(settings, policy=config.routing_policy),
                    InProcessRegistry(settings), InProcessEventBus())
    serving_metrics.register(gateway.registry, "model", lambda: snapshots, router, None, config)
    return generate_latest(gateway.registry).decode()


def test_config_info_names_the_settings_and_no_secret_or_path() -> None:
    config = AppConfig(routing_policy="round_robin", spec="ngram", max_num_seqs=8,
                       num_kv_blocks=64, decode_replicas=2, api_keys_file="/secret/keys",
                       cluster_secret_file="/secret/cluster", tls_cert_file="/tls/c.pem",
                       tls_key_file="/tls/k.pem")
    stats = EngineStats(**{f.name: 0 for f in fields(EngineStats)})
    text = exposition(config, GatewayMetrics("model", lambda: {"p": stats, "d": stats}))
    scrape = Scrape.parse(text)
    assert scrape.config == {
        "colocated": "false", "prefill_replicas": "1", "decode_replicas": "2",
        "routing_policy": "round_robin", "spec": "ngram", "spec_k": "4", "max_num_seqs": "8",
        "max_num_batched_tokens": "512", "block_size": "16", "num_kv_blocks": "64",
        "kv_cache_memory_gb": "", "kv_cache_dtype": "auto", "host_kv_cache_gb": "0.0",
        "kv_transport": "auto", "weight_format": "dense", "internal_tls": "false"}
    info = [line for line in text.splitlines() if line.startswith("tandem_config_info")]
    assert len(info) == 1 and "/" not in info[0], info
    assert scrape.roles == {"p": "prefill", "d": "decode"}
    assert scrape.total("tandem_router_prompt_blocks_total") == 0
    assert scrape.total("tandem_router_cached_blocks_total", on="any") == 0


def test_histograms_and_counters_are_the_window_s_differences() -> None:
    gateway = GatewayMetrics("model", lambda: {})
    timer = gateway.start_request(arrival_time=0.0)
    timer.tokens(1, now=0.3)
    timer.end("stop", 10, 1, now=0.3)
    before = Scrape.parse(generate_latest(gateway.registry).decode())
    for ttft in (1.5, 2.5):
        timer = gateway.start_request(arrival_time=0.0)
        timer.tokens(1, now=ttft)
        timer.end("stop", 10, 1, now=ttft)
    after = Scrape.parse(generate_latest(gateway.registry).decode())
    window = Evidence(before, after, 5.0, (before, after))
    ttft = window.histogram("tandem_time_to_first_token_seconds")
    assert (ttft.count, ttft.mean, ttft.quantile(0.5), ttft.quantile(0.99)) == (2, 2.0, 2.5, 2.5)
    assert window.delta("tandem_request_success_total") == 2
    assert window.delta("tandem_prompt_tokens_total") == 20
    since_start = Evidence(EMPTY, after, 0.0, (after,))
    assert since_start.delta("tandem_request_success_total") == 3
