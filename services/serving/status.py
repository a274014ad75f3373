"""``tandem status``: a running cluster at a glance, from its gateway's own /health, /v1/models
and /metrics (no Ray access): the gateway's health and load, then one row per worker."""

from __future__ import annotations

import json
import ssl
import sys
import urllib.error
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from tandem.services.serving.up_stats import bearer, ca_context, metric_samples, read_text

ID_WIDTH = 16  # longer worker ids are shortened in the table (never in --json)

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_UNREACHABLE = 0, 1, 2


class StatusError(Exception):
    """The gateway could not be read: one line for ``tandem: error: ...`` (exit 2)."""


@dataclass(frozen=True)
class WorkerRow:
    """One worker (or the colocated engine); None where the gateway has no series for it."""

    worker: str
    role: str
    healthy: bool | None = None
    running: int | None = None
    waiting: int | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    kv_usage: float | None = None  # 0..1
    prefix_hit_rate: float | None = None  # 0..1, since the worker started; None: no lookups
    leases: int | None = None  # prefill
    kv_transfers: int | None = None  # decode
    kv_transfer_failures: int | None = None  # decode
    recomputes: int | None = None  # decode
    refusals: int | None = None


@dataclass(frozen=True)
class ClusterStatus:
    url: str
    model: str | None
    healthy: bool  # the gateway's /health
    reason: str | None  # why not, as /health says
    in_flight: int | None
    in_flight_limit: int | None  # 0: none
    running: int | None
    waiting: int | None
    workers: list[WorkerRow]

    @property
    def exit_code(self) -> int:
        ok = self.healthy and all(w.healthy is not False for w in self.workers)
        return EXIT_HEALTHY if ok else EXIT_UNHEALTHY

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "exit_code": self.exit_code}


Series = dict[str, dict[str, float]]  # metric name -> worker -> value (summed over other labels)


def metric_series(metrics_text: str) -> tuple[Series, dict[str, str], str | None]:
    """Per-worker values of every series, each worker's role, and the model_name label."""
    values: Series = defaultdict(dict)
    roles: dict[str, str] = {}
    model = None
    for sample in metric_samples(metrics_text):
        labels = sample.labels
        model = model or labels.get("model_name")
        worker = labels.get("worker", "")
        by_worker = values[sample.name]
        by_worker[worker] = by_worker.get(worker, 0.0) + sample.value
        if sample.name == "tandem_worker_info":
            roles[worker] = labels.get("role", "")
    return values, roles, model


def cluster_status(metrics_text: str, url: str = "", healthy: bool = True,
                   reason: str | None = None, model: str | None = None) -> ClusterStatus:
    """The status from one read of /metrics and /health (``model``: /v1/models' id; the
    metrics' ``model_name`` without it)."""
    values, roles, model_name = metric_series(metrics_text)

    def number(name: str, worker: str) -> int | None:
        value = values.get(name, {}).get(worker)
        return None if value is None else int(value)

    engine_workers = values.get("tandem_num_requests_running", {})
    workers = sorted({*roles, *engine_workers} - {""},
                     key=lambda w: ({"prefill": 0, "decode": 1}.get(roles.get(w, ""), 2), w))
    rows = []
    for worker in workers:
        role = roles.get(worker) or ("colocated" if worker == "colocated" else "-")
        total = number("tandem_kv_cache_blocks", worker)
        free = number("tandem_kv_cache_free_blocks", worker)
        used = None if total is None or free is None else total - free
        usage = values.get("tandem_kv_cache_usage_perc", {}).get(worker)
        if used is not None and total:
            usage = used / total
        queries = values.get("tandem_prefix_cache_queries_total", {}).get(worker)
        hits = values.get("tandem_prefix_cache_hits_total", {}).get(worker)
        healthy_value = values.get("tandem_worker_healthy", {}).get(worker)
        rows.append(WorkerRow(
            worker=worker, role=role,
            healthy=None if healthy_value is None else healthy_value >= 1,
            running=number("tandem_num_requests_running", worker),
            waiting=number("tandem_num_requests_waiting", worker),
            kv_blocks_used=used, kv_blocks_total=total, kv_usage=usage,
            prefix_hit_rate=hits / queries if queries and hits is not None else None,
            leases=number("tandem_prefill_leases", worker),
            kv_transfers=number("tandem_kv_transfers_total", worker),
            kv_transfer_failures=number("tandem_kv_transfer_failures_total", worker),
            recomputes=number("tandem_decode_recomputes_total", worker),
            refusals=number("tandem_worker_refusals_total", worker)))

    def gateway(name: str) -> int | None:
        by_worker = values.get(name)
        return None if by_worker is None else int(sum(by_worker.values()))

    return ClusterStatus(url=url, model=model or model_name, healthy=healthy, reason=reason,
                         in_flight=gateway("tandem_requests_in_flight"),
                         in_flight_limit=gateway("tandem_requests_in_flight_limit"),
                         running=gateway("tandem_num_requests_running"),
                         waiting=gateway("tandem_num_requests_waiting"), workers=rows)


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def short_id(worker: str, width: int = ID_WIDTH) -> str:
    return worker if len(worker) <= width else worker[:width - 3] + "..."


