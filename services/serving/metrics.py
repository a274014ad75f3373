"""Series the gateway's own metrics lack: per-worker KV blocks, leases, KV transfer, rejects and
recomputes (from the workers' polled status), and the router's decisions (from its status)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tandem.router import Router
from tandem.services.protocol.messages import TRANSFER_SECONDS_BUCKETS
from tandem.services.serving.backend import RESUME_SECONDS_BUCKETS, MigrationStats
from tandem.services.serving.cluster_view import WorkerSnapshot
from tandem.services.serving.config import AppConfig

SnapshotSource = Callable[[], list[WorkerSnapshot]]

LEASE_OUTCOMES = ("released", "rejected", "expired")


class WorkerCollector(Collector):
    def __init__(self, model_name: str, source: SnapshotSource) -> None:
        self._model_name = model_name
        self._source = source

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "worker", "role"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=[*labels, *extra])

        info = GaugeMetricFamily("tandem_worker_info",
                                 "1 per worker; its labels give the worker's role.", labels=labels)
        free = GaugeMetricFamily("tandem_kv_cache_free_blocks",
                                 "KV blocks free (cached-but-unused blocks count as free).",
                                 labels=labels)
        total = GaugeMetricFamily("tandem_kv_cache_blocks", "KV blocks in the cache.",
                                  labels=labels)
        capacity = GaugeMetricFamily("tandem_kv_cache_capacity_tokens",
                                     "Tokens the KV cache holds (blocks x block size).",
                                     labels=labels)
        full = GaugeMetricFamily("tandem_kv_cache_max_len_sequences",
                                 "Sequences of max_model_len tokens the KV cache holds at once.",
                                 labels=labels)
        leases = GaugeMetricFamily("tandem_prefill_leases",
                                   "Prompt KV held by a prefill worker for a transfer.",
                                   labels=labels)
        prefills = counter("tandem_prefill_requests", "Prompts a prefill worker prefilled.")
        granted = counter("tandem_prefill_leases_granted",
                          "Leases a prefill worker granted on a prompt's KV blocks.")
        ended = counter("tandem_prefill_leases_ended",
                        "Leases that ended: released (D took the KV), rejected (D or the "
                        "gateway refused it) or expired (nobody came in time).", ("outcome",))
        moved = counter("tandem_kv_transfer_bytes",
                        "KV bytes a decode worker pulled from prefill workers.")
        seconds = HistogramMetricFamily("tandem_kv_transfer_seconds",
                                        "Time a decode worker spent on one KV pull.",
                                        labels=labels)
        transfers = counter("tandem_kv_transfers", "KV pulls by a decode worker.")
        failures = counter("tandem_kv_transfer_failures",
                           "KV pulls that failed (read error, timeout, checksum, lost lease).")
        checksums = counter("tandem_kv_transfer_checksum_failures",
                            "KV pulls whose blocks did not match the prefill worker's CRC32.")
        imports = counter("tandem_decode_kv_imports",
                          "Requests that reached a decode worker with a prefill's KV handle.")
        recomputes = counter("tandem_decode_recomputes",
                             "Imports whose KV pull failed, so the decode worker recomputed "
                             "the prompt.")
        queued = counter("tandem_decode_queued_imports",
                         "Imports a decode worker had no free blocks for: it rejected the "
                         "lease and queued the prompt to prefill itself.")
        healthy = GaugeMetricFamily("tandem_worker_healthy",
                                    "1 while the worker's engine runs; 0 once it stopped after a "
                                    "fault (it is being replaced).", labels=labels)
        rejects = counter("tandem_decode_rejects",
                          "Leases a decode worker rejected, by reason.", ("reason",))
        refusals = counter("tandem_worker_refusals",
                           "Connections and messages a worker refused: no proof of the cluster "
                           "secret, an unsigned pairing or KV handle, a KV read or lease "
                           "release by a worker the lease was not offered to.")
        fallback = GaugeMetricFamily("tandem_kv_transport_fallback",
                                     "1 when the worker moves KV over TCP through host memory "
                                     "because NIXL cannot move its GPU memory (kv_transport "
                                     "auto; the worker logged why).", labels=labels)
        backend = GaugeMetricFamily("tandem_attention_backend",
                                    "1 per worker, labelled with the attention backend its "
                                    "engine runs (auto resolved: cpu, torch, triton, "
                                    "flash_attn); torch on a CPU in bfloat16 means our kernels "
                                    "could not run (the worker logged why).",
                                    labels=[*labels, "backend"])
        for w in self._source():
            key = [self._model_name, w.worker_id, w.role]
            info.add_metric(key, 1)
            if w.attention_backend:
                backend.add_metric([*key, w.attention_backend], 1)
            fallback.add_metric(key, 1.0 if w.kv_transport_fallback else 0.0)
            healthy.add_metric(key, 1.0 if w.healthy else 0.0)
            free.add_metric(key, w.stats.num_free_blocks)
            total.add_metric(key, w.stats.num_blocks)
            tokens = w.stats.num_blocks * w.stats.block_size
            capacity.add_metric(key, tokens)
            if w.max_model_len:
                full.add_metric(key, tokens // w.max_model_len)
            m = w.metrics
            refusals.add_metric(key, _number(m, "refusals"))
            if w.role == "prefill":
                leases.add_metric(key, w.leases)
                prefills.add_metric(key, _number(m, "prefills"))
                granted.add_metric(key, _number(m, "leases_granted"))
                for outcome in LEASE_OUTCOMES:
                    ended.add_metric([*key, outcome], _number(m, f"leases_{outcome}"))
            elif w.role == "decode":
                moved.add_metric(key, _number(m, "bytes_moved"))
                seconds.add_metric(key, _buckets(m.get("transfer_seconds_buckets")),
                                   _number(m, "transfer_seconds"))
                transfers.add_metric(key, _number(m, "transfers"))
                failures.add_metric(key, _number(m, "transfer_failures"))
                checksums.add_metric(key, _number(m, "checksum_failures"))
                imports.add_metric(key, _number(m, "imports"))
                recomputes.add_metric(key, _number(m, "recomputes"))
                queued.add_metric(key, _number(m, "queued"))
                for reason, count in sorted(m.get("rejects", {}).items()):
                    rejects.add_metric([*key, reason], float(count))
        yield from (info, backend, free, total, capacity, full, leases, prefills, granted, ended,
                    moved, seconds, transfers, failures, checksums, imports, recomputes, queued,
                    rejects, healthy, fallback, refusals)


class RouterCollector(Collector):
    """The gateway's router: its decisions by reason and the state of its prefix index."""

    def __init__(self, model_name: str, router: Router) -> None:
        self._model_name = model_name
        self._router = router

    def collect(self) -> Iterator[Metric]:
        status = self._router.status()
        name = [self._model_name]
        decisions = CounterMetricFamily(
            "tandem_router_decisions",
            "Routing decisions by reason (prefix, load, fallback, skip_prefill, round_robin) and "
            "detail (why prefill was skipped or the index was unusable).",
            labels=["model_name", "reason", "detail"])
        for (reason, detail), count in sorted(status.decisions_by_reason.items()):
            decisions.add_metric([*name, reason, detail], count)
        bus = GaugeMetricFamily("tandem_router_bus_connected",
                                "1 while the router reads the workers' KV events; 0: it routes "
                                "by rendezvous hashing (the fallback).", labels=["model_name"])
        bus.add_metric(name, float(status.bus_connected))
        blocks = GaugeMetricFamily("tandem_router_index_blocks",
                                   "Blocks in the router's prefix index, confirmed by KV events.",
                                   labels=["model_name"])
        blocks.add_metric(name, status.index_blocks)
        rebuilds = CounterMetricFamily("tandem_router_index_rebuilds",
                                       "Times the router rebuilt its prefix index from the event "
                                       "stream (its first connection and every reconnection).",
                                       labels=["model_name"])
        rebuilds.add_metric(name, status.rebuilds)
        failovers = CounterMetricFamily(
            "tandem_router_failovers",
            "Calls that found the worker the router chose gone (replica replaced or dead), "
            "then went to another worker.", labels=["model_name", "role", "reason"])
        for (role, reason), count in sorted(status.failovers.items()):
            failovers.add_metric([self._model_name, role, reason], count)
        gaps = CounterMetricFamily(
            "tandem_router_event_gaps",
            "Times a worker's numbered KV events skipped ahead (lost events); each triggers a "
            "snapshot of that worker's cache.", labels=["model_name"])
        gaps.add_metric([self._model_name], status.event_gaps)
        prompt = CounterMetricFamily(
            "tandem_router_prompt_blocks",
            "Full blocks of the prompts routed to a prefill worker while the prefix index was "
            "readable (under any routing policy).", labels=["model_name"])
        prompt.add_metric(name, status.prefix_blocks.get("prompt", 0))
        cached = CounterMetricFamily(
            "tandem_router_cached_blocks",
            "Leading blocks of those prompts cached on any prefill worker (on=any: what prefix "
            "routing could reach) and on the chosen one (on=chosen).",
            labels=["model_name", "on"])
        for where in ("any", "chosen"):
            cached.add_metric([*name, where], status.prefix_blocks.get(where, 0))
        sessions = CounterMetricFamily(
            "tandem_router_session_routes",
            "Decode choices for requests that named a session (prompt_cache_key or session_id): "
            "kept on the session's decode worker, moved off it (gone, or loaded beyond the "
            "slack), or a new session.", labels=["model_name", "outcome"])
        for outcome in ("kept", "moved", "new"):
            sessions.add_metric([*name, outcome], status.session_routes.get(outcome, 0))
        live = GaugeMetricFamily("tandem_router_sessions",
                                 "Sessions the router remembers a decode worker for.",
                                 labels=["model_name"])
        live.add_metric(name, status.sessions)
        yield from (decisions, bus, blocks, rebuilds, failovers, gaps, prompt, cached, sessions,
                    live)


