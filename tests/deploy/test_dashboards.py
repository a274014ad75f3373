"""The Grafana dashboards and the Prometheus alert rules, checked without Grafana or Prometheus
servers: the committed files are what deploy/grafana generates, every dashboard validates against
Grafana 11.6's JSON schemas, every query is valid PromQL (a real ``promtool`` parses it) and
reads only metrics Tandem's own collectors export, and the burn-rate alerts fire on slow and
failing traffic and stay quiet otherwise (``promtool test rules`` evaluates them).

The live counterpart, against a running cluster's /metrics, is tests/e2e/test_dashboard_metrics.py.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from deploy.grafana import dashboards, promql, rules, slo
from deploy.grafana.panels import TENANT, TENANT_SCOPED
from tandem.router import InProcessEventBus, InProcessRegistry, Router, RouterConfig
from tandem.services.gateway import metrics as gateway_metrics
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.handoff.decode import DecodeMetrics
from tandem.services.handoff.prefill import PrefillMetrics
from tandem.services.protocol.block_hash import HashSettings
from tandem.services.protocol.outputs import EngineStats
from tandem.services.serving import metrics as serving_metrics
from tandem.services.serving.backend import MigrationStats
from tandem.services.serving.cluster_view import WorkerSnapshot
from tandem.services.serving.config import AppConfig
from tests.deploy.conftest import SHARED_SCHEMAS, run_promtool

GRAFANA_SCHEMAS = SHARED_SCHEMAS / "grafana"
MODELS = dashboards.dashboards()
RULES = rules.rules()

# What the issue asks each dashboard to show, as the metrics that carry it.
REQUIRED_METRICS = {
    "tandem-slo-overview": {
        "tandem_time_to_first_token_seconds_bucket", "tandem_inter_token_latency_seconds_bucket",
        "tandem_e2e_request_latency_seconds_bucket", "tandem_request_within_slo_total",
        "tandem_request_failures_total", "tandem_num_requests_waiting", "tandem_worker_healthy",
        "tandem_requests_in_flight", "tandem_requests_in_flight_limit",
        "tandem_prompt_tokens_total", "tandem_generation_tokens_total"},
    "tandem-disaggregation": {
        "tandem_worker_healthy", "tandem_num_requests_running", "tandem_kv_cache_usage_perc",
        "tandem_kv_transfer_seconds_bucket", "tandem_kv_transfer_bytes_total",
        "tandem_prefill_leases_ended_total", "tandem_decode_rejects_total",
        "tandem_decode_recomputes_total"},
    "tandem-cache-routing": {
        "tandem_prefix_cache_hits_total", "tandem_prefix_cache_queries_total",
        "tandem_router_decisions_total"},
    "tandem-spec-decode": {
        "tandem_spec_decode_accepted_tokens_total", "tandem_spec_decode_draft_tokens_total",
        "tandem_spec_decode_steps_total"},
}


def all_queries() -> list[str]:
    """Every PromQL expression of every dashboard and alert rule."""
    exprs = [q for m in MODELS.values() for q in dashboards.queries(m)]
    return exprs + rules.expressions(RULES)


def reference_exposition() -> str:
    """/metrics of a gateway with one prefill and one decode worker and a router, built by the
    real collectors (the live page, in the e2e test, must offer the same families)."""
    stats = EngineStats(**{f.name: 0 for f in fields(EngineStats)})
    gateway = GatewayMetrics("model", lambda: {"p": stats, "d": stats})
    snapshots = [WorkerSnapshot("p", "prefill", stats, PrefillMetrics().snapshot()),
                 WorkerSnapshot("d", "decode", stats, DecodeMetrics().snapshot())]
    settings = HashSettings(16, "model")
    router = Router(RouterConfig(settings), InProcessRegistry(settings), InProcessEventBus())
    serving_metrics.register(gateway.registry, "model", lambda: snapshots, router,
                             MigrationStats(), AppConfig())
    return generate_latest(gateway.registry).decode()


def load_schema(name: str, definition: str | None = None) -> dict[str, Any]:
    schema = json.loads((GRAFANA_SCHEMAS / name).read_text())
    if definition is not None:  # one definition of a schema that has no root of its own
        schema = {**schema, "$ref": f"#/definitions/{definition}"}
    return schema


def schema_errors(schema: dict[str, Any], instance: Any) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{e.json_path}: {e.message[:300]}"
            for e in sorted(validator.iter_errors(instance), key=str)]


# -- the committed files ------------------------------------------------------------------------

def test_committed_dashboards_are_what_the_generator_writes() -> None:
    committed = {p.stem: p.read_text() for p in dashboards.OUTPUT_DIR.glob("*.json")}
    generated = {uid: dashboards.encode(model) for uid, model in MODELS.items()}
    assert committed.keys() == generated.keys(), "run: python -m deploy.grafana"
    for uid, text in generated.items():
        assert committed[uid] == text, f"{uid}.json is stale; run: python -m deploy.grafana"


def test_committed_rules_are_what_the_generator_writes() -> None:
    committed = {p.name: p.read_text() for p in rules.OUTPUT_DIR.glob("*.yaml")}
    generated = {p.name: rules.encode(document) for p, document in rules.files().items()}
    assert committed.keys() == generated.keys() == {rules.OUTPUT.name, rules.HEALTH_OUTPUT.name}
    for name, text in generated.items():
        assert committed[name] == text, f"{name} is stale; run: python -m deploy.grafana"
    groups = [g for p in rules.files() for g in yaml.safe_load(committed[p.name])["groups"]]
    assert groups == RULES["groups"]


def test_generator_writes_each_rule_file_and_drops_strays(tmp_path: Path) -> None:
    (tmp_path / "renamed.rules.yaml").write_text("groups: []\n")
    written = rules.write(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)
    assert {p.name: yaml.safe_load(p.read_text()) for p in written} == {
        p.name: document for p, document in rules.files().items()}


def test_generator_writes_each_dashboard_and_drops_strays(tmp_path: Path) -> None:
    (tmp_path / "placeholder.json").write_text("{}")
    written = dashboards.write(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{u}.json" for u in MODELS)
    for path in written:
        assert json.loads(path.read_text()) == MODELS[path.stem]


# -- Grafana's schemas ---------------------------------------------------------------------------

@pytest.mark.parametrize("uid", sorted(MODELS))
def test_dashboard_validates_against_grafana_schema(uid: str) -> None:
    model = MODELS[uid]
    assert schema_errors(load_schema("dashboard-v11.6.jsonschema.json"), model) == []
    prometheus_query = load_schema("prometheus.jsonschema.json")
    options = load_schema("timeseries.jsonschema.json", "Options")
    field_config = load_schema("timeseries.jsonschema.json", "FieldConfig")
    for panel in dashboards.panels(model):
        for target in panel.get("targets", []):
            assert schema_errors(prometheus_query, target) == [], panel["title"]
        if panel["type"] == "timeseries":
            assert schema_errors(options, panel["options"]) == [], panel["title"]
            custom = panel["fieldConfig"]["defaults"].get("custom", {})
            assert schema_errors(field_config, custom) == [], panel["title"]


def test_schema_rejects_a_broken_dashboard() -> None:
    """The validation above can fail: a panel with a null threshold (what Grafana's own export
    writes for -Infinity) and a dashboard without templating are refused."""
    broken = copy.deepcopy(MODELS["tandem-slo-overview"])
    stat_panel = next(p for p in broken["panels"] if p["type"] == "stat")
    stat_panel["fieldConfig"]["defaults"]["thresholds"]["steps"][0]["value"] = None
    del broken["templating"]
    errors = schema_errors(load_schema("dashboard-v11.6.jsonschema.json"), broken)
    assert any("templating" in e for e in errors)
    assert any("panels" in e for e in errors)


@pytest.mark.parametrize("uid", sorted(MODELS))
def test_dashboard_is_well_formed(uid: str) -> None:
    model = MODELS[uid]
    assert model["uid"] == uid and 8 <= len(uid) <= 40
    ids = [p["id"] for p in dashboards.panels(model)]
    assert len(ids) == len(set(ids))
    for panel in dashboards.panels(model):
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel.get("description"), panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)) and all(ref_ids), panel["title"]
        for expr in dashboards.queries({"panels": [panel]}):
            if "vector($" not in expr:  # target lines read no metric
                assert 'model_name=~"$model_name"' in expr, (panel["title"], expr)
            # A series per tenant follows the tenant variable, each time it is read.
            for name, selector in re.findall(r"(\w+)\{([^}]*)\}", expr):
                if name in TENANT_SCOPED:
                    assert TENANT in selector, (panel["title"], expr)
    assert {v["name"] for v in model["templating"]["list"]} >= {"model_name", "tenant"}


@pytest.mark.parametrize("uid", sorted(REQUIRED_METRICS))
def test_dashboard_shows_what_the_issue_asks(uid: str) -> None:
    read = set().union(*(promql.metric_names(q) for q in dashboards.queries(MODELS[uid])))
    assert REQUIRED_METRICS[uid] <= read, REQUIRED_METRICS[uid] - read


# -- metric names --------------------------------------------------------------------------------

@pytest.mark.parametrize(("expr", "names"), [
    ('histogram_quantile(0.99, sum by (le, worker) (rate(a_bucket{le="1.0", x=~"$v"}'
     '[$__rate_interval])))', {"a_bucket"}),
    ("sum(rate(a_total[5m] offset 1h)) / on (model_name) group_left (role) b > bool 0.5",
     {"a_total", "b"}),
    ("max without (instance) (x) + count_values(\"v\", y) unless vector($target) or z @ end()",
     {"x", "y", "z"}),
    ('label_replace(up{job="a"}, "dst", "$1", "src", "(.*)") and ignoring (dst) w[1h:5m]',
     {"up", "w"}),
    ("1 - (sum by (model_name) (rate(c_count[1d])) / 2e3)", {"c_count"}),
])
def test_metric_names_of_an_expression(expr: str, names: set[str]) -> None:
    assert promql.metric_names(expr) == names


@pytest.mark.parametrize("expr", ["sum(rate(x[5m])", 'x{__name__=~"tandem_.*"}', "x{a=~\"b\""])
def test_metric_names_refuses_what_it_cannot_read(expr: str) -> None:
    with pytest.raises(promql.PromQLSyntaxError):
        promql.metric_names(expr)


def test_series_offered_by_an_exposition() -> None:
    page = ("# TYPE a_total counter\n# TYPE b counter\n# TYPE h histogram\n# TYPE g gauge\n"
            "# TYPE s summary\n")
    assert promql.exported_series(page) == {
        "a_total", "b_total", "h_bucket", "h_sum", "h_count", "g", "s", "s_sum", "s_count"}


def test_every_query_reads_only_metrics_tandem_exports() -> None:
    page = reference_exposition()
    variable_metrics = {name for m in MODELS.values() for q in dashboards.variable_queries(m)
                        for name in promql.variable_query_metrics(q)}
    assert variable_metrics <= promql.exported_series(page)
    assert promql.missing_metrics(all_queries(), page) == {}


def test_the_series_per_tenant_are_those_the_gateway_labels_with_the_tenant() -> None:
    metrics = GatewayMetrics("model", dict)
    per_tenant: set[str] = set()
    for metric in (metrics.ttft, metrics.itl, metrics.e2e, metrics.tpot, metrics.success,
                   metrics.failures, metrics.within_slo, metrics.prompt_tokens,
                   metrics.generation_tokens):
        assert "tenant" in metric._labelnames, metric
        kind = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",)}[
            metric._type]
        per_tenant |= {metric._name + suffix for suffix in kind}
    labelled = {name for name, labels in re.findall(r"^(\w+)\{([^}]*)\}",
                                                     generate_latest(metrics.registry).decode(),
                                                     re.MULTILINE)
                if "tenant=" in labels and not name.endswith("_created")}
    assert labelled <= per_tenant == TENANT_SCOPED


def test_a_made_up_metric_is_caught() -> None:
    page = reference_exposition()
    model = copy.deepcopy(MODELS["tandem-disaggregation"])
    panel = next(p for p in model["panels"] if p["type"] == "timeseries")
    panel["targets"][0]["expr"] = "sum(rate(tandem_kv_teleport_total[5m]))"
    # A real family under a suffix it does not have: a counter has no _bucket series.
    panel["targets"].append({"refId": "Z", "expr": "tandem_kv_transfers_bucket"})
    assert promql.missing_metrics(dashboards.queries(model), page).keys() == {
        "tandem_kv_teleport_total", "tandem_kv_transfers_bucket"}
    bad_rules = copy.deepcopy(RULES)
    bad_rules["groups"][0]["rules"][0]["expr"] += " and on () tandem_gpu_temperature > 80"
    assert promql.missing_metrics(rules.expressions(bad_rules), page).keys() == {
        "tandem_gpu_temperature"}


# -- targets and bucket bounds -------------------------------------------------------------------

@pytest.mark.parametrize("target", slo.LATENCY_SLOS, ids=lambda t: t.key)
def test_targets_are_bucket_bounds(target: slo.LatencySlo) -> None:
    """A ratio reads the bucket ``le=<target>``; a bound the histogram lacks selects nothing."""
    bounds = {floatToGoString(b) for b in target.buckets}
    assert target.le in {floatToGoString(c) for c in target.choices}
    assert {floatToGoString(c) for c in target.choices} <= bounds
    page = reference_exposition()
    assert f"# TYPE {target.metric} histogram" in page


def test_goodput_grid_is_the_ttft_and_tpot_choices() -> None:
    cells = set(gateway_metrics.goodput_cells())
    for ttft in slo.TTFT.choices:
        for tpot in slo.TPOT.choices:
            assert (floatToGoString(ttft), floatToGoString(tpot)) in cells


def test_every_le_in_the_rules_is_a_bucket_bound() -> None:
    by_metric = {f"{t.metric}_bucket": {floatToGoString(b) for b in t.buckets}
                 for t in slo.LATENCY_SLOS}
    selectors = re.findall(r'(\w+_bucket)\{le="([^"]+)"\}', "\n".join(rules.expressions(RULES)))
    assert selectors
    for metric, le in selectors:
        assert le in by_metric[metric], (metric, le)


# -- the metrics behind goodput and failures ----------------------------------------------------

def _counter(gateway: GatewayMetrics, name: str, **labels: str) -> float:
    value = gateway.registry.get_sample_value(name, {"model_name": "model", "tenant": "default",
                                                     **labels})
    return 0.0 if value is None else value


def test_goodput_cells_count_requests_meeting_both_targets() -> None:
    gateway = GatewayMetrics("model", dict)
    timer = gateway.start_request(arrival_time=100.0)
    timer.tokens(1, now=100.4)  # TTFT 0.4 s
    timer.tokens(2, now=100.6)
    timer.tokens(1, now=100.7)
    timer.end("length", 10, 4, now=100.7)  # TPOT (0.7 - 0.4) / 3 = 0.1 s
    cell = "tandem_request_within_slo_total"
    assert _counter(gateway, cell, ttft_le="0.5", tpot_le="0.1") == 1
    assert _counter(gateway, cell, ttft_le="10.0", tpot_le="0.5") == 1
    assert _counter(gateway, cell, ttft_le="0.25", tpot_le="0.5") == 0  # TTFT too slow
    assert _counter(gateway, cell, ttft_le="10.0", tpot_le="0.05") == 0  # TPOT too slow
    assert _counter(gateway, "tandem_request_time_per_output_token_seconds_count") == 1
    aborted = gateway.start_request(arrival_time=200.0)
    aborted.tokens(1, now=200.1)
    aborted.end("abort", 10, 1, now=200.2)  # a request the client left is no goodput
    assert _counter(gateway, cell, ttft_le="10.0", tpot_le="0.5") == 1


def test_failure_reasons_queried_are_those_the_gateway_counts() -> None:
    queried = set()
    for expr in all_queries():
        for match in re.finditer(r'tandem_request_failures_total\{[^}]*reason=~?"([^"]+)"', expr):
            queried.update(match.group(1).split("|"))
    assert {"rejected", "invalid", *slo.SERVER_ERRORS} <= queried
    assert queried <= set(gateway_metrics.FAILURE_REASONS)


def test_failures_count_once_and_not_as_ended() -> None:
    gateway = GatewayMetrics("model", dict)
    timer = gateway.start_request()
    timer.fail(gateway_metrics.REJECTED)
    timer.fail(gateway_metrics.ERROR)
    timer.end("abort", 10, 0)
    assert _counter(gateway, "tandem_request_failures_total", reason="rejected") == 1
    assert _counter(gateway, "tandem_request_failures_total", reason="error") == 0
    assert _counter(gateway, "tandem_request_success_total", finished_reason="abort") == 0


def test_kv_transfer_time_is_a_histogram() -> None:
    decode = DecodeMetrics()
    for seconds in (0.0005, 0.003, 0.003, 30.0):
        decode.observe_transfer(seconds)
        decode.transfers += 1
    stats = EngineStats(**{f.name: 0 for f in fields(EngineStats)})
    gateway = GatewayMetrics("model", dict)
    snapshot = WorkerSnapshot("d", "decode", stats, decode.snapshot())
    serving_metrics.register(gateway.registry, "model", lambda: [snapshot])

    def bucket(le: str) -> float | None:
        return gateway.registry.get_sample_value(
            "tandem_kv_transfer_seconds_bucket",
            {"model_name": "model", "worker": "d", "role": "decode", "le": le})

    assert (bucket("0.001"), bucket("0.005"), bucket("10.0"), bucket("+Inf")) == (1, 3, 3, 4)
    labels = {"model_name": "model", "worker": "d", "role": "decode"}
    assert gateway.registry.get_sample_value("tandem_kv_transfer_seconds_count", labels) == 4
    assert gateway.registry.get_sample_value("tandem_kv_transfers_total", labels) == 4


# -- real PromQL: promtool ----------------------------------------------------------------------

def test_every_dashboard_query_is_valid_promql(promtool: str, tmp_path: Path) -> None:
    """Each query, its Grafana variables at their defaults, as a recording rule: promtool parses
    it with Prometheus' own parser (an unknown variable fails earlier, in ``substitute``)."""
    records = []
    for uid, model in MODELS.items():
        defaults = dashboards.variable_defaults(model)
        for i, expr in enumerate(dashboards.queries(model)):
            records.append({"record": f"check:{uid.replace('-', '_')}:{i}",
                            "expr": promql.substitute(expr, defaults)})
    path = tmp_path / "dashboard-queries.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": records}]}))
    result = run_promtool(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(records)} rules found" in result.stdout


