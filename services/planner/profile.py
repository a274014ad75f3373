"""A ``Profile`` (one worker's capacity) from ``tandem bench`` results, saved as JSON.

Measure one 1 prefill + 1 decode cluster with ``tandem bench --concurrency 1,4,16 --out DIR``
(docs/operations.md, Planner), then ``tandem plan profile DIR --out profile.json``:

* decode: at concurrency c the decode worker runs about c streams, so the median per-request
  TPOT at each concurrency is a point (c, ITL(c)); a least-squares line through them is
  ``ITL(b) = a + c·b`` (two concurrencies at least);
* prefill: the requests of the concurrency-1 runs, alone on the prefill worker: TTFT against
  the prompt tokens not served from the cache. With prompts of several lengths (``--input-len
  LOW:HIGH``) a line gives the per-token rate and the fixed part; with one length the whole
  TTFT counts as prefill (no fixed part; conservative for longer prompts).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from tandem.services.planner.sizing import Profile
from tandem.services.protocol.bench_records import RequestRecord
from tandem.services.serving.config import AppConfig

LENGTH_SPREAD = 1.2  # longest / shortest prompt above which prefill time is fitted as a line


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = intercept + slope·x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def _results(path: Path) -> dict[str, Any]:
    file = path / "results.json" if path.is_dir() else path
    document = json.loads(file.read_text())
    if document.get("tool") != "tandem bench":
        raise ValueError(f"{file}: not a tandem bench results.json")
    return dict(document)


def _records(cell: dict[str, Any]) -> list[RequestRecord]:
    records = (RequestRecord.from_json(r) for run in cell["runs"] for r in run["records"])
    return [r for r in records if r.ok]


def decode_points(cells: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(concurrency, median TPOT in s) per concurrency."""
    by_concurrency: dict[int, list[float]] = {}
    for cell in cells:
        if cell["load"]["mode"] != "concurrency":
            continue
        tpots = [t for r in _records(cell) if (t := r.tpot) is not None]
        by_concurrency.setdefault(int(cell["load"]["value"]), []).extend(tpots)
    return sorted((c, statistics.median(t)) for c, t in by_concurrency.items() if t)


def prefill_points(cells: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(new prompt tokens, TTFT in s) of each request run alone (concurrency 1)."""
    alone = [c for c in cells if c["load"]["mode"] == "concurrency" and c["load"]["value"] == 1]
    return [(r.input_tokens - (r.cached_tokens or 0), r.ttft)
            for cell in alone for r in _records(cell)]


def fit_profile(cells: list[dict[str, Any]], max_num_seqs: int, source: str = "") -> Profile:
    decode = decode_points(cells)
    if len(decode) < 2:
        raise ValueError("a profile needs TPOT at two concurrencies at least (e.g. tandem bench "
                         "--concurrency 1,4,16); got " + (", ".join(str(c) for c, _ in decode)
                                                          or "none"))
    itl_base, itl_slope = _line(decode)
    if itl_base <= 0:  # a line through noisy points can dip below zero at b = 0
        itl_base, itl_slope = min(t for _, t in decode), max(itl_slope, 0.0)
    prefill = prefill_points(cells)
    if not prefill:
        raise ValueError("a profile needs requests run at concurrency 1 (prefill alone)")
    lengths = [n for n, _ in prefill]
    overhead, per_token = 0.0, statistics.fmean(t for _, t in prefill) / statistics.fmean(lengths)
    if max(lengths) > LENGTH_SPREAD * max(1, min(lengths)):
        fitted_overhead, fitted_per_token = _line(prefill)
        if fitted_per_token > 0 and fitted_overhead >= 0:
            overhead, per_token = fitted_overhead, fitted_per_token
    return Profile(prefill_tokens_per_s=1.0 / per_token, prefill_overhead_s=overhead,
                   itl_base_s=itl_base, itl_per_seq_s=max(itl_slope, 0.0),
                   max_num_seqs=max_num_seqs, source=source)


def profile_from_bench(paths: list[Path],
                       max_num_seqs: int = AppConfig.max_num_seqs) -> Profile:
    """The profile from one or more ``tandem bench --out`` folders (or their results.json)."""
    cells = [cell for path in paths for cell in _results(path)["cells"]]
    return fit_profile(cells, max_num_seqs, source=", ".join(str(p) for p in paths))


def save_profile(profile: Profile, path: Path) -> None:
    path.write_text(json.dumps(profile.to_json(), indent=2) + "\n")


def load_profile(path: Path) -> Profile:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile is a JSON object")
    return Profile.from_json(data)
