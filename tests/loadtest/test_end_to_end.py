"""The whole tool (CLI, workload, client, metrics, report, plots) against real servers on
127.0.0.1: the HTTP test peer (tests/loadtest/peer.py) and the gRPC test peer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from tandem.loadtest.bench import cli
from tandem.loadtest.bench.plots import PLOT_FILES
from tandem.services.engine.tokenizer import Tokenizer
from tests.loadtest.peer import PeerBehaviour, PeerLog, _chunk_sizes, serve_peer

COMMON = ["--no-progress", "--input-len", "24:48", "--output-len", "3:9", "--seed", "11"]


def load_results(out: Path) -> dict[str, Any]:
    return json.loads((out / "results.json").read_text())


def records(results: dict[str, Any], label: str | None = None) -> list[dict[str, Any]]:
    return [r for cell in results["cells"] if label in (None, cell["label"])
            for run in cell["runs"] for r in run["records"]]


def assert_outputs_written(out: Path) -> None:
    assert (out / "report.md").is_file()
    for name in PLOT_FILES:
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 100 and image.shape[1] > 100, name


def assert_counts_match_usage(results: dict[str, Any], log: PeerLog, label: str | None = None
                              ) -> None:
    recs = records(results, label)
    assert all(r["error"] is None for r in recs)
    assert sorted(r["output_tokens"] for r in recs) == \
        sorted(u["completion_tokens"] for u in log.usages)
    for r in recs:
        assert r["output_tokens_source"] == "usage"
        # The peer counted the prompt with the real tokenizer: the workload's count is exact.
        assert r["server_prompt_tokens"] == r["prompt_tokens"]
        # Chunks carry one or two tokens; only usage gives the token count.
        assert len(r["chunk_times_s"]) == len(_chunk_sizes(r["output_tokens"]))


def report_row(report: str, label: str, load: str) -> list[str]:
    row = next(line for line in report.splitlines() if line.startswith(f"| {label} | {load} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_http_run_writes_results_report_and_plots_matching_server_usage(
        tokenizer: Tokenizer, tmp_path: Path) -> None:
    with serve_peer(tokenizer) as (url, log):
        code = cli.main(["--base-url", url, "--label", "peer", "--workload", "random",
                         "--num-requests", "12", "--concurrency", "3", "--out", str(tmp_path),
                         "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", *COMMON])
    assert code == 0
    results = load_results(tmp_path)
    assert len(log.usages) == 12
    assert_counts_match_usage(results, log)
    summary = results["cells"][0]["summary"]
    assert summary["completed"] == 12 and summary["good_requests"] == 12
    assert summary["output_tokens"] == sum(u["completion_tokens"] for u in log.usages)
    assert summary["input_tokens"] == sum(u["prompt_tokens"] for u in log.usages)
    assert_outputs_written(tmp_path)
    report = (tmp_path / "report.md").read_text()
    row = report_row(report, "peer", "concurrency 3")
    assert row[2] == "12/12"
    assert row[10:12] == [str(summary["input_tokens"]), str(summary["output_tokens"])]
    assert "TTFT <= 60000 ms and TPOT <= 60000 ms" in report


def test_chat_workload_waits_for_each_previous_turn(tokenizer: Tokenizer, tmp_path: Path
                                                    ) -> None:
    with serve_peer(tokenizer) as (url, log):
        code = cli.main(["--base-url", url, "--workload", "chat", "--num-turns", "3",
                         "--num-requests", "9", "--request-rate", "inf",
                         "--out", str(tmp_path), *COMMON])
    assert code == 0
    results = load_results(tmp_path)
    assert_counts_match_usage(results, log)  # the role-only first chunk is not a token
    recs = records(results)
    by_index = {r["index"]: r for r in recs}
    by_group: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_group.setdefault(r["group"], []).append(r)
    for turns in by_group.values():
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur["start_s"] >= prev["end_s"]
            assert cur["prompt_tokens"] > by_index[prev["index"]]["prompt_tokens"]
    assert_outputs_written(tmp_path)


def test_compare_sweeps_rates_alternating_targets_and_reports_ratios(
        tokenizer: Tokenizer, tmp_path: Path) -> None:
    with serve_peer(tokenizer) as (url_a, log_a), \
            serve_peer(tokenizer, PeerBehaviour(step_s=0.002)) as (url_b, log_b):
        code = cli.main(["compare", "--target", f"fast={url_a}", "--target", f"slow={url_b}",
                         "--workload", "mix", "--long-fraction", "0.25", "--long-input-len",
                         "200", "--num-requests", "4", "--request-rate", "200,inf",
                         "--rounds", "2", "--out", str(tmp_path), *COMMON])
    assert code == 0
    results = load_results(tmp_path)
    assert [(c["label"], c["load"]["value"], len(c["runs"])) for c in results["cells"]] == [
        ("fast", 200.0, 2), ("slow", 200.0, 2), ("fast", "inf", 2), ("slow", "inf", 2)]
    assert_counts_match_usage(results, log_a, "fast")
    assert_counts_match_usage(results, log_b, "slow")
    # Same steps, same requests: both targets saw identical prompt lengths.
    assert sorted(r["prompt_tokens"] for r in records(results, "fast")) == \
        sorted(r["prompt_tokens"] for r in records(results, "slow"))
    rows = results["comparison"]
    assert {(r["label"], r["baseline"], r["load"], r["kind"]) for r in rows} == {
        ("slow", "fast", load, kind) for load in ("200 req/s", "inf req/s")
        for kind in ("all", "long", "short")}
    cell = {(c["label"], c["load"]["value"]): c["summary"] for c in results["cells"]}
    overall = next(r for r in rows if r["load"] == "200 req/s" and r["kind"] == "all")
    slow, fast = cell[("slow", 200.0)], cell[("fast", 200.0)]
    assert overall["ratios"]["ttft.p99"] == pytest.approx(
        slow["ttft"]["percentiles"]["p99"] / fast["ttft"]["percentiles"]["p99"])
    assert overall["ratios"]["goodput"] == pytest.approx(slow["goodput"] / fast["goodput"])
    assert all(v is not None and v > 0 for row in rows for v in row["ratios"].values())
    report = (tmp_path / "report.md").read_text()
    assert "## Comparison against fast" in report and "| short |" in report
    assert_outputs_written(tmp_path)
    for name in ("ttft_cdf_short.png", "itl_cdf_short.png", "ttft_cdf_long.png",
                 "itl_cdf_long.png"):  # per kind of request, linked from the report
        assert matplotlib.image.imread(tmp_path / name).shape[0] > 100
        assert f"![{name}]({name})" in report


def test_server_metrics_credit_each_run_with_its_own_prefix_cache_counters(
        tokenizer: Tokenizer, tmp_path: Path) -> None:
    with serve_peer(tokenizer, PeerBehaviour(cache_hit_fraction=0.5)) as (url, log):
        code = cli.main(["--base-url", url, "--label", "peer", "--server-metrics",
                         "--num-requests", "3", "--concurrency", "1", "--rounds", "2",
                         "--out", str(tmp_path), *COMMON])
    assert code == 0
    cell = load_results(tmp_path)["cells"][0]
    per_run = [run["server_cache"]["prefill"]["queries"] for run in cell["runs"]]
    assert per_run == [sum(r["server_prompt_tokens"] for r in run["records"])
                       for run in cell["runs"]]
    assert cell["server_cache"]["prefill"] == {"queries": log.prompt_tokens,
                                               "hits": log.prompt_tokens / 2, "hit_rate": 0.5}
    assert "| peer | concurrency 1 | prefill |" in (tmp_path / "report.md").read_text()


def test_server_metrics_need_http_targets(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--base-url", "grpc://127.0.0.1:1", "--server-metrics", "--concurrency",
                     "1", "--out", str(tmp_path), *COMMON]) == 2
    assert "--server-metrics reads /metrics over HTTP" in capsys.readouterr().err


def test_failed_and_cut_off_requests_are_reported(tokenizer: Tokenizer, tmp_path: Path
                                                  ) -> None:
    with serve_peer(tokenizer, PeerBehaviour(fail_every=3)) as (url, _):
        assert cli.main(["--base-url", url, "--num-requests", "6", "--concurrency", "1",
                         "--out", str(tmp_path / "fail"), *COMMON]) == 0
    summary = load_results(tmp_path / "fail")["cells"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (4, 2)
    assert summary["errors"] == {"HTTP 500: peer failure": 2}
    assert (summary["mid_stream_errors"], summary["rejected"]) == (0, 0)  # refused, not 429
    assert "2 failed: HTTP 500: peer failure" in (tmp_path / "fail" / "report.md").read_text()

    with serve_peer(tokenizer, PeerBehaviour(break_every=2)) as (url, _):
        assert cli.main(["--base-url", url, "--num-requests", "4", "--concurrency", "1",
                         "--out", str(tmp_path / "break"), *COMMON]) == 0
    summary = load_results(tmp_path / "break")["cells"][0]["summary"]
    assert (summary["completed"], summary["failed"], summary["mid_stream_errors"]) == (2, 2, 2)
    assert summary["errors"] == {"server error in stream: peer broke": 2}
    assert "2 of the failed requests failed after the server had admitted them" in \
        (tmp_path / "break" / "report.md").read_text()

    with serve_peer(tokenizer, PeerBehaviour(stall=True)) as (url, _):
        code = cli.main(["--base-url", url, "--num-requests", "5", "--concurrency", "2",
                         "--timeout", "0.5", "--out", str(tmp_path / "stall"), *COMMON])
    assert code == 1  # nothing completed
    results = load_results(tmp_path / "stall")
    run = results["cells"][0]["runs"][0]
    assert run["deadline_hit"] and run["not_sent"] == 3
    assert [r["error"] for r in run["records"]] == ["cut off by the run's deadline"] * 2
    assert_outputs_written(tmp_path / "stall")


def test_grpc_run_matches_server_usage(tokenizer: Tokenizer, tmp_path: Path) -> None:
    import grpc  # noqa: F401  (a declared dependency)

    from tests.loadtest.grpc_peer import serve_grpc_peer

    for endpoint, workload in (("completions", "random"), ("chat", "prefix")):
        out = tmp_path / endpoint
        with serve_grpc_peer(tokenizer) as (target, log):
            code = cli.main(["--base-url", target, "--workload", workload, "--endpoint",
                             endpoint, "--prefix-len", "32", "--num-requests", "6",
                             "--concurrency", "2", "--out", str(out), *COMMON])
        assert code == 0
        results = load_results(out)
        assert results["config"]["targets"][0]["protocol"] == "grpc"
        assert_counts_match_usage(results, log)
        assert_outputs_written(out)
