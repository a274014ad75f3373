"""Side-by-side ratios: each target against the first (the baseline) at the same load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.loadtest.bench.metrics import Summary
from tandem.loadtest.bench.results import Cell


@dataclass(frozen=True)
class Metric:
    key: str  # "goodput", or "<latency>.<stat>" such as "ttft.p99"
    title: str
    higher_is_better: bool

    def value(self, summary: Summary) -> float | None:
        name, _, stat = self.key.partition(".")
        value = getattr(summary, name)
        if stat:
            return None if value is None else float(getattr(value, stat))
        return float(value)


METRICS = (
    Metric("request_throughput", "req/s", True),
    Metric("goodput", "goodput", True),
    Metric("output_throughput", "out tok/s", True),
    Metric("ttft.p50", "TTFT p50", False),
    Metric("ttft.p99", "TTFT p99", False),
    Metric("tpot.p50", "TPOT p50", False),
    Metric("tpot.p99", "TPOT p99", False),
    Metric("itl.p50", "ITL p50", False),
    Metric("itl.p99", "ITL p99", False),
    Metric("e2e.p99", "E2E p99", False),
)


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def comparison(cells: list[Cell]) -> list[dict[str, Any]]:
    """For every load, non-baseline target and kind of request ("all" first, then each kind
    when the workload mixes them): metric(target) / metric(baseline)."""
    if not cells:
        return []
    baseline = cells[0].label
    base_at = {c.load: c for c in cells if c.label == baseline}
    rows = []
    for cell in cells:
        base = base_at.get(cell.load)
        if cell.label == baseline or base is None:
            continue
        pairs = [("all", cell.summary, base.summary)]
        pairs += [(kind, s, base.by_kind[kind]) for kind, s in cell.by_kind.items()
                  if kind in base.by_kind]
        for kind, mine, theirs in pairs:
            rows.append({
                "load": cell.load.label, "label": cell.label, "baseline": baseline, "kind": kind,
                "ratios": {m.key: ratio(m.value(mine), m.value(theirs)) for m in METRICS},
            })
    return rows
