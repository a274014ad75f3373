"""Tandem's Grafana dashboards as code: SLO overview, disaggregation, cache and routing,
speculative decoding. ``python -m deploy.grafana.dashboards`` writes them as JSON into the Helm
chart (``deploy/helm/tandem/dashboards/<uid>.json``), which ships each as a ConfigMap for
Grafana's dashboard sidecar; a test fails when the committed files differ from this code.

Every gateway reports every worker's series (it polls them all), so per-worker series are
de-duplicated with ``max by (worker)`` before they are summed; series the gateway measures
itself (latency, requests, routing) are summed across gateways.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dashboard_m
from prometheus_client.utils import floatToGoString

from deploy.grafana import slo
from deploy.grafana.panels import (
    DATASOURCE,
    GREEN,
    MODEL,
    RED,
    Query,
    label,
    quantile,
    rate,
    single_stat,
    target_line,
    time_series,
)

REPO = Path(__file__).resolve().parents[2]
OUTPUT_DIR = REPO / "deploy" / "helm" / "tandem" / "dashboards"
TAG = "tandem"
QUANTILES = (0.5, 0.9, 0.99)

SUCCESS = "tandem_request_success_total"
FAILURES = "tandem_request_failures_total"
WITHIN_SLO = "tandem_request_within_slo_total"
PROMPT_TOKENS = "tandem_prompt_tokens_total"
GENERATION_TOKENS = "tandem_generation_tokens_total"


def _base(uid: str, title: str, description: str,
          variables: Sequence[dashboard_b.QueryVariable | dashboard_b.CustomVariable] = ()
          ) -> dashboard_b.Dashboard:
    board = (dashboard_b.Dashboard(title).uid(uid).description(description).tags([TAG])
             .time("now-1h", "now").refresh("30s").timezone("browser")
             .tooltip(dashboard_m.DashboardCursorSync.CROSSHAIR)
             .link(dashboard_b.DashboardLink("Tandem dashboards")
                   .type(dashboard_m.DashboardLinkType.DASHBOARDS).tags([TAG])
                   .as_dropdown(True).include_vars(True).keep_time(True))
             .with_variable(dashboard_b.DatasourceVariable("datasource").label("Data source")
                            .type("prometheus"))
             .with_variable(dashboard_b.QueryVariable("model_name").label("Model")
                            .datasource(DATASOURCE)
                            .query("label_values(tandem_num_requests_running, model_name)")
                            .refresh(dashboard_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
                            .sort(dashboard_m.VariableSort.ALPHABETICAL_ASC)
                            .multi(True).include_all(True).all_value(".*")
                            .current(dashboard_m.VariableOption(text="All", value="$__all")))
             .with_variable(dashboard_b.QueryVariable("tenant").label("Tenant")
                            .description("Whose API key sent the requests (the panels over "
                                         "per-request series follow it; per-worker ones do not).")
                            .datasource(DATASOURCE)
                            .query(f"label_values({SUCCESS}, tenant)")
                            .refresh(dashboard_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
                            .sort(dashboard_m.VariableSort.ALPHABETICAL_ASC)
                            .multi(True).include_all(True).all_value(".*")
                            .current(dashboard_m.VariableOption(text="All", value="$__all"))))
    for variable in variables:
        board = board.with_variable(variable)
    return board


def _target_variable(target: slo.LatencySlo) -> dashboard_b.CustomVariable:
    values = [floatToGoString(v) for v in target.choices]
    assert target.le in values, f"{target.key}: the default target must be one of the choices"
    return (dashboard_b.CustomVariable(target.variable).label(f"{target.key.upper()} target (s)")
            .description(f"{target.title} target in seconds; the choices are bucket bounds of "
                         f"{target.metric}.")
            .values(",".join(values)).allow_custom_value(False)
            .current(dashboard_m.VariableOption(selected=True, text=target.le, value=target.le))
            .options([dashboard_m.VariableOption(selected=v == target.le, text=v, value=v)
                      for v in values]))


def _bucket_rate(target: slo.LatencySlo, selector: str = "") -> str:
    return rate(f"{target.metric}_bucket", selector)


def _within(target: slo.LatencySlo) -> str:
    """Share of the target's events within the chosen target (a bucket over the count)."""
    within = _bucket_rate(target, label("le", f"${target.variable}"))
    return f"sum({within}) / sum({rate(target.metric + '_count')})"


