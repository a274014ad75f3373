"""PNG plots: TTFT and ITL CDFs, goodput and p99 latencies against the offered load.

Uses matplotlib's object API (``Figure``), which renders with Agg and touches no global pyplot
state, so it is safe in threads and on machines without a display.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from tandem.loadtest.bench.results import Cell

PLOT_FILES = ("ttft_cdf.png", "itl_cdf.png", "goodput_vs_rate.png", "p99_vs_rate.png")
_DPI = 110


def kind_plot_files(cells: list[Cell]) -> list[str]:
    """TTFT and ITL CDFs of each kind of request, when the workload mixes kinds."""
    kinds = sorted({kind for c in cells for kind in c.by_kind})
    return [f"{metric}_cdf_{kind}.png" for kind in kinds for metric in ("ttft", "itl")]


def write_plots(out: Path, cells: list[Cell]) -> list[Path]:
    paths = [out / name for name in PLOT_FILES]
    _cdf(paths[0], cells, "TTFT", _ttfts())
    _cdf(paths[1], cells, "ITL", _itls())
    _goodput(paths[2], cells)
    _p99(paths[3], cells)
    for name in kind_plot_files(cells):
        metric, _, kind = name.removesuffix(".png").split("_", 2)
        values = _ttfts(kind) if metric == "ttft" else _itls(kind)
        paths.append(out / name)
        _cdf(paths[-1], cells, metric.upper(), values, f" of {kind} requests")
    return paths


def _ttfts(kind: str | None = None) -> Callable[[Cell], list[float]]:
    return lambda c: [r.ttft for run in c.runs for r in run.records
                      if r.ok and kind in (None, r.kind)]


def _itls(kind: str | None = None) -> Callable[[Cell], list[float]]:
    return lambda c: [g for run in c.runs for r in run.records
                      if r.ok and kind in (None, r.kind) for g in r.itls]


def _cdf(path: Path, cells: list[Cell], name: str,
         values_of: Callable[[Cell], list[float]], title_suffix: str = "") -> None:
    fig = Figure(figsize=(7, 4.5), dpi=_DPI)
    ax = fig.add_subplot()
    for cell in cells:
        ms = np.sort(np.asarray(values_of(cell), dtype=np.float64)) * 1000.0
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post",
                    label=f"{cell.label} @ {cell.load.label}")
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "inter-token gaps"))
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{name} CDF{title_suffix}")
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)


def _loads_axis(cells: list[Cell]) -> tuple[list[str], str]:
    """Loads in first-seen order, spaced evenly (an infinite rate has no place on a number line)."""
    ticks = list(dict.fromkeys(c.load.axis_value for c in cells))
    modes = {c.load.mode for c in cells}
    xlabel = "concurrency" if modes == {"concurrency"} else (
        "request rate (req/s)" if modes == {"rate"} else "load")
    return ticks, xlabel


def _by_label(cells: list[Cell], ticks: list[str], value_of: Callable[[Cell], float | None]
              ) -> dict[str, tuple[list[int], list[float]]]:
    lines: dict[str, tuple[list[int], list[float]]] = {}
    for cell in cells:
        value = value_of(cell)
        if value is None:
            continue
        xs, ys = lines.setdefault(cell.label, ([], []))
        xs.append(ticks.index(cell.load.axis_value))
        ys.append(value)
    return lines


def _goodput(path: Path, cells: list[Cell]) -> None:
    ticks, xlabel = _loads_axis(cells)
    fig = Figure(figsize=(7, 4.5), dpi=_DPI)
    ax = fig.add_subplot()
    for label, (xs, ys) in _by_label(cells, ticks, lambda c: c.summary.goodput).items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xticks(range(len(ticks)), ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("goodput (req/s meeting the SLO)")
    ax.set_title("Goodput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)


def _p99(path: Path, cells: list[Cell]) -> None:
    ticks, xlabel = _loads_axis(cells)
    fig = Figure(figsize=(10, 7), dpi=_DPI)
    axes = fig.subplots(2, 2)
    for ax, metric in zip(axes.flat, ("ttft", "tpot", "itl", "e2e"), strict=True):
        def p99(cell: Cell, metric: str = metric) -> float | None:
            dist = getattr(cell.summary, metric)
            return None if dist is None else dist.p99

        for label, (xs, ys) in _by_label(cells, ticks, p99).items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms")
        ax.set_title(f"{metric.upper()} p99")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