def render(status: ClusterStatus) -> str:
    """The header and the table, as ``tandem status`` prints them."""
    health = "healthy" if status.healthy else f"UNHEALTHY: {status.reason or 'no reason given'}"
    limit = ("" if status.in_flight_limit is None
             else f" / {status.in_flight_limit or 'no limit'}")
    lines = [f"model {status.model or '-'} at {status.url}: gateway {health}",
             f"requests: {_cell(status.in_flight)} in flight{limit} | sequences: "
             f"{_cell(status.running)} running, {_cell(status.waiting)} waiting"]
    header = ["WORKER", "ROLE", "HEALTHY", "RUN+WAIT", "KV BLOCKS", "KV USE", "PREFIX HIT",
              "LEASES", "TRANSFERS", "RECOMPUTES", "REFUSALS"]
    table = [header]
    for w in status.workers:
        seqs = "-" if w.running is None else f"{w.running}+{w.waiting or 0}"
        blocks = ("-" if w.kv_blocks_total is None
                  else f"{_cell(w.kv_blocks_used)}/{w.kv_blocks_total}")
        transfers = ("-" if w.kv_transfers is None else
                     f"{w.kv_transfers}" + (f" ({w.kv_transfer_failures} failed)"
                                            if w.kv_transfer_failures else ""))
        table.append([short_id(w.worker), w.role,
                      "-" if w.healthy is None else ("yes" if w.healthy else "NO"), seqs, blocks,
                      _percent(w.kv_usage), _percent(w.prefix_hit_rate), _cell(w.leases),
                      transfers, _cell(w.recomputes), _cell(w.refusals)])
    if not status.workers:
        lines.append("no workers in /metrics")
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines.append("")
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip() for row in table]
    return "\n".join(lines)


# Reading the gateway


def _reason(exc: OSError) -> str:
    reason: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError):
        return "timed out"
    if isinstance(reason, ssl.SSLCertVerificationError):
        return f"certificate not trusted ({reason.verify_message}; --cacert PEM?)"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason)


class GatewayReader:
    """GETs from a gateway's HTTP front end; every failure is a ``StatusError`` of one line."""

    def __init__(self, url: str, api_key: str | None = None, cacert: str | None = None,
                 timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        try:
            self.context = ca_context(cacert)
        except OSError as exc:  # a missing or bad PEM file
            raise StatusError(f"--cacert {cacert}: {exc}") from exc
        self.api_key = api_key
        self.headers = bearer(api_key)
        self.timeout_s = timeout_s

    def get(self, path: str) -> str:
        """The body; raises ``urllib.error.HTTPError`` for a status >= 400, else
        ``StatusError``."""
        try:
            return read_text(f"{self.url}{path}", self.headers, self.context, self.timeout_s)
        except urllib.error.HTTPError:
            raise
        except OSError as exc:
            raise StatusError(f"cannot reach {self.url}: {_reason(exc)}") from exc

    def metrics(self) -> str:
        """/metrics' text; raises ``StatusError``."""
        try:
            return self.get("/metrics")
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise StatusError("/metrics needs an API key (--api-key)" if self.api_key is None
                                  else "/metrics refused the API key (401)") from exc
            raise StatusError(f"{self.url}/metrics answered HTTP {exc.code}") from exc


def read_status(url: str, api_key: str | None = None, cacert: str | None = None,
                timeout_s: float = 5.0) -> ClusterStatus:
    """Reads /health, /metrics and /v1/models; raises ``StatusError``."""
    reader = GatewayReader(url, api_key, cacert, timeout_s)
    url = reader.url
    healthy, reason = True, None
    try:
        reader.get("/health")
    except urllib.error.HTTPError as exc:
        if exc.code != 503:
            raise StatusError(f"{url}/health answered HTTP {exc.code}") from exc
        healthy, reason = False, _health_reason(exc)
    metrics_text = reader.metrics()
    model = None
    try:
        models = json.loads(reader.get("/v1/models"))
        model = ", ".join(str(card["id"]) for card in models["data"]) or None
    except urllib.error.HTTPError as exc:  # 401 without a key: the metrics name it
        if exc.code != 401:
            raise StatusError(f"{url}/v1/models answered HTTP {exc.code}") from exc
    except (ValueError, KeyError, TypeError):
        pass  # not Tandem's shape: the metrics name it
    try:
        return cluster_status(metrics_text, url, healthy, reason, model)
    except ValueError as exc:  # the parser's: not what a Tandem gateway writes
        raise StatusError(f"{url}/metrics is not Prometheus text ({exc})") from exc


def _health_reason(exc: urllib.error.HTTPError) -> str | None:
    try:
        return str(json.loads(exc.read().decode())["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run(url: str, api_key: str | None, cacert: str | None, timeout_s: float,
        as_json: bool) -> int:
    try:
        status = read_status(url, api_key, cacert, timeout_s)
    except StatusError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
    print(json.dumps(status.to_json(), indent=2) if as_json else render(status), flush=True)
    return status.exit_code
