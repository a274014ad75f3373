"""`tandem bench` against the live local cluster: results, report and plots, with token counts
equal to what the server reported (its usage fields and its /metrics counters)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import matplotlib.image

from tandem.loadtest.bench import cli
from tandem.loadtest.bench.plots import PLOT_FILES


def counter_total(http_url: str, name: str) -> float:
    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


def test_short_live_run_against_tandem(cluster, tmp_path: Path) -> None:
    before = {n: counter_total(cluster.http_url, n)
              for n in ("tandem_prompt_tokens_total", "tandem_generation_tokens_total",
                        "tandem_kv_transfer_bytes_total")}
    code = cli.main(["--base-url", cluster.http_url, "--label", "tandem", "--workload", "prefix",
                     "--num-requests", "6", "--concurrency", "3", "--input-len", "40:80",
                     "--output-len", "4:8", "--prefix-len", "32", "--num-tenants", "2",
                     "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--seed", "3",
                     "--no-progress", "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    recs = [r for cell in results["cells"] for run in cell["runs"] for r in run["records"]]
    assert len(recs) == 6 and all(r["error"] is None for r in recs)
    for r in recs:
        assert r["output_tokens_source"] == "usage"
        assert r["server_prompt_tokens"] == r["prompt_tokens"]  # exact prompt lengths
        assert 4 <= r["output_tokens"] <= 8  # ignore_eos: the workload's output lengths
    summary = results["cells"][0]["summary"]
    after = {n: counter_total(cluster.http_url, n) for n in before}
    assert summary["input_tokens"] == after["tandem_prompt_tokens_total"] - before[
        "tandem_prompt_tokens_total"]
    assert summary["output_tokens"] == after["tandem_generation_tokens_total"] - before[
        "tandem_generation_tokens_total"]
    # The prompts (40-80 tokens) were prefilled on P and their full blocks pulled by D.
    assert after["tandem_kv_transfer_bytes_total"] > before["tandem_kv_transfer_bytes_total"]
    assert (tmp_path / "report.md").read_text().count("| tandem |") >= 1
    for name in PLOT_FILES:
        assert matplotlib.image.imread(tmp_path / name).shape[0] > 100