def test_substitute_refuses_an_unknown_variable() -> None:
    with pytest.raises(KeyError, match="ttft_targte"):
        promql.substitute("vector($ttft_targte)", {"ttft_target": "1.0"})


def test_alert_rules_pass_promtool_check(promtool: str) -> None:
    documents = rules.files()
    result = run_promtool(promtool, "check", "rules", *map(str, documents))
    assert result.returncode == 0, result.stdout + result.stderr
    for path, document in documents.items():
        assert (f"Checking {path}\n  SUCCESS: {len(rules.expressions(document))} rules found"
                in result.stdout)


def _minutes(duration: str) -> int:
    number, unit = int(duration[:-1]), duration[-1]
    return number * {"m": 1, "h": 60, "d": 1440}[unit]


def _alerts(alert: str, model: str, slo_key: str, windows: list[slo.BurnWindow]
            ) -> dict[str, Any]:
    return {"exp_labels": [
        {"alertname": alert, "model_name": model, "severity": w.severity, "slo": slo_key,
         "long_window": w.long, "short_window": w.short} for w in windows]}


def test_burn_rate_alerts_fire_on_slow_or_failing_traffic(promtool: str, tmp_path: Path) -> None:
    """Synthetic series, one per model, each minute for 90 minutes; evaluated at 70 minutes.

    slow: half of all requests miss the TTFT target throughout -> every TTFT window fires.
    recovered: like slow for an hour, then all fast -> windows whose short window lies in the
    fast 10 minutes stop firing (the short window's job), the others still fire.
    fast: 0.1% slow (the objective allows 1%) -> nothing.
    failing: 2% of requests fail inside Tandem -> every error window fires.
    crashing: 1% fail in an engine and 1% time out (both 5xx) -> every error window fires.
    busy: half the requests are rejected (429) but none fails -> no error alert.
    """
    ttft, itl = slo.TTFT, slo.ITL
    bucket = f'{ttft.metric}_bucket{{le="{ttft.le}", model_name="%s"}}'
    count = f'{ttft.metric}_count{{model_name="%s"}}'
    itl_bucket = f'{itl.metric}_bucket{{le="{itl.le}", model_name="slow_tokens"}}'
    itl_count = f'{itl.metric}_count{{model_name="slow_tokens"}}'
    failures = 'tandem_request_failures_total{model_name="%s", reason="%s"}'
    success = 'tandem_request_success_total{model_name="%s", finished_reason="stop"}'
    series = [
        (bucket % "slow", "0+50x90"), (count % "slow", "0+100x90"),
        (bucket % "recovered", "0+50x60 3100+100x29"), (count % "recovered", "0+100x90"),
        (bucket % "fast", "0+999x90"), (count % "fast", "0+1000x90"),
        (itl_bucket, "0+500x90"), (itl_count, "0+1000x90"),
        (failures % ("failing", "error"), "0+2x90"), (success % "failing", "0+98x90"),
        (failures % ("failing", "rejected"), "0x90"),
        (failures % ("busy", "error"), "0x90"), (failures % ("busy", "rejected"), "0+50x90"),
        (success % "busy", "0+50x90"),
        (failures % ("crashing", "engine_error"), "0+1x90"),
        (failures % ("crashing", "timeout"), "0+1x90"), (success % "crashing", "0+98x90"),
    ]
    windows = list(slo.BURN_WINDOWS)
    still_burning = [w for w in windows if _minutes(w.short) > 10]
    assert 0 < len(still_burning) < len(windows)
    ttft_alert, itl_alert = (f"Tandem{t.key.upper()}BudgetBurn" for t in (ttft, itl))
    expected = {
        ttft_alert: [*_alerts(ttft_alert, "recovered", "ttft", still_burning)["exp_labels"],
                     *_alerts(ttft_alert, "slow", "ttft", windows)["exp_labels"]],
        itl_alert: _alerts(itl_alert, "slow_tokens", "itl", windows)["exp_labels"],
        "TandemErrorBudgetBurn": [
            labels for model in ("crashing", "failing")
            for labels in _alerts("TandemErrorBudgetBurn", model, "errors", windows)["exp_labels"]],
    }
    # The expressions are under test, not the annotation text (promtool would compare it too).
    plain = rules.slo_rules()
    for group in plain["groups"]:
        for rule in group["rules"]:
            del rule["annotations"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(plain))
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series],
            "alert_rule_test": [
                {"eval_time": "70m", "alertname": name,
                 "exp_alerts": [{"exp_labels": {k: v for k, v in labels.items()
                                                if k != "alertname"}} for labels in alerts]}
                for name, alerts in expected.items()],
        }],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = run_promtool(promtool, "test", "rules", str(tmp_path / "test.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr

    # And the test itself can fail: expecting the recovered model's fast page is wrong.
    test["tests"][0]["alert_rule_test"][0]["exp_alerts"].append({"exp_labels": {
        "model_name": "recovered", "severity": "page", "slo": "ttft",
        "long_window": windows[0].long, "short_window": windows[0].short}})
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    assert run_promtool(promtool, "test", "rules", str(tmp_path / "test.yaml")).returncode != 0
