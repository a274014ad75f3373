"""Every metric the Grafana dashboards and the alert rules query is on a live cluster's /metrics,
and a real Prometheus scraping that cluster answers every query.

A real `tandem up` (1 prefill + 1 decode, KV over NIXL) serves a few requests while a real
Prometheus (the ``prometheus`` binary of the Debian package that also ships ``promtool``)
scrapes it every second and loads the alert rules. The page must offer every series the
dashboards and rules select (a family counts once its ``# TYPE`` line is there), every bucket
bound and goodput cell their variables can pick; Prometheus must evaluate every dashboard query
without error (joins, grouping) and with data where the traffic sent produces some, and every
alert rule without error. The new series must agree with each other and with the traffic.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.utils import floatToGoString

from deploy.grafana import dashboards, promql, rules, slo
from tests.e2e.cluster import UpProcess, free_port, metric_values, per_worker, wait_for

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
PROMPT_BLOCKS = 4
REQUESTS = 3
MAX_TOKENS = 4
ROUTING_REASONS = {"prefix", "load", "fallback", "skip_prefill", "round_robin"}
SCRAPE_S = 1
# Grafana's $__rate_interval for a 1 s scrape: wide enough for several samples, short enough
# that the requests sent here are inside it.
RATE_INTERVAL = "20s"
# Panels whose queries may rightly be empty here: nothing was rejected, no spec decoding runs.
MAY_BE_EMPTY = {"Decode rejects by reason"}


def _total(values: dict[tuple[tuple[str, str], ...], float], **labels: str) -> float:
    return sum(v for k, v in values.items() if labels.items() <= dict(k).items())


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) ``expr`` evaluates to now."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        # A starting Prometheus answers 503 "Service Unavailable" (not JSON) until its TSDB is up.
        assert response.status_code == 200, (expr, response.status_code, response.text[:300])
        body = response.json()
        assert body["status"] == "success", (expr, body)
        data = body["data"]
        return data["result"] if data["resultType"] == "vector" else [{"value": data["result"]}]

    def value(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else 0.0


@pytest.fixture(scope="module")
def prometheus(cluster: UpProcess, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: .ci/setup-test installs it (Debian package prometheus)"
    home = tmp_path_factory.mktemp("prometheus")
    target = cluster.http_url.removeprefix("http://")
    (home / "rules.yaml").write_text(rules.encode(rules.rules()))
    (home / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(home / "rules.yaml")],
        "scrape_configs": [{"job_name": "tandem", "static_configs": [{"targets": [target]}]}],
    }))
    port = free_port()
    log = (home / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [binary, f"--config.file={home / 'prometheus.yml'}",
         f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}", process)
    try:
        def scraping() -> bool:
            assert process.poll() is None, (home / "prometheus.log").read_text()[-3000:]
            try:
                return server.value('count_over_time(up{job="tandem"}[1m]) and up == 1') >= 2
            except (httpx.HTTPError, AssertionError):
                return False

        wait_for(scraping, 60, "Prometheus to scrape the cluster twice")
        yield server
    finally:
        process.terminate()
        process.wait(30)
        log.close()


# Counters this module's checks compare before and after its own traffic (the shared cluster
# has served other modules' requests).
DELTAS = ("tandem_router_decisions_total", "tandem_decode_recomputes_total",
          "tandem_request_failures_total")


@pytest.fixture(scope="module")
def before(cluster: UpProcess) -> dict[str, float]:
    return {name: _total(metric_values(cluster.http_url, name)) for name in DELTAS}


@pytest.fixture(scope="module")
def served(cluster: UpProcess, prometheus: Prometheus, before: dict[str, float]) -> UpProcess:
    """The cluster after REQUESTS distinct prompts (each prefilled on P, its KV pulled by D),
    once the gateway has polled the workers' counters and Prometheus has scraped them."""
    for i in range(REQUESTS):
        prompt = [2000 + 101 * i + t for t in range(PROMPT_BLOCKS * BLOCK)]
        response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
    wait_for(lambda: prometheus.value("sum(tandem_kv_transfers_total)") >= 1
             and prometheus.value('sum(tandem_prefill_leases_ended_total{outcome="released"})')
             >= 1 and prometheus.value("sum(tandem_request_success_total)") >= REQUESTS,
             30, "the gateway to poll the workers' counters and Prometheus to scrape them")
    return cluster


def test_every_queried_metric_is_exported(served: UpProcess) -> None:
    page = httpx.get(f"{served.http_url}/metrics", timeout=10).text
    models = dashboards.dashboards().values()
    exprs = [q for m in models for q in dashboards.queries(m)]
    exprs += rules.expressions(rules.rules())
    assert promql.missing_metrics(exprs, page) == {}
    variable_metrics = {name for m in models for q in dashboards.variable_queries(m)
                        for name in promql.variable_query_metrics(q)}
    assert variable_metrics <= promql.exported_series(page)