def _latency_panel(target: slo.LatencySlo, unit_of: str) -> timeseries.Panel:
    queries = [Query(quantile(q, _bucket_rate(target)), f"p{round(q * 100)}") for q in QUANTILES]
    return time_series(
        f"{target.title} p50 / p90 / p99", f"{target.title} per {unit_of}, against the target "
        f"chosen above (dashed red; default {target.threshold_s} s, see deploy/grafana/slo.py). "
        f"p99 above the line: see docs/operations.md, Reading the dashboards.",
        [*queries, target_line(target.variable)], "s", width=12)


def _all_requests() -> str:
    return f"(sum({rate(SUCCESS)}) + sum({rate(FAILURES)}))"


def _failure_ratio(reason: str, op: str = "=") -> str:
    return f"sum({rate(FAILURES, label('reason', reason, op))}) / {_all_requests()}"


def _healthy_workers(aggregate: str) -> str:
    """Workers per role (``count``) or healthy ones (``sum``), each worker once."""
    return (f"{aggregate} by (role) (max by (worker, role) "
            f"(tandem_worker_healthy{{{MODEL}}}))")


def _goodput() -> str:
    cell = (f"{label('ttft_le', '$' + slo.TTFT.variable)}, "
            f"{label('tpot_le', '$' + slo.TPOT.variable)}")
    return f"sum({rate(WITHIN_SLO, cell)})"


def _finished() -> str:
    return f"sum({rate(SUCCESS, label('finished_reason', 'abort', '!='))})"


