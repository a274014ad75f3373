"""Runs pooled per (target, load), and the results.json document."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.loadtest.bench.arrivals import Load
from tandem.loadtest.bench.metrics import SLO, Summary, summarize
from tandem.loadtest.bench.runner import RunResult
from tandem.loadtest.bench.server_metrics import RoleCounters, add

RESULTS_VERSION = 1


@dataclass
class Cell:
    """Every round of one target at one load, pooled: percentiles over all requests, throughput
    over the summed durations."""

    label: str
    load: Load
    runs: list[RunResult]
    summary: Summary
    by_kind: dict[str, Summary]  # only when the workload mixes kinds of request
    server_cache: RoleCounters | None = None  # summed over runs; None unless every run has it


def pool(runs: list[RunResult], slo: SLO) -> list[Cell]:
    """Cells in first-seen order of (label, load)."""
    groups: dict[tuple[str, Load], list[RunResult]] = {}
    for run in runs:
        groups.setdefault((run.label, run.load), []).append(run)
    cells = []
    for (label, load), group in groups.items():
        records = [r for run in group for r in run.records]
        duration = sum(run.duration_s for run in group)
        due = len(records) + sum(run.not_sent for run in group)
        kinds = sorted({r.kind for r in records})
        by_kind = ({k: summarize([r for r in records if r.kind == k], duration, slo)
                    for k in kinds} if len(kinds) > 1 else {})
        cells.append(Cell(label, load, group, summarize(records, duration, slo, due), by_kind,
                          _server_cache(group)))
    return cells


def _server_cache(runs: list[RunResult]) -> RoleCounters | None:
    total: RoleCounters = {}
    for run in runs:
        if run.server_cache is None:
            return None
        total = add(total, run.server_cache)
    return total


def server_cache_json(counters: RoleCounters | None) -> dict[str, Any] | None:
    if counters is None:
        return None
    return {role: {"queries": c.queries, "hits": c.hits, "hit_rate": c.hit_rate}
            for role, c in counters.items()}


def summary_json(summary: Summary) -> dict[str, Any]:
    return {**dataclasses.asdict(summary),
            "prefix_cache_hit_rate": summary.prefix_cache_hit_rate}


def results_document(config: dict[str, Any], slo: SLO, cells: list[Cell],
                     comparison: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {
        "tool": "tandem bench",
        "version": RESULTS_VERSION,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": config,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "cells": [{
            "label": cell.label,
            "load": dataclasses.asdict(cell.load),
            "summary": summary_json(cell.summary),
            "by_kind": {k: summary_json(s) for k, s in cell.by_kind.items()},
            "server_cache": server_cache_json(cell.server_cache),
            "runs": [{"round": run.round, "duration_s": run.duration_s,
                      "not_sent": run.not_sent, "deadline_hit": run.deadline_hit,
                      "server_cache": server_cache_json(run.server_cache),
                      "records": [r.to_json() for r in run.records]} for run in cell.runs],
        } for cell in cells],
        "comparison": comparison,
    }


def write_results(path: Path, document: dict[str, Any]) -> None:
    text = json.dumps(_finite(document), separators=(",", ":"), allow_nan=False)
    path.write_text(text + "\n")


def _finite(value: Any) -> Any:
    """JSON has no Infinity (an infinite request rate is a valid load): write it as a string."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