def test_prometheus_answers_every_dashboard_query(served: UpProcess,
                                                  prometheus: Prometheus) -> None:
    model_names = {s["metric"]["model_name"] for s in prometheus.query(
        "group by (model_name) (tandem_num_requests_running)")}
    assert len(model_names) == 1

    def empty_panels() -> set[str]:
        """Titles of panels with a query that returns nothing (any error fails at once)."""
        empty = set()
        for model in dashboards.dashboards().values():
            values = {**dashboards.variable_defaults(model), "__rate_interval": RATE_INTERVAL}
            for panel in dashboards.panels(model):
                for target in panel.get("targets", []):
                    if not prometheus.query(promql.substitute(target["expr"], values)):
                        empty.add(panel["title"])
        return empty

    # A series that appeared with the requests needs two scrapes before rate() sees it.
    deadline = time.monotonic() + 30
    while (empty := empty_panels() - MAY_BE_EMPTY) and time.monotonic() < deadline:
        time.sleep(SCRAPE_S / 4)  # poll interval while waiting for the next scrapes
    assert not empty, f"panels with no data: {sorted(empty)}"


def test_prometheus_evaluates_every_alert_rule(served: UpProcess,
                                               prometheus: Prometheus) -> None:
    want = len(rules.expressions(rules.rules()))

    def evaluated() -> list[dict[str, Any]]:
        body = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=10).json()
        found = [r for g in body["data"]["groups"] for r in g["rules"]]
        never = "0001-01-01T00:00:00Z"  # Go's zero time: not evaluated yet
        done = len(found) == want and all(r["lastEvaluation"] != never for r in found)
        return found if done else []

    wait_for(lambda: bool(evaluated()), 30, "Prometheus to evaluate every rule")
    for rule in evaluated():
        # Whether one fires depends on this machine's speed; that it evaluates does not.
        assert rule["health"] == "ok" and not rule.get("lastError"), rule


@pytest.mark.parametrize("target", slo.LATENCY_SLOS, ids=lambda t: t.key)
def test_selected_bucket_bounds_exist(served: UpProcess, target: slo.LatencySlo) -> None:
    """Each bound a target variable offers, and the alert's threshold, is a live bucket."""
    buckets = metric_values(served.http_url, f"{target.metric}_bucket")
    live = {dict(labels)["le"] for labels in buckets}
    wanted = {floatToGoString(c) for c in target.choices} | {target.le}
    assert wanted <= live, wanted - live
    assert _total(metric_values(served.http_url, f"{target.metric}_count")) >= REQUESTS


def test_goodput_cells_exist_and_are_consistent(served: UpProcess) -> None:
    url = served.http_url
    cells = {(dict(k)["ttft_le"], dict(k)["tpot_le"]): v
             for k, v in metric_values(url, "tandem_request_within_slo_total").items()}
    ttft = [floatToGoString(c) for c in slo.TTFT.choices]
    tpot = [floatToGoString(c) for c in slo.TPOT.choices]
    assert {(t, p) for t in ttft for p in tpot} <= cells.keys()
    success = metric_values(url, "tandem_request_success_total")
    finished = (_total(success, finished_reason="length")
                + _total(success, finished_reason="stop"))
    assert finished >= REQUESTS
    # A looser target never counts fewer requests, and none counts more than finished.
    for i, t in enumerate(ttft):
        for j, p in enumerate(tpot):
            assert cells[t, p] <= finished
            if i:
                assert cells[ttft[i - 1], p] <= cells[t, p]
            if j:
                assert cells[t, tpot[j - 1]] <= cells[t, p]
    tpot_count = _total(metric_values(url, "tandem_request_time_per_output_token_seconds_count"))
    assert tpot_count == finished  # every request sent had MAX_TOKENS > 1 tokens


def test_worker_and_router_series_agree_with_the_traffic(served: UpProcess,
                                                          before: dict[str, float]) -> None:
    url = served.http_url

    def added(name: str) -> float:
        return _total(metric_values(url, name)) - before[name]

    roles = {dict(k)["worker"]: dict(k)["role"] for k in metric_values(url, "tandem_worker_info")}
    assert sorted(roles.values()) == ["decode", "prefill"]

    decisions = metric_values(url, "tandem_router_decisions_total")
    assert {dict(k)["reason"] for k in decisions} <= ROUTING_REASONS
    assert added("tandem_router_decisions_total") == REQUESTS  # each request decided once
    connected = metric_values(url, "tandem_router_bus_connected")
    assert connected and all(v == 1 for v in connected.values())

    # The transfer histogram and the transfer counter are two views of the same pulls.
    count = per_worker(metric_values(url, "tandem_kv_transfer_seconds_count"))
    transfers = per_worker(metric_values(url, "tandem_kv_transfers_total"))
    assert count == transfers and sum(count.values()) >= 1
    assert {roles[w] for w in count} == {"decode"}
    moved = per_worker(metric_values(url, "tandem_kv_transfer_bytes_total"))
    assert all(moved[w] > 0 for w, n in transfers.items() if n)

    ended = metric_values(url, "tandem_prefill_leases_ended_total")
    assert {dict(k)["outcome"] for k in ended} == {"released", "rejected", "expired"}
    granted = _total(metric_values(url, "tandem_prefill_leases_granted_total"))
    assert granted >= _total(ended) >= 1
    assert _total(metric_values(url, "tandem_prefill_requests_total")) >= granted
    assert added("tandem_decode_recomputes_total") == 0
    assert added("tandem_request_failures_total") == 0