def slo_overview() -> dashboard_b.Dashboard:
    board = _base("tandem-slo-overview", "Tandem / SLO overview",
                  "Latency against targets, goodput, errors, rejections and queue depth.",
                  [_target_variable(t) for t in slo.LATENCY_SLOS])
    p99 = {t.key: quantile(0.99, _bucket_rate(t)) for t in slo.LATENCY_SLOS}
    board = (
        board.with_row(dashboard_b.Row("Now"))
        .with_panel(single_stat("TTFT p99", f"Red above {slo.TTFT.threshold_s} s.",
                                Query(p99["ttft"]), "s",
                                steps=[(slo.TTFT.threshold_s, RED)]))
        .with_panel(single_stat("ITL p99", f"Red above {slo.ITL.threshold_s} s.",
                                Query(p99["itl"]), "s", steps=[(slo.ITL.threshold_s, RED)]))
        .with_panel(single_stat(
            "Goodput share", "Finished requests within both the TTFT and the TPOT target "
            f"chosen above; red below {slo.GOODPUT_OBJECTIVE:.0%}.",
            Query(f"{_goodput()} / {_finished()}"), "percentunit",
            steps=[(slo.GOODPUT_OBJECTIVE, GREEN)], base=RED))
        .with_panel(single_stat(
            "Error ratio", f"Requests that failed inside Tandem ({', '.join(slo.SERVER_ERRORS)}"
            f": the 5xx answers); red above {1 - slo.AVAILABILITY_OBJECTIVE:.1%} (the "
            "availability objective's budget).",
            Query(_failure_ratio("|".join(slo.SERVER_ERRORS), "=~")), "percentunit",
            steps=[(1 - slo.AVAILABILITY_OBJECTIVE, RED)]))
        .with_panel(single_stat(
            "Rejected (429)", f"Requests turned away because queues were full; red above "
            f"{slo.REJECTION_WARN:.0%}.", Query(_failure_ratio("rejected")), "percentunit",
            steps=[(slo.REJECTION_WARN, RED)]))
        .with_panel(single_stat(
            "Queue depth", "Requests waiting to be scheduled, all workers.",
            Query(f"sum(max by (worker) (tandem_num_requests_waiting{{{MODEL}}}))"), "short"))
        .with_row(dashboard_b.Row("Latency against targets"))
        .with_panel(_latency_panel(slo.TTFT, "request"))
        .with_panel(_latency_panel(slo.ITL, "token"))
        .with_panel(_latency_panel(slo.TPOT, "request (E2E - TTFT over the tokens after the "
                                             "first)"))
        .with_panel(_latency_panel(slo.E2E, "request"))
        .with_row(dashboard_b.Row("SLO attainment"))
        .with_panel(time_series(
            "Share within target", "Share of requests (TTFT, TPOT, E2E) and tokens (ITL) "
            f"within the targets chosen above; dashed line: the {slo.TTFT.objective:.0%} "
            "objective.",
            [Query(_within(t), f"{t.key.upper()} <= ${t.variable} s")
             for t in slo.LATENCY_SLOS],
            "percentunit", width=12, steps=[(slo.TTFT.objective, GREEN)], base=RED,
            soft_max=1))
        .with_panel(time_series(
            "Goodput", "Requests per second that finished within both the TTFT and the TPOT "
            "target, against all finished requests.",
            [Query(_goodput(), "goodput"), Query(_finished(), "finished")], "reqps", width=12))
        .with_row(dashboard_b.Row("Errors, rejections and queues"))
        .with_panel(time_series(
            "Failure ratios", "Failed requests over all requests by reason: engine_error (a "
            "worker's engine failed, 500), timeout (deadline passed, 504), unavailable (no "
            "healthy worker, 503), error (other, inside Tandem), rejected (429, overloaded), "
            "invalid (400). Dashed: the error budget of the 5xx reasons together.",
            [Query(_failure_ratio(r), r) for r in (*slo.SERVER_ERRORS, "rejected", "invalid")],
            "percentunit", steps=[(1 - slo.AVAILABILITY_OBJECTIVE, RED)]))
        .with_panel(time_series(
            "Requests by outcome", "Ended requests by finish reason (abort: the client left), "
            "and failed requests by reason.",
            [Query(f"sum by (finished_reason) ({rate(SUCCESS)})", "{{finished_reason}}"),
             Query(f"sum by (reason) ({rate(FAILURES)})", "failed: {{reason}}")],
            "reqps", stacked=True))
        .with_panel(time_series(
            "Queue depth per worker", "Requests waiting (dashed: running) per worker.",
            [Query(f"max by (worker) (tandem_num_requests_waiting{{{MODEL}}})",
                   "waiting {{worker}}"),
             Query(f"max by (worker) (tandem_num_requests_running{{{MODEL}}})",
                   "running {{worker}}")], "short"))
        .with_row(dashboard_b.Row("Throughput"))
        .with_panel(time_series(
            "Tokens per second", "Prompt tokens (those of every ended request, cached ones "
            "included) and generated tokens per second, of the tenants chosen above.",
            [Query(f"sum({rate(PROMPT_TOKENS)})", "prompt"),
             Query(f"sum({rate(GENERATION_TOKENS)})", "generation")], "short", width=12))
        .with_panel(time_series(
            "Generated tokens per second by tenant", "Each tenant's share of the output.",
            [Query(f"sum by (tenant) ({rate(GENERATION_TOKENS)})", "{{tenant}}")], "short",
            width=12, stacked=True))
        .with_row(dashboard_b.Row("Workers and admission"))
        .with_panel(time_series(
            "Healthy workers by role", "Workers whose engine reports healthy, against all "
            "workers the gateways poll, per role. No healthy worker of a role: its requests "
            "fail (alert TandemWorkerDown).",
            [Query(_healthy_workers("sum"), "healthy {{role}}"),
             Query(_healthy_workers("count"), "all {{role}}")], "short", width=12))
        .with_panel(time_series(
            "Requests in flight vs limit", "Requests the gateways admitted and have not "
            "finished, against their admission limit (beyond it: 429; a limit of 0 is none).",
            [Query(f"sum by (model_name) (tandem_requests_in_flight{{{MODEL}}})",
                   "in flight {{model_name}}"),
             Query(f"sum by (model_name) (tandem_requests_in_flight_limit{{{MODEL}}})",
                   "limit {{model_name}}")], "short", width=12))
    )
    return board


