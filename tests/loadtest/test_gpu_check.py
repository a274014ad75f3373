"""``python -m loadtest.gpu_check`` runs end to end: its ``--tiny`` mode, on the CPU with the
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

from loadtest import gpu_check  # noqa: E402


def test_tiny_run_checks_and_times_every_section(tmp_path: Path) -> None:
    assert gpu_check.main(["--tiny", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["ok"]
    assert set(results["kernels"]) == {"decode", "mixed", "split_kv"}
    assert all(case["ok"] for case in results["kernels"].values())
    assert results["sampler"] == {"noise_equals_cpu": True, "batch_equals_alone": True,
                                  "ok": True}
    assert results["agreement"]["equal"] == results["agreement"]["steps"]  # float32: exact
    assert len(results["decode"]) == 4
    assert all(row["triton_ms"] > 0 and row["torch_ms"] > 0 and row["floor_ms"] > 0
               and row["triton_graph_ms"] > 0 for row in results["decode"])
    assert results["prefill"][0]["triton_tokens_per_s"] > 0


def test_refuses_to_run_without_a_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the full check would run")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", "/nonexistent"])
