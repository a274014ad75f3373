"""Hugging Face model ids (`--model org/name[@revision]`), resolved by the real huggingface_hub
from a hub cache this test writes in the hub's own layout, offline (HF_HUB_OFFLINE=1).

huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported, so each check runs in a
fresh Python process with them set."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.services.engine.model_loader import LoadedModel

REPO = "tandem-test/tiny-llama"
COMMIT = hashlib.sha1(b"tandem tiny llama").hexdigest()

LOAD = """
import hashlib, json, sys
from tandem.services.engine.model_loader import ModelLoadError, load_model
try:
    loaded = load_model(sys.argv[1], progress=False)
except ModelLoadError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    digest = hashlib.sha256()
    for name in sorted(loaded.weights):
        digest.update(name.encode() + loaded.weights[name].numpy().tobytes())
    print(json.dumps({"model_id": loaded.config.model_id, "source": str(loaded.source),
                      "weights": digest.hexdigest()}))
"""


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory: pytest.TempPathFactory, loaded_model: LoadedModel) -> Path:
    """An HF_HOME whose hub cache holds REPO at COMMIT (refs/main points at it), as
    `huggingface-cli download` leaves it."""
    import transformers as tf

    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    tf.LlamaForCausalLM(config).save_pretrained(snapshot)
    loaded_model.tokenizer.backend.save(str(snapshot / "tokenizer.json"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home


def load_in_process(model: str, home: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", LOAD, model], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_hub_id_loads_the_cached_snapshot_under_its_own_name(hub_home: Path) -> None:
    by_id = load_in_process(REPO, hub_home)
    snapshot = hub_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    by_path = load_in_process(str(snapshot), hub_home)
    assert by_id["source"] == str(snapshot)
    assert by_id["weights"] == by_path["weights"]
    # The id, not the commit folder's name, names the model (the API's model, the KV hashes).
    assert by_id["model_id"] == by_path["model_id"] == REPO


def test_a_revision_selects_that_snapshot(hub_home: Path) -> None:
    assert load_in_process(f"{REPO}@{COMMIT}", hub_home)["source"].endswith(COMMIT)


@pytest.mark.parametrize("model", ["tandem-test/not-there", f"{REPO}@no-such-branch"])
def test_a_missing_hub_model_says_where_it_looked(hub_home: Path, model: str) -> None:
    error = load_in_process(model, hub_home)["error"]
    assert model in error
    assert str(hub_home / "hub") in error and "HF_HUB_OFFLINE" in error


def test_a_missing_local_path_is_not_taken_for_a_hub_id(hub_home: Path, tmp_path: Path) -> None:
    error = load_in_process(str(tmp_path / "nope"), hub_home)["error"]
    assert error == f"model path does not exist: {tmp_path / 'nope'}"