def _per_worker(series: str) -> str:
    """A per-worker series with the worker's role, one per worker."""
    info = f"max by (model_name, worker, role) (tandem_worker_info{{{MODEL}}})"
    return (f"max by (worker, role) ({series}{{{MODEL}}} * on (model_name, worker) "
            f"group_left (role) {info})")


def _worker_rate(metric: str, selector: str = "", by: str = "worker") -> str:
    return f"max by ({by}) ({rate(metric, selector)})"


def disaggregation() -> dashboard_b.Dashboard:
    transfer = "tandem_kv_transfer_seconds"
    transfer_buckets = f"max by (le, worker) ({rate(transfer + '_bucket')})"
    ended = _worker_rate("tandem_prefill_leases_ended_total", by="worker, outcome")
    rejects = _worker_rate("tandem_decode_rejects_total", by="worker, reason")
    expired = label("outcome", "expired")
    return (
        _base("tandem-disaggregation", "Tandem / Disaggregation",
              "Prefill and decode workers: load, KV cache, KV transfer, leases, rejects and "
              "recomputes.")
        .with_row(dashboard_b.Row("Load per worker"))
        .with_panel(time_series(
            "Worker health", "1 while a worker's engine reports healthy, 0 after it reported "
            "a fault (the router avoids it until Ray Serve replaces it).",
            [Query(f"max by (worker, role) (tandem_worker_healthy{{{MODEL}}})",
                   "{{role}} {{worker}}")], "short", width=6, steps=[(1, GREEN)], base=RED,
            soft_max=1))
        .with_panel(time_series("Running requests", "Sequences in each worker's running batch.",
                                [Query(_per_worker("tandem_num_requests_running"),
                                       "{{role}} {{worker}}")], "short", width=6))
        .with_panel(time_series("Waiting requests", "Sequences queued at each worker.",
                                [Query(_per_worker("tandem_num_requests_waiting"),
                                       "{{role}} {{worker}}")], "short", width=6))
        .with_panel(time_series(
            "Prefill and import rate", "Prompts prefilled per prefill worker; requests that "
            "reached a decode worker with a prefill's KV.",
            [Query(_worker_rate("tandem_prefill_requests_total"), "prefill {{worker}}"),
             Query(_worker_rate("tandem_decode_kv_imports_total"), "import {{worker}}")],
            "reqps", width=6))
        .with_row(dashboard_b.Row("KV cache"))
        .with_panel(time_series(
            "KV cache usage", f"Share of KV blocks in use; dashed at {slo.KV_USAGE_WARN:.0%}: "
            "above it new requests queue and running ones get preempted.",
            [Query(_per_worker("tandem_kv_cache_usage_perc"), "{{role}} {{worker}}")],
            "percentunit", steps=[(slo.KV_USAGE_WARN, RED)], soft_max=1))
        .with_panel(time_series(
            "Free KV blocks", "Free blocks (cached-but-unused count as free) per worker.",
            [Query(f"max by (worker, role) (tandem_kv_cache_free_blocks{{{MODEL}}})",
                   "{{role}} {{worker}}")], "short"))
        .with_panel(time_series(
            "Preemptions", "Sequences preempted (to be recomputed) per second: KV memory ran "
            "out.", [Query(_worker_rate("tandem_num_preemptions_total"), "{{worker}}")],
            "ops", steps=[(0.01, RED)]))
        .with_row(dashboard_b.Row("KV transfer"))
        .with_panel(time_series(
            "KV transfer time", "Time for one decode worker pull of a prompt's KV blocks.",
            [*(Query(f"histogram_quantile({q}, sum by (le) ({transfer_buckets}))",
                     f"p{round(q * 100)}") for q in (0.5, 0.99)),
             Query(f"sum({_worker_rate(transfer + '_sum')}) / "
                   f"sum({_worker_rate(transfer + '_count')})", "mean")], "s"))
        .with_panel(time_series(
            "KV transfer throughput", "KV bytes pulled per second, per decode worker.",
            [Query(_worker_rate("tandem_kv_transfer_bytes_total"), "{{worker}}")], "Bps"))
        .with_panel(time_series(
            "KV transfers and failures", "Pulls per second; failures (read errors, timeouts, "
            "checksum mismatches, lost leases) should stay at zero.",
            [Query(f"sum({_worker_rate('tandem_kv_transfers_total')})", "transfers"),
             Query(f"sum({_worker_rate('tandem_kv_transfer_failures_total')})", "failures"),
             Query(f"sum({_worker_rate('tandem_kv_transfer_checksum_failures_total')})",
                   "checksum failures")], "ops"))
        .with_row(dashboard_b.Row("Leases, rejects and recomputes"))
        .with_panel(single_stat(
            "Leases expired", "Leases on prompt KV that no decode worker claimed in time "
            "(over the dashboard's range); red from one.",
            Query(f"sum(max by (worker) (increase(tandem_prefill_leases_ended_total"
                  f"{{{MODEL}, {expired}}}[$__range])))"), "short", steps=[(1, RED)]))
        .with_panel(single_stat(
            "Recomputes", "Imports whose KV pull failed, so decode recomputed the prompt (over "
            "the dashboard's range); red from one.",
            Query(f"sum(max by (worker) (increase(tandem_decode_recomputes_total{{{MODEL}}}"
                  f"[$__range])))"), "short", steps=[(1, RED)]))
        .with_panel(time_series(
            "Lease outcomes", "Leases granted and how they ended: released (decode took the "
            "KV), rejected, expired.",
            [Query(f"sum({_worker_rate('tandem_prefill_leases_granted_total')})", "granted"),
             Query(f"sum by (outcome) ({ended})", "{{outcome}}")], "ops", width=8))
        .with_panel(time_series(
            "Decode rejects by reason", "Leases decode workers turned down: no_capacity, "
            "transfer_failed, invalid_request, shutting_down.",
            [Query(f"sum by (reason) ({rejects})", "{{reason}}")], "ops", width=8))
        .with_row(dashboard_b.Row("Stream migrations"))
        .with_panel(time_series(
            "Migrations by reason", "Decode streams moved to another decode worker per "
            "second after theirs failed: replica_gone, unhealthy, timeout.",
            [Query(f"sum by (reason) ({rate('tandem_request_migrations_total')})",
                   "{{reason}}")], "ops", width=12))
        .with_panel(time_series(
            "Time to resume", "From a decode worker's failure to the migrated stream's next "
            "token.",
            [Query(f"histogram_quantile({q}, sum by (le) "
                   f"({rate('tandem_migration_resume_seconds_bucket')}))",
                   f"p{round(q * 100)}") for q in (0.5, 0.99)], "s", width=12))
    )