# AppConfig fields the doctor (services/doctor) reads from tandem_config_info: no secrets, no
# file paths.
CONFIG_INFO_FIELDS = ("colocated", "prefill_replicas", "decode_replicas", "routing_policy",
                      "spec", "spec_k", "max_num_seqs", "max_num_batched_tokens", "block_size",
                      "num_kv_blocks", "kv_cache_memory_gb", "kv_cache_dtype", "host_kv_cache_gb",
                      "kv_transport", "weight_format")


class ConfigCollector(Collector):
    """``tandem_config_info``: 1, the serving settings in its labels (like vLLM's
    ``cache_config_info``); ``tandem_gateway_replicas``: the gateways configured (each
    exports it: fewer series than its value are gateways Prometheus does not reach)."""

    def __init__(self, model_name: str, config: AppConfig) -> None:
        self._model_name = model_name
        self._gateways = config.gateway_replicas
        self._labels = {"model_name": model_name,
                        **{name: _label(getattr(config, name)) for name in CONFIG_INFO_FIELDS},
                        "internal_tls": _label(config.internal_tls_ca_file is not None)}

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("tandem_config_info",
                                 "1; its labels are the cluster's serving settings (AppConfig).",
                                 labels=list(self._labels))
        info.add_metric(list(self._labels.values()), 1.0)
        yield info
        gateways = GaugeMetricFamily("tandem_gateway_replicas",
                                     "Gateway replicas configured (gateway_replicas); each "
                                     "gateway exports it.", labels=["model_name"])
        gateways.add_metric([self._model_name], float(self._gateways))
        yield gateways


