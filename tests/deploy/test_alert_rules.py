"""The health alerts of deploy/grafana/health.py, evaluated by a real ``promtool test rules``.

Each case feeds synthetic series (one sample a minute) for a few models: one that breaks the
alert's condition from some minute on, and some that come just short of it (at the threshold,
or above it for less than the rule's ``for``). The alert is evaluated every minute and must fire
from exactly the minute its expression and ``for`` say, for the breaking model only. Every alert
of every rule file also has a runbook: its section of docs/operations.md.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.grafana import health, rules
from tests.deploy.conftest import REPO_ROOT, run_promtool

MINUTES = 40  # every series has a sample each minute from 0 to MINUTES
OPERATIONS = REPO_ROOT / "docs" / "operations.md"


@dataclass(frozen=True)
class Firing:
    labels: dict[str, str]  # the alert's labels, its rule's included
    start: int  # the first minute it fires
    end: int = MINUTES + 1  # the first minute it no longer does


@dataclass(frozen=True)
class Case:
    alert: str
    series: dict[str, str]  # series -> values in promtool's notation ("1x9 0x31")
    firing: tuple[Firing, ...]

    def expected(self, minute: int) -> list[dict[str, str]]:
        return [f.labels for f in self.firing if f.start <= minute < f.end]


def _series(metric: str, **labels: str) -> str:
    return metric + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def healthy(model: str, worker: str, role: str) -> str:
    return _series("tandem_worker_healthy", model_name=model, worker=worker, role=role)


def kv_usage(model: str, worker: str) -> str:
    return _series("tandem_kv_cache_usage_perc", model_name=model, worker=worker)


def in_flight(model: str, limit: bool = False) -> str:
    return _series("tandem_requests_in_flight" + ("_limit" if limit else ""), model_name=model)


def success(model: str) -> str:
    return _series("tandem_request_success_total", model_name=model, finished_reason="stop")


def failures(model: str, reason: str) -> str:
    return _series("tandem_request_failures_total", model_name=model, reason=reason)


def decisions(model: str, reason: str, detail: str = "") -> str:
    return _series("tandem_router_decisions_total", model_name=model, reason=reason,
                   detail=detail)


def bus(model: str) -> str:
    return _series("tandem_router_bus_connected", model_name=model)


def config_info(model: str, colocated: str = "false", prefill: str = "1") -> str:
    return _series("tandem_config_info", model_name=model, colocated=colocated,
                   prefill_replicas=prefill)


def gateways(model: str, pod: str) -> str:
    return _series("tandem_gateway_replicas", model_name=model, pod=pod)


def critical(**labels: str) -> dict[str, str]:
    return {**labels, "severity": "critical"}


def warning(**labels: str) -> dict[str, str]:
    return {**labels, "severity": "warning"}


CASES = [
    Case("TandemMetricsAbsent", {
        # The only gateway's scrapes stop at minute 10: absent from 10, fires at 12.
        config_info("gone"): "1x9 stale",
    }, (Firing(critical(), 12),)),
    Case("TandemWorkerGroupAbsent", {
        # "no_decode": its decode worker's series stop at minute 10 -> fires at 12.
        config_info("no_decode"): "1x40",
        healthy("no_decode", "p0", "prefill"): "1x40",
        healthy("no_decode", "d0", "decode"): "1x9 stale",
        # "no_prefill": its prefill worker goes from minute 20 -> fires at 22.
        config_info("no_prefill"): "1x40",
        healthy("no_prefill", "p0", "prefill"): "1x19 stale",
        healthy("no_prefill", "d0", "decode"): "1x40",
        # Short of it: a colocated gateway has no workers of either role; a cluster without
        # prefill replicas has no prefill worker; one replaced within a minute.
        config_info("colocated", colocated="true"): "1x40",
        config_info("decode_only", prefill="0"): "1x40",
        healthy("decode_only", "d0", "decode"): "1x40",
        config_info("replaced"): "1x40",
        healthy("replaced", "p0", "prefill"): "1x40",
        healthy("replaced", "d0", "decode"): "1x9 stale 1x29",
    }, (Firing(critical(model_name="no_decode", role="decode"), 12),
        Firing(critical(model_name="no_prefill", role="prefill"), 22))),
    Case("TandemGatewayMissing", {
        # "lost_one": the second of two gateways is not scraped from minute 10: fires at 15.
        gateways("lost_one", "head"): "2x40",
        gateways("lost_one", "gw-0"): "2x9 stale",
        # Short of it: every gateway there; a single gateway; one back within four minutes.
        gateways("all_there", "head"): "3x40",
        gateways("all_there", "gw-0"): "3x40",
        gateways("all_there", "gw-1"): "3x40",
        gateways("single", "head"): "1x40",
        gateways("back", "head"): "2x40",
        gateways("back", "gw-0"): "2x9 stale stale stale stale 2x26",
    }, (Firing(warning(model_name="lost_one"), 15),)),
    Case("TandemWorkerDown", {
        # "down": its only decode worker faults at minute 10 -> fires a minute later.
        healthy("down", "p0", "prefill"): "1x40",
        healthy("down", "d0", "decode"): "1x9 0x30",
        # "one_left": one of two decode workers faults; "blip": faulted for one minute.
        healthy("one_left", "d0", "decode"): "1x9 0x30",
        healthy("one_left", "d1", "decode"): "1x40",
        healthy("blip", "d0", "decode"): "1x9 0 1x29",
    }, (Firing({"model_name": "down", "role": "decode", "severity": "critical"}, 11),)),
    Case("TandemWorkerUnhealthy", {
        healthy("faulty", "p0", "prefill"): "1x40",
        healthy("faulty", "d0", "decode"): "1x9 0x30",  # faulted from minute 10: fires at 12
        healthy("replaced", "d0", "decode"): "1x9 0 0 1x28",  # faulted for two samples only
    }, (Firing(warning(model_name="faulty", worker="d0", role="decode"), 12),)),
    Case("TandemKVCacheNearlyFull", {
        kv_usage("full", "d0"): "0.5x9 0.95x30",  # above 90% from minute 10: fires at 20
        kv_usage("full", "d1"): "0.5x40",
        kv_usage("at_limit", "d0"): "0.9x40",
        kv_usage("burst", "d0"): "0.5x9 0.95x9 0.5x20",  # above for minutes 10-19 only
    }, (Firing(warning(model_name="full", worker="d0"), 20),)),
    Case("TandemAdmissionQueueNearlyFull", {
        in_flight("busy"): "10x9 95x30", in_flight("busy", limit=True): "100x40",
        in_flight("at_limit"): "90x40", in_flight("at_limit", limit=True): "100x40",
        in_flight("burst"): "10x9 95x4 10x25", in_flight("burst", limit=True): "100x40",
        in_flight("unbounded"): "95x40", in_flight("unbounded", limit=True): "0x40",
    }, (Firing(warning(model_name="busy"), 15),)),
    Case("TandemShedding", {
        # Half the requests rejected from minute 21 on (the first minute with a rejection).
        success("shedding"): "0+100x40", failures("shedding", "rejected"): "0x20 1000+1000x19",
        success("steady"): "0+100x40", failures("steady", "rejected"): "0+5x40",  # 4.8%
        success("invalid"): "0+100x40", failures("invalid", "invalid"): "0+100x40",
    }, (Firing(warning(model_name="shedding"), 26),)),
    Case("TandemRequestTimeouts", {
        success("timing_out"): "0+100x40",
        failures("timing_out", "timeout"): "0x20 100+100x19",  # from minute 21
        success("rare"): "0+1000x40", failures("rare", "timeout"): "0+5x40",  # 0.5%
    }, (Firing(warning(model_name="timing_out"), 26),)),
    Case("TandemEngineErrors", {
        success("failing"): "0+100x40", failures("failing", "engine_error"): "0x20 1+1x19",
        # One error at minute 21: the alert lasts while the 5-minute window holds it.
        success("once"): "0+100x40", failures("once", "engine_error"): "0x20 1x19",
        success("healthy"): "0+100x40", failures("healthy", "engine_error"): "0x40",
    }, (Firing(warning(model_name="failing"), 21),
        Firing(warning(model_name="once"), 21, end=26))),
    Case("TandemRouterFallback", {
        # The bus is lost at minute 21: fallbacks replace prefix choices, and outnumber them
        # over the 10-minute window from minute 26 on.
        decisions("blind", "prefix"): "0+100x20 2000x19",
        decisions("blind", "fallback", "bus_unavailable"): "0x20 100+100x19",
        # Mostly short prompts (prefill skipped): the prefill choices are still mostly blind.
        decisions("short_prompts", "skip_prefill", "short_prompt"): "0+1000x40",
        decisions("short_prompts", "prefix"): "0+50x40",
        decisions("short_prompts", "fallback", "bus_unavailable"): "0+100x40",
        decisions("steady", "prefix"): "0+100x40",
        decisions("steady", "fallback", "index_empty"): "0+10x40",
        decisions("round_robin", "round_robin"): "0+100x40",
        bus("disconnected"): "1x9 0x30",  # lost from minute 10: fires at 15
        bus("reconnected"): "1x9 0x4 1x26",  # lost for minutes 10-14
    }, (Firing(warning(model_name="blind", cause="fallback_share"), 31),
        Firing(warning(model_name="short_prompts", cause="fallback_share"), 6),
        Firing(warning(model_name="disconnected", cause="bus_disconnected"), 15))),
]


def promtool_test(case: Case, tmp_path: Path) -> dict[str, Any]:
    """A ``promtool test rules`` file for one case, against the health rules (without their
    annotations: the expressions are under test, not the text)."""
    plain = copy.deepcopy(health.rules())
    for group in plain["groups"]:
        for rule in group["rules"]:
            del rule["annotations"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(plain))
    return {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
            "alert_rule_test": [
                {"eval_time": f"{minute}m", "alertname": case.alert,
                 "exp_alerts": [{"exp_labels": labels} for labels in case.expected(minute)]}
                for minute in range(MINUTES + 1)],
        }],
    }


def run_test(promtool: str, test: dict[str, Any], tmp_path: Path) -> tuple[int, str]:
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = run_promtool(promtool, "test", "rules", str(tmp_path / "test.yaml"))
    return result.returncode, result.stdout + result.stderr


def test_every_health_rule_has_a_case() -> None:
    """Each rule (an alert may have several) fires in some case, with the labels it sets."""
    cases = {c.alert: c for c in CASES}
    for rule in health.rules()["groups"][0]["rules"]:
        case = cases[rule["alert"]]
        assert any(rule["labels"].items() <= f.labels.items() for f in case.firing), rule


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.alert)
def test_alert_fires_on_time_and_only_where_it_should(case: Case, promtool: str,
                                                      tmp_path: Path) -> None:
    test = promtool_test(case, tmp_path)
    code, output = run_test(promtool, test, tmp_path)
    assert code == 0, output

    # And the test can fail: the first firing a minute early is wrong.
    first = min(case.firing, key=lambda f: f.start)
    early = Firing(first.labels, first.start - 1, first.end)
    wrong = Case(case.alert, case.series, tuple(early if f is first else f
                                                for f in case.firing))
    code, output = run_test(promtool, promtool_test(wrong, tmp_path), tmp_path)
    assert code != 0 and f"alertname: {case.alert}, time: {early.start}m" in output, output


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_alert_has_a_runbook_section() -> None:
    anchors = _anchors(OPERATIONS.read_text())
    for group in rules.rules()["groups"]:
        for rule in group["rules"]:
            annotations = rule["annotations"]
            assert annotations["summary"] and annotations["description"], rule["alert"]
            page, _, anchor = annotations["runbook_url"].partition("#")
            assert (REPO_ROOT / page).resolve() == OPERATIONS, rule["alert"]
            assert anchor in anchors, (rule["alert"], anchor)

