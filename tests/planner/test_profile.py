"""A profile from tandem bench's results.json, and the live load from two /metrics texts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.services.cli import main
from tandem.services.planner.observe import NoTraffic, load_between, observe
from tandem.services.planner.profile import load_profile, profile_from_bench
from tandem.services.protocol.bench_records import RequestRecord
from tests.e2e.cluster import static_server
from tests.planner.recorded import colocated_metrics, gateway_metrics


def _record(index: int, prompt: int, ttft: float, tpot: float, out: int = 11) -> dict[str, Any]:
    end = ttft + tpot * (out - 1)
    return RequestRecord(index=index, kind="short", group="", prompt_tokens=prompt,
                         server_prompt_tokens=prompt, output_tokens=out, start_s=0.0,
                         first_token_s=ttft, end_s=end, admitted=True).to_json()


def _cell(mode: str, value: float, records: list[dict[str, Any]]) -> dict[str, Any]:
    return {"label": "tandem", "load": {"mode": mode, "value": value, "burstiness": 1.0},
            "runs": [{"round": 0, "records": records}]}


def _results(tmp_path: Path, cells: list[dict[str, Any]]) -> Path:
    out = tmp_path / "bench"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"tool": "tandem bench", "cells": cells}))
    return out


def test_profile_fits_prefill_and_itl_lines(tmp_path: Path) -> None:
    # Alone (concurrency 1): 100 tokens in 0.15 s, 300 in 0.35 s: TTFT = 0.05 + n / 1000.
    # TPOT 21 ms at concurrency 1, 28 ms at 8: ITL(b) = 20 ms + 1 ms · b.
    alone = [_record(0, 100, 0.15, 0.021), _record(1, 300, 0.35, 0.021)]
    busy = [_record(i, 200, 0.5, 0.028) for i in range(8)]
    cells = [_cell("concurrency", 1, alone), _cell("concurrency", 8, busy),
             _cell("rate", 2.0, busy)]  # a rate run adds nothing to the fit
    out = tmp_path / "profile.json"
    assert main(["plan", "profile", str(_results(tmp_path, cells)), "--max-num-seqs", "16",
                 "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.prefill_tokens_per_s == pytest.approx(1000.0)
    assert profile.prefill_overhead_s == pytest.approx(0.05)
    assert profile.itl_base_s == pytest.approx(0.020)
    assert profile.itl_per_seq_s == pytest.approx(0.001)
    assert profile.max_num_seqs == 16


def test_one_prompt_length_counts_all_of_ttft_as_prefill(tmp_path: Path) -> None:
    # 200 tokens in 0.25 s: 800 tokens/s, no fixed part.
    alone = [_record(0, 200, 0.25, 0.021), _record(1, 200, 0.25, 0.021)]
    cells = [_cell("concurrency", 1, alone),
             _cell("concurrency", 4, [_record(2, 200, 0.3, 0.024)])]
    profile = profile_from_bench([_results(tmp_path, cells)])
    assert profile.prefill_tokens_per_s == pytest.approx(800.0)
    assert profile.prefill_overhead_s == 0.0


def test_one_concurrency_is_not_enough(tmp_path: Path) -> None:
    cells = [_cell("concurrency", 1, [_record(0, 200, 0.25, 0.021)])]
    with pytest.raises(ValueError, match="two concurrencies at least"):
        profile_from_bench([_results(tmp_path, cells)])


# Two reads of a gateway's /metrics, 10 s apart: 20 requests ended and 2 refused; 4,000 prompt
# and 1,000 generated tokens; the prefill worker found 1,000 of 4,000 prompt tokens cached (the
# decode worker's lookups do not count: its prefill was done elsewhere).
BEFORE = gateway_metrics(ended=5, failed=1, prompt=1000, generated=250, hits=0)
AFTER = gateway_metrics(ended=25, failed=3, prompt=5000, generated=1250, hits=1000)


def test_load_from_two_metrics_texts() -> None:
    load = load_between(BEFORE, AFTER, 10.0)
    # λ = (20 + 2) / 10; L_in = 4000 / 20; L_out = 1000 / 20; h = 1000 / 4000.
    assert load.rate == pytest.approx(2.2)
    assert load.prompt_tokens == pytest.approx(200.0)
    assert load.output_tokens == pytest.approx(50.0)
    assert load.hit_rate == pytest.approx(0.25)


def test_no_traffic_and_colocated_are_said() -> None:
    with pytest.raises(NoTraffic, match="no request ended in the 10 s window"):
        load_between(AFTER, AFTER, 10.0)
    with pytest.raises(ValueError, match="colocated"):
        load_between(colocated_metrics(0), colocated_metrics(5), 10.0)


def test_plan_from_recorded_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before, after, profile = tmp_path / "before", tmp_path / "after", tmp_path / "profile.json"
    before.write_text(BEFORE)
    after.write_text(AFTER)
    profile.write_text(json.dumps({"prefill_tokens_per_s": 1000.0, "itl_base_s": 0.02,
                                   "itl_per_seq_s": 0.001, "max_num_seqs": 64}))
    args = ["plan", "--profile", str(profile), "--metrics", str(before), str(after),
            "--window", "10", "--ttft-ms", "500", "--tpot-ms", "50"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # S = 200 · 0.75 / 1000 = 0.15 s; P = 1: ρ = 2.2 · 0.15 = 0.33,
    # W = 0.33 · 0.15 / (2 · 0.67) = 0.036940 s: TTFT = 186.94 ms.
    assert report["plan"]["prefill"] == 1
    assert report["plan"]["ttft_ms"] == pytest.approx(150 + 1000 * 0.0495 / 1.34)
    assert "patch" not in report  # no --rayservice: the plan only
    assert main([*args, "--tpot-ms", "10"]) == 1
    assert "TPOT target 10.0 ms is below" in capsys.readouterr().err


def test_load_from_a_served_metrics_endpoint(tmp_path: Path) -> None:
    """The live path: two GETs of /metrics from a real HTTP server; the second read happens
    after the window, when the counters have moved (the wait swaps the served text)."""
    (tmp_path / "metrics").write_text(BEFORE)
    windows: list[float] = []

    def window_passes(seconds: float) -> None:
        windows.append(seconds)
        (tmp_path / "metrics").write_text(AFTER)

    with static_server(tmp_path, "/metrics") as (url, _):
        load = observe(url, 10.0, wait=window_passes)
    assert windows == [10.0]
    # The elapsed time is measured, not assumed: here it is what the swap took, not 10 s, so
    # only the per-request means and the hit rate are exact.
    assert load.prompt_tokens == pytest.approx(200.0) and load.output_tokens == 50.0
    assert load.hit_rate == pytest.approx(0.25) and load.rate > 0


def test_a_bad_profile_is_named(tmp_path: Path) -> None:
    for data, message in (({"itl_base_s": 0.03}, r"missing keys \['itl_per_seq_s', "
                                                  r"'prefill_tokens_per_s'\]"),
                          ({"prefill_tokens_per_s": "x", "itl_base_s": 0.03,
                            "itl_per_seq_s": 0.02}, "prefill_tokens_per_s must be a float")):
        path = tmp_path / "profile.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            load_profile(path)


def test_garbage_and_a_hung_gateway_are_one_line_each(tmp_path: Path) -> None:
    """`tandem plan --url` against a real server process answering garbage, then stopped
    (SIGSTOP): exit 2 with one line each, the hung one after the read's 5 s timeout."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"prefill_tokens_per_s": 800.0, "itl_base_s": 0.03,
                                   "itl_per_seq_s": 0.02}))
    (tmp_path / "metrics").write_text("this is { not prometheus\n")

    def plan(url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tandem.services.cli", "plan", "--url", url,
                               "--window", "0.1", "--profile", str(profile), "--ttft-ms", "500",
                               "--tpot-ms", "100"], capture_output=True, text=True, timeout=60)

    with static_server(tmp_path, "/metrics") as (url, server):
        garbage = plan(url)
        assert garbage.returncode == 2
        assert garbage.stderr.startswith(f"tandem: error: {url}/metrics is not Prometheus "
                                         "text ("), garbage.stderr
        server.send_signal(signal.SIGSTOP)
        hung = plan(url)
        assert (hung.returncode, hung.stderr) == (
            2, f"tandem: error: cannot read {url}/metrics: timed out\n")
