"""`tandem fetch MODEL`, the chart's init container (model.hubId): the real huggingface_hub
resolves a hub id from a cache this test writes in the hub's own layout, offline
(HF_HUB_OFFLINE=1), in a fresh process (huggingface_hub reads HF_HOME when it is imported)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = "tandem-test/fetched-llama"
COMMIT = hashlib.sha1(b"tandem fetched llama").hexdigest()
# A made-up token: huggingface_hub reads HF_TOKEN; `tandem fetch` must never show it.
TOKEN = "hf_test_token_not_a_secret_0123456789"


def write_hub_cache(home: Path) -> Path:
    """Make `home` an HF_HOME whose hub cache holds REPO at COMMIT, refs/main pointing at it,
    as `huggingface-cli download` leaves it; returns the snapshot's directory."""
    repo = home / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (snapshot / "tokenizer.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    write_hub_cache(home)
    return home


def fetch(model: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_TOKEN": TOKEN}
    env.pop("HF_HUB_CACHE", None)
    result = subprocess.run([sys.executable, "-m", "tandem.services.cli", "fetch", model],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert TOKEN not in result.stdout + result.stderr
    return result


def snapshot_of(home: Path) -> Path:
    return home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT


@pytest.mark.parametrize("model", [REPO, f"{REPO}@main", f"{REPO}@{COMMIT}"])
def test_fetch_prints_the_cached_snapshot(hub_home: Path, model: str) -> None:
    result = fetch(model, hub_home)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(snapshot_of(hub_home))


def test_a_model_missing_from_the_cache_fails_naming_it(hub_home: Path) -> None:
    result = fetch("tandem-test/not-there", hub_home)
    assert result.returncode != 0 and not result.stdout
    assert result.stderr.startswith("tandem: error: ")
    assert "'tandem-test/not-there'" in result.stderr
    assert "HF_HUB_OFFLINE" in result.stderr  # why it was not downloaded


@pytest.mark.parametrize("model", ["just-a-name", "/models/llama", "org/name/extra"])
def test_only_a_hub_id_is_fetched(hub_home: Path, model: str) -> None:
    result = fetch(model, hub_home)
    assert result.returncode != 0 and not result.stdout
    assert result.stderr == (f"tandem: error: {model!r} is not a Hugging Face model id, "
                             f"org/name[@revision]\n")
