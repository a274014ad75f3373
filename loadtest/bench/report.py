"""The Markdown report."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tandem.loadtest.bench.compare import METRICS
from tandem.loadtest.bench.metrics import SLO, Distribution, Summary
from tandem.loadtest.bench.plots import PLOT_FILES, kind_plot_files
from tandem.loadtest.bench.results import Cell

_LATENCIES = (("ttft", "TTFT: time to first token"),
              ("tpot", "TPOT: time per output token after the first"),
              ("itl", "ITL: gap between output chunks"),
              ("e2e", "E2E: request latency"))


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"x{value:.2f}"


def render_report(settings: dict[str, Any], targets: list[dict[str, str]], slo: SLO,
                  cells: list[Cell], comparison: list[dict[str, Any]] | None) -> str:
    lines = ["# tandem bench report", ""]
    lines += [f"- **{k}**: {v}" for k, v in settings.items()]
    lines += [f"- **SLO**: {slo.describe()}", "", "## Targets", ""]
    lines += _table(["label", "protocol", "address", "model"],
                    ([t["label"], t["protocol"], t["address"], t["model"] or "(served)"]
                     for t in targets))
    lines += ["## Throughput and tokens", ""]
    lines += _table(
        ["target", "load", "completed", "failed", "rejected", "duration s", "req/s",
         "goodput req/s", "output tok/s", "total tok/s", "input tokens", "output tokens",
         "cached tokens", "prefix hit rate"],
        ([c.label, c.load.label, *_throughput_cells(c.summary)] for c in cells))
    if any(c.server_cache for c in cells):
        lines += ["## Server prefix cache (engine counters from /metrics, prompt tokens)", ""]
        lines += _table(["target", "load", "role", "queried", "hits", "hit rate"],
                        ([c.label, c.load.label, role, f"{n.queries:.0f}", f"{n.hits:.0f}",
                          _percent(n.hit_rate)]
                         for c in cells for role, n in (c.server_cache or {}).items()))
    for key, title in _LATENCIES:
        lines += [f"## {title} (ms)", ""]
        lines += _table(["target", "load", "n", "mean", "p50", "p90", "p99", "max"],
                        ([c.label, c.load.label, *_dist_cells(getattr(c.summary, key))]
                         for c in cells))
    if any(c.by_kind for c in cells):
        lines += ["## By kind of request (ms)", ""]
        lines += _table(
            ["target", "load", "kind", "completed", "goodput req/s", "TTFT p50", "TTFT p99",
             "TPOT p99", "ITL p50", "ITL p99", "E2E p99"],
            ([c.label, c.load.label, kind, str(s.completed), _f(s.goodput, 2),
              *_stats(s, ("ttft", "p50"), ("ttft", "p99"), ("tpot", "p99"), ("itl", "p50"),
                      ("itl", "p99"), ("e2e", "p99"))]
             for c in cells for kind, s in c.by_kind.items()))
    if comparison:
        lines += [f"## Comparison against {comparison[0]['baseline']} (ratio; higher is better "
                  "for throughput and goodput, lower for latency)", ""]
        lines += _table(["load", "target", "kind", *(m.title for m in METRICS)],
                        ([row["load"], row["label"], row["kind"],
                          *(_ratio(row["ratios"][m.key]) for m in METRICS)]
                         for row in comparison))
    lines += _notes(cells)
    lines += ["## Plots", ""]
    lines += [f"![{name}]({name})" for name in (*PLOT_FILES, *kind_plot_files(cells))]
    return "\n".join(lines) + "\n"


def _throughput_cells(s: Summary) -> list[str]:
    hit = s.prefix_cache_hit_rate
    return [f"{s.completed}/{s.requests}", str(s.failed), str(s.rejected), _f(s.duration_s, 2),
            _f(s.request_throughput, 2), _f(s.goodput, 2), _f(s.output_throughput),
            _f(s.total_token_throughput), str(s.input_tokens), str(s.output_tokens),
            "-" if s.cached_tokens is None else str(s.cached_tokens), _percent(hit)]


def _dist_cells(dist: Distribution | None) -> list[str]:
    if dist is None:
        return ["0", "-", "-", "-", "-", "-"]
    return [str(dist.count), _f(dist.mean), _f(dist.p50), _f(dist.p90), _f(dist.p99),
            _f(dist.max)]


def _stats(summary: Summary, *wanted: tuple[str, str]) -> list[str]:
    out = []
    for metric, stat in wanted:
        dist = getattr(summary, metric)
        out.append("-" if dist is None else _f(getattr(dist, stat)))
    return out


def _notes(cells: list[Cell]) -> list[str]:
    lines: list[str] = []
    for c in cells:
        where = f"{c.label} @ {c.load.label}"
        s = c.summary
        for message, count in sorted(s.errors.items(), key=lambda kv: -kv[1]):
            lines.append(f"- {where}: {count} failed: {message}")
        if s.mid_stream_errors:
            lines.append(f"- {where}: {s.mid_stream_errors} of the failed requests failed after "
                         "the server had admitted them (mid-stream errors)")
        if s.rejected:
            lines.append(f"- {where}: {s.rejected} rejected as overloaded (HTTP 429) before "
                         "any work; neither completed nor failed")
        if s.prompt_token_mismatches:
            lines.append(f"- {where}: {s.prompt_token_mismatches} requests where the server "
                         "counted a different prompt length than the bench's tokenizer "
                         "(pass the target's --tokenizer)")
        not_sent = sum(run.not_sent for run in c.runs)
        if not_sent:
            lines.append(f"- {where}: {not_sent} requests not sent before the deadline")
    return ["## Notes", "", *lines, ""] if lines else []


def write_report(path: Path, text: str) -> None:
    path.write_text(text)