def cache_and_routing() -> dashboard_b.Dashboard:
    hits = "tandem_prefix_cache_hits_total"
    queries = "tandem_prefix_cache_queries_total"
    decisions = "tandem_router_decisions_total"
    prompt_blocks = "tandem_router_prompt_blocks_total"
    cached = "tandem_router_cached_blocks_total"
    return (
        _base("tandem-cache-routing", "Tandem / Cache and routing",
              "Prefix cache hits per worker, the router's decisions by reason, and its "
              "fallback to rendezvous hashing.")
        .with_row(dashboard_b.Row("Prefix cache"))
        .with_panel(single_stat(
            "Prefix hit rate", "Prompt tokens found in the prefix caches over tokens looked "
            "up, all workers.",
            Query(f"sum({_worker_rate(hits)}) / sum({_worker_rate(queries)})"), "percentunit"))
        .with_panel(time_series(
            "Prefix hit rate per worker", "Prompt tokens each worker found cached over those "
            "it looked up.",
            [Query(f"{_worker_rate(hits)} / {_worker_rate(queries)}", "{{worker}}")],
            "percentunit", width=10, soft_max=1))
        .with_panel(time_series(
            "Prompt tokens: cached and computed", "Prompt tokens per second served from the "
            "prefix caches and computed anew.",
            [Query(f"sum({_worker_rate(hits)})", "cached"),
             Query(f"sum({_worker_rate(queries)}) - sum({_worker_rate(hits)})", "computed")],
            "short", width=10, stacked=True))
        .with_row(dashboard_b.Row("Routing"))
        .with_panel(time_series(
            "Routing decisions by reason", "prefix: the longest cached prefix won; load: load "
            "outweighed the cache; skip_prefill: decode computes the prompt; fallback: no "
            "usable index; round_robin: that policy.",
            [Query(f"sum by (reason) ({rate(decisions)})", "{{reason}}")], "reqps",
            stacked=True))
        .with_panel(time_series(
            "Decisions by reason and detail", "Why prefill was skipped (short_prompt, "
            "cached_on_decode, no_prefill_workers) or why the index was unusable.",
            [Query(f"sum by (reason, detail) ({rate(decisions)})", "{{reason}} {{detail}}")],
            "reqps"))
        .with_panel(time_series(
            "Prefix reachable and reached", "Of the prompt blocks routed to prefill workers, "
            "those cached on any prefill worker (what prefix routing could reach) and on the "
            "chosen one; the gap is hits lost to routing (round_robin, or load winning).",
            [Query(f"sum({rate(cached, label('on', on))}) / sum({rate(prompt_blocks)})",
                   f"cached on {on}") for on in ("any", "chosen")],
            "percentunit", soft_max=1))
        .with_panel(time_series(
            "Fallback activations", "Decisions made by rendezvous hashing because the prefix "
            "index was unusable (bus_unavailable, index_rebuilding, index_empty); red from "
            "one.",
            [Query(f'sum by (detail) (increase({decisions}{{{MODEL}, reason="fallback"}}'
                   f"[$__rate_interval]))", "{{detail}}")], "short", steps=[(1, RED)]))
        .with_panel(time_series(
            "Router event bus", "1 while every gateway's router reads the workers' KV events; "
            "0: routing falls back to rendezvous hashing.",
            [Query(f"min(tandem_router_bus_connected{{{MODEL}}})", "connected")], "short",
            steps=[(1, GREEN)], base=RED, soft_max=1))
        .with_panel(time_series(
            "Prefix index", "Blocks in each gateway's prefix index, and its rebuilds (start, "
            "reconnection).",
            [Query(f"tandem_router_index_blocks{{{MODEL}}}", "blocks {{instance}}"),
             Query(f"sum(increase(tandem_router_index_rebuilds_total{{{MODEL}}}"
                   f"[$__rate_interval]))", "rebuilds")], "short"))
    )


