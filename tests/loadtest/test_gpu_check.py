"""``python -m tandem.loadtest.gpu_check`` runs end to end: its ``--tiny`` mode, on the CPU with the
Triton interpreter, goes through every section the H200 run does (the device run itself is
issue 15's benchmark, not a test)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels' module is imported
    os.environ["TRITON_INTERPRET"] = "1"

from tandem.loadtest import gpu_check  # noqa: E402


def test_tiny_run_checks_and_times_every_section(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--tiny", "--out", str(tmp_path), "--sections",
                           *gpu_check.SECTIONS]) == 0
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    printed = capsys.readouterr().out
    assert all(json.dumps(row) in printed for row in rows)  # each line printed as it was made
    by = {}
    for row in rows:
        by.setdefault(row["section"], []).append(row)
    assert by["info"][0]["model"] == "tiny"
    kernels = {(r["backend"], r.get("case")): r for r in by["kernels"]}
    assert {case for backend, case in kernels if backend == "triton_int8"} == {"decode", "mixed"}
    assert kernels[("triton", "int8_store_bytes")]["mismatched"] == 0
    assert "skipped" in kernels[("flash_attn", None)]  # not installed here
    assert all(r["ok"] for r in by["kernels"] if "ok" in r)
    assert by["sampler"][0]["ok"]
    agreement = {r.get("variant", "tokens"): r for r in by["agreement"]}
    assert agreement["graph_self_check"]["problem"] is None
    assert agreement["tokens"]["torch_triton_equal"] == 8  # float32: exact
    assert agreement["tokens"]["graph_equals_eager"]
    assert len(by["decode"]) == 4
    assert all(row["triton_ms"] > 0 and row["torch_ms"] > 0 and row["floor_ms"] > 0
               and row["triton_graph_ms"] > 0 and row["projections_graph_ms"] > 0
               for row in by["decode"])
    assert by["prefill"][0]["triton_tokens_per_s"] > 0
    assert {r["kind"] for r in by["sweep"]} == {"decode", "decode_splits", "prefill"}
    projections = {(r["rows"], r["projection"]) for r in by["projections"]}
    assert projections == {(rows, name) for rows in (1, 16)
                           for name in ("qkv", "o", "gate_up", "down", "head")}
    assert all(r["ok"] and r["triton_best_ms"] > 0 for r in by["projections"])
    assert [r["batch"] for r in by["decode_triton_projections"]] == [1, 1]  # two contexts
    assert {r["run"] for r in by["profile"]} == {"eager", "graph"}
    assert all(r["launches_per_step"] > 0 for r in by["profile"])
    assert (tmp_path / "profile_graph.txt").read_text()
    # One verdict per target: numerics, decode at batch 1 and the largest batch per context,
    # prefill per prompt; each also printed as a VERDICT line.
    verdicts = by["verdict"]
    assert len(verdicts) == 1 + 4 + 1 and verdicts[0]["met"]
    assert printed.count("VERDICT ") == len(verdicts)


def test_refuses_to_run_without_a_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the full check would run")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", "/nonexistent"])