def _label(value: object) -> str:
    if value is None:
        return ""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _number(metrics: dict[str, Any], key: str) -> float:
    return float(metrics.get(key, 0))


def _buckets(counts: list[int] | None, bounds: Sequence[float] = TRANSFER_SECONDS_BUCKETS
             ) -> list[tuple[str, float]]:
    """Per-bucket counts (the last: above every bound) as Prometheus' cumulative (le, count)
    pairs."""
    counts = counts or [0] * (len(bounds) + 1)
    les = [*(floatToGoString(b) for b in bounds), "+Inf"]
    return [(le, float(c)) for le, c in zip(les, accumulate(counts), strict=True)]


MIGRATION_REASONS = ("replica_gone", "unhealthy", "timeout")


class MigrationCollector(Collector):
    def __init__(self, model_name: str, stats: MigrationStats) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        total = CounterMetricFamily(
            "tandem_request_migrations", "Decode streams moved to another decode worker after "
            "theirs failed: replica_gone (died), unhealthy (its engine stopped), timeout (it "
            "sent nothing for stream_idle_timeout_s).", labels=["model_name", "reason"])
        for reason in MIGRATION_REASONS:
            total.add_metric([self._model_name, reason],
                             self._stats.by_reason.get(reason, 0))
        resume = HistogramMetricFamily(
            "tandem_migration_resume_seconds", "Time from a decode worker's failure to the "
            "migrated stream's next token.", labels=["model_name"])
        resume.add_metric([self._model_name],
                          _buckets(self._stats.resume_buckets, RESUME_SECONDS_BUCKETS),
                          self._stats.resume_sum)
        yield total
        yield resume


def register(registry: CollectorRegistry, model_name: str, source: SnapshotSource,
             router: Router | None = None, migrations: MigrationStats | None = None,
             config: AppConfig | None = None) -> None:
    if config is not None:
        registry.register(ConfigCollector(model_name, config))
    registry.register(WorkerCollector(model_name, source))
    if migrations is not None:
        registry.register(MigrationCollector(model_name, migrations))
    if router is not None:
        registry.register(RouterCollector(model_name, router))