def speculative_decoding() -> dashboard_b.Dashboard:
    draft = "tandem_spec_decode_draft_tokens_total"
    accepted = "tandem_spec_decode_accepted_tokens_total"
    steps = "tandem_spec_decode_steps_total"
    return (
        _base("tandem-spec-decode", "Tandem / Speculative decoding",
              "How many draft tokens the target model accepts, per worker.")
        .with_row(dashboard_b.Row("Now"))
        .with_panel(single_stat(
            "Acceptance rate", "Accepted draft tokens over draft tokens verified, all "
            f"workers; red below {slo.SPEC_ACCEPTANCE_WARN:.0%}.",
            Query(f"sum({_worker_rate(accepted)}) / sum({_worker_rate(draft)})"),
            "percentunit", steps=[(slo.SPEC_ACCEPTANCE_WARN, GREEN)], base=RED, width=8))
        .with_panel(single_stat(
            "Mean accepted length", "Draft tokens accepted per verification step (each step "
            "also yields one token of the target's own).",
            Query(f"sum({_worker_rate(accepted)}) / sum({_worker_rate(steps)})"), "short",
            width=8))
        .with_panel(single_stat(
            "Draft tokens/s", "Draft tokens proposed and verified per second, all workers.",
            Query(f"sum({_worker_rate(draft)})"), "short", width=8))
        .with_row(dashboard_b.Row("Per worker"))
        .with_panel(time_series(
            "Acceptance rate per worker", "Accepted over verified draft tokens.",
            [Query(f"{_worker_rate(accepted)} / {_worker_rate(draft)}", "{{worker}}")],
            "percentunit", steps=[(slo.SPEC_ACCEPTANCE_WARN, GREEN)], base=RED, soft_max=1))
        .with_panel(time_series(
            "Accepted length per step", "Accepted draft tokens per verification step.",
            [Query(f"{_worker_rate(accepted)} / {_worker_rate(steps)}", "{{worker}}")],
            "short"))
        .with_panel(time_series(
            "Draft and generated tokens/s", "Draft tokens verified and accepted per worker; "
            "tokens the gateways sent, all workers.",
            [Query(_worker_rate(draft), "draft {{worker}}"),
             Query(_worker_rate(accepted), "accepted {{worker}}"),
             Query(f"sum({rate('tandem_generation_tokens_total')})", "generated (all)")],
            "short"))
    )


