"""Prometheus alert rules on how Tandem fails, beside the SLO burn rates: workers whose engine
reported a fault, capacity running out (KV cache, admission), shedding, timeouts, engine errors,
and the router choosing workers without its prefix index.

``python -m deploy.grafana`` writes them to ``deploy/helm/tandem/rules/tandem-health.rules.yaml``
(see deploy/grafana/rules.py), which the Helm chart embeds next to the SLO rules. Each alert's
runbook is its section of docs/operations.md (the heading is the alert's name); thresholds are in
deploy/grafana/slo.py.
"""

from __future__ import annotations

from typing import Any

from deploy.grafana import slo

RUNBOOK = "docs/operations.md#{anchor}"
BY = "sum by (model_name)"
SUCCESS = "tandem_request_success_total"
FAILURES = "tandem_request_failures_total"
DECISIONS = "tandem_router_decisions_total"
HEALTHY = "tandem_worker_healthy"
GATEWAYS = "tandem_gateway_replicas"  # one series per gateway scraped; its value: configured
# The router's prefill choices: by its prefix index (prefix, load) or without it (fallback).
PREFILL_CHOICES = ("prefix", "load", "fallback")
CRITICAL, WARNING = "critical", "warning"
# Annotation templates: the alert's labels and value.
MODEL = "{{ $labels.model_name }}"
WORKER = "{{ $labels.worker }}"
ROLE = "{{ $labels.role }}"
PERCENT = "{{ $value | humanizePercentage }}"
VALUE = "{{ $value }}"


def _rate(metric: str, window: str, selector: str = "") -> str:
    series = f"{metric}{{{selector}}}" if selector else metric
    return f"{BY} (rate({series}[{window}]))"


def failure_share(reason: str, window: str) -> str:
    """Share of requests that failed with ``reason`` over ``window``."""
    failed = _rate(FAILURES, window, f'reason="{reason}"')
    return f"{failed}\n/ ({_rate(SUCCESS, window)} + {_rate(FAILURES, window)})"


def fallback_share(window: str) -> str:
    """Share of the router's prefill choices made by rendezvous hashing over ``window``."""
    fallback = _rate(DECISIONS, window, 'reason="fallback"')
    choices = _rate(DECISIONS, window, f'reason=~"{"|".join(PREFILL_CHOICES)}"')
    return f"{fallback}\n/ {choices}"


def _alert(name: str, expr: str, duration: str | None, severity: str, summary: str,
           description: str, **labels: str) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if duration is not None:
        rule["for"] = duration
    rule["labels"] = {"severity": severity, **labels}
    rule["annotations"] = {"summary": summary, "description": description,
                           "runbook_url": RUNBOOK.format(anchor=name.lower())}
    return rule


def _workers() -> list[dict[str, Any]]:
    return [
        _alert("TandemWorkerDown", f"sum by (model_name, role) ({HEALTHY}) == 0", "1m", CRITICAL,
               f"No healthy {ROLE} worker ({MODEL})",
               f"Every {ROLE} worker of model {MODEL} has reported an engine fault for a "
               "minute: requests that need one fail."),
        _alert("TandemWorkerUnhealthy",
               f"max by (model_name, worker, role) ({HEALTHY}) == 0", "2m", WARNING,
               f"Worker {WORKER} reports an engine fault ({MODEL})",
               f"The engine of {ROLE} worker {WORKER} (model {MODEL}) has reported a fault for "
               "two minutes; the router avoids it, and Ray Serve has not replaced it yet."),
        _alert("TandemKVCacheNearlyFull",
               f"max by (model_name, worker) (tandem_kv_cache_usage_perc) > {slo.KV_USAGE_WARN:g}",
               "10m", WARNING, f"KV cache of worker {WORKER} nearly full ({MODEL})",
               f"Worker {WORKER} (model {MODEL}) has used {PERCENT} of its KV blocks, above "
               f"{slo.KV_USAGE_WARN:.0%} for ten minutes: requests queue and running ones get "
               "preempted and recomputed."),
    ]


def _capacity() -> list[dict[str, Any]]:
    # A limit of 0 means none.
    in_flight = "tandem_requests_in_flight / (tandem_requests_in_flight_limit > 0)"
    return [
        _alert("TandemAdmissionQueueNearlyFull", f"{in_flight} > {slo.IN_FLIGHT_WARN:g}", "5m",
               WARNING, f"Gateway near its admission limit ({MODEL})",
               f"A gateway of model {MODEL} has admitted {PERCENT} of the requests it may hold "
               f"(tandem_requests_in_flight_limit), above {slo.IN_FLIGHT_WARN:.0%} for five "
               "minutes: beyond the limit it answers 429."),
        _alert("TandemShedding",
               f"{failure_share('rejected', '10m')}\n> {slo.SHEDDING_WARN:g}", "5m", WARNING,
               f"Requests rejected with 429 ({MODEL})",
               f"{PERCENT} of the requests for model {MODEL} over the last 10 minutes were "
               f"rejected as overload (429), above {slo.SHEDDING_WARN:.0%}: the cluster is too "
               "small for its traffic."),
    ]


def _failures() -> list[dict[str, Any]]:
    engine_errors = _rate(FAILURES, "5m", 'reason="engine_error"')
    return [
        _alert("TandemRequestTimeouts",
               f"{failure_share('timeout', '5m')}\n> {slo.TIMEOUT_WARN:g}", "5m", WARNING,
               f"Requests time out ({MODEL})",
               f"{PERCENT} of the requests for model {MODEL} over the last 5 minutes ended with "
               f"an expired deadline (504), above {slo.TIMEOUT_WARN:.0%}."),
        _alert("TandemEngineErrors", f"{engine_errors} > 0", None, WARNING,
               f"Engines fail requests ({MODEL})",
               f"Workers' engines failed {{{{ $value | humanize }}}} requests/s for model {MODEL} "
               "over the last 5 minutes."),
    ]


def _routing() -> list[dict[str, Any]]:
    summary = f"The router chooses workers without its prefix index ({MODEL})"
    return [
        _alert("TandemRouterFallback", f"{fallback_share('10m')}\n> {slo.FALLBACK_WARN:g}", "5m",
               WARNING, summary,
               f"{PERCENT} of the router's prefill choices for model {MODEL} over the last 10 "
               "minutes were made by rendezvous hashing (reason fallback), not by cached "
               "prefixes: prefix caching barely helps.", cause="fallback_share"),
        _alert("TandemRouterFallback", "tandem_router_bus_connected == 0", "5m", WARNING, summary,
               f"A router of model {MODEL} has not read the workers' KV events for five minutes "
               "(its event bus is lost), so it routes by rendezvous hashing.",
               cause="bus_disconnected"),
    ]


def _absence() -> list[dict[str, Any]]:
    """What fires when what the other alerts watch is gone: every series comes through the
    gateways' /metrics, so without them (their pods, or the Ray head) none of them can; one
    gateway of several gone, the others still report (TandemGatewayMissing)."""
    info = "tandem_config_info"
    groups = {"prefill": f'{info}{{colocated="false", prefill_replicas!="0"}}',
              "decode": f'{info}{{colocated="false"}}'}
    return [
        _alert("TandemMetricsAbsent", f"absent({info})", "2m", CRITICAL,
               "No Tandem gateway is being scraped",
               "Prometheus has had no Tandem series for two minutes: the gateway (or the Ray "
               "head it runs on) is down, or unreachable from Prometheus. No other Tandem alert "
               "can fire meanwhile."),
        *(_alert("TandemWorkerGroupAbsent",
                 f"count by (model_name) ({selector})\nunless on (model_name)\n"
                 f'count by (model_name) ({HEALTHY}{{role="{role}"}})', "2m", CRITICAL,
                 f"No {role} worker at all ({MODEL})",
                 f"The gateway of model {MODEL} has known no {role} worker for two minutes "
                 f"(none registered: every {role} replica is gone, or none could start); "
                 "requests that need one fail.", role=role)
          for role, selector in groups.items()),
        _alert("TandemGatewayMissing",
               f"count by (model_name) ({GATEWAYS})\n< max by (model_name) ({GATEWAYS})", "5m",
               WARNING, f"A gateway of model {MODEL} is not scraped",
               f"Prometheus has scraped {VALUE} gateway(s) of model {MODEL}, fewer than its "
               "gateway_replicas, for five minutes: a gateway pod (or the head) is down or "
               "unreachable. The other gateways serve; the streams open on the lost one ended."),
    ]


def rules() -> dict[str, Any]:
    """The rule file: one group."""
    return {"groups": [{"name": "tandem-health",
                        "rules": [*_absence(), *_workers(), *_capacity(), *_failures(),
                                  *_routing()]}]}