DASHBOARDS: tuple[Callable[[], dashboard_b.Dashboard], ...] = (
    slo_overview, disaggregation, cache_and_routing, speculative_decoding)


def render(board: dashboard_b.Dashboard) -> dict[str, Any]:
    """The dashboard's JSON model, panels numbered in order."""
    model: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    for number, panel in enumerate(model.get("panels", []), start=1):
        panel["id"] = number
    return model


def dashboards() -> dict[str, dict[str, Any]]:
    """{uid: JSON model} of every dashboard."""
    models = [render(make()) for make in DASHBOARDS]
    return {m["uid"]: m for m in models}


def panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in model.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(model: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard's panels."""
    return [t["expr"] for p in panels(model) for t in p.get("targets", []) if "expr" in t]


def variable_queries(model: dict[str, Any]) -> list[str]:
    """The queries of its query variables (``label_values(...)``)."""
    return [v["query"] for v in model["templating"]["list"] if v["type"] == "query"]


def variable_defaults(model: dict[str, Any]) -> dict[str, str]:
    """{name: value} of its variables as first loaded (``All`` as a match-everything regex)."""
    values = {}
    for v in model["templating"]["list"]:
        value = v.get("current", {}).get("value", "")
        values[v["name"]] = v.get("allValue", ".*") if value == "$__all" else str(value)
    return values


def encode(model: dict[str, Any]) -> str:
    return json.dumps(model, indent=2, ensure_ascii=False) + "\n"


def write(directory: Path = OUTPUT_DIR) -> list[Path]:
    """Write every dashboard as ``<uid>.json``; remove JSON files no dashboard owns."""
    directory.mkdir(parents=True, exist_ok=True)
    models = dashboards()
    for stale in directory.glob("*.json"):
        if stale.stem not in models:
            stale.unlink()
    paths = []
    for uid, model in models.items():
        path = directory / f"{uid}.json"
        path.write_text(encode(model))
        paths.append(path)
    return paths


def main() -> None:
    for path in write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUTPUT_DIR):
        print(path)


if __name__ == "__main__":
    main()
