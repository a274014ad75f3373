"""The gateway, the router and the tokenizer loader run without torch; the CLI loads lazily."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.services.engine.model_loader import LoadedModel
from tandem.services.engine.tokenizer_loader import (
    ModelLoadError,
    ModelMetadata,
    load_model_metadata,
)

ROOT = Path(__file__).resolve().parents[2]

TEXTS = ["Hello, world! 123", "  leading spaces\tand\ttabs\n\nnewlines", "naïve café 東京 🚀",
         "<|im_start|>user\nspecial tokens in text<|im_end|>", "x" * 300, ""]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a haiku about paged memory."},
     {"role": "assistant", "content": "Blocks fill, then move on."},
     {"role": "user", "content": "Another, in 東京."}],
]


def modules_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter has imported once ``code`` has run."""
    probe = textwrap.dedent(code) + textwrap.dedent("""
        import json, sys
        print(json.dumps(sorted({".".join(name.split(".")[:2]) if name.startswith("tandem.")
                                 else name.partition(".")[0] for name in sys.modules})))
    """)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def metadata() -> ModelMetadata:
    return load_model_metadata()


def test_gateway_router_and_tokenizer_loader_import_no_torch() -> None:
    loaded = modules_after("""
        import tandem.router
        import tandem.services.gateway
        from tandem.services.engine.tokenizer_loader import load_model_metadata
        meta = load_model_metadata()
        assert meta.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    """)
    assert {"tandem.services", "tandem.router", "tokenizers"} <= loaded
    assert not loaded & {"torch", "transformers"}


def test_gateway_replica_imports_no_torch() -> None:
    """What the Ray Serve gateway replica imports (the class Serve loads, the disaggregated
    backend, the request and report messages): the model's weights stay on the workers."""
    loaded = modules_after("""
        import tandem.services.serving.gateway, tandem.services.serving.backend
        import tandem.services.protocol.messages
        import tandem.services.protocol.request
    """)
    assert {"ray", "tandem.router", "tandem.services"} <= loaded
    assert not loaded & {"torch", "transformers"}


def test_cli_imports_loadtest_only_for_bench() -> None:
    loaded = modules_after("""
        import contextlib, io
        from tandem.services import cli
        for argv in (["--help"], ["up", "--help"], ["chat", "--help"]):
            with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
                cli.main(argv)
    """)
    assert "tandem.services" in loaded
    assert not loaded & {"tandem.loadtest", "matplotlib", "torch"}
    bench = modules_after("""
        import contextlib, io
        from tandem.services import cli
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
            cli.main(["bench", "--help"])
    """)
    assert "tandem.loadtest" in bench


def test_metadata_matches_the_loaded_model(metadata: ModelMetadata,
                                           loaded_model: LoadedModel) -> None:
    # model_id keys the block hashes the gateway shares with the workers.
    assert metadata.model_id == loaded_model.config.model_id == "SmolLM2-135M-Instruct"
    assert metadata.max_position_embeddings == loaded_model.config.max_position_embeddings
    assert metadata.source == loaded_model.source
    ours, theirs = metadata.tokenizer, loaded_model.tokenizer
    assert ours.vocab_size == theirs.vocab_size
    assert (ours.eos_token_ids, ours.bos_token_id) == (theirs.eos_token_ids, theirs.bos_token_id)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
            ids, skip_special_tokens=False)
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
        assert ours.encode_chat(messages) == theirs.encode_chat(messages)


def test_hugging_face_directory(metadata: ModelMetadata, tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir()
    metadata.tokenizer.backend.save(str(model_dir / "tokenizer.json"))
    (model_dir / "config.json").write_text(json.dumps(
        {"max_position_embeddings": 4096, "eos_token_id": [2, 0], "bos_token_id": 1}))
    loaded = load_model_metadata(model_dir)
    assert (loaded.model_id, loaded.max_position_embeddings) == ("tiny-llama", 4096)
    assert loaded.tokenizer.eos_token_ids == (2, 0)
    assert loaded.tokenizer.encode(TEXTS[2]) == metadata.tokenizer.encode(TEXTS[2])


def test_generation_config_adds_eos_ids_and_request_defaults(metadata: ModelMetadata,
                                                              tmp_path: Path) -> None:
    model_dir = tmp_path / "tuned"
    model_dir.mkdir()
    metadata.tokenizer.backend.save(str(model_dir / "tokenizer.json"))
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_model_metadata(model_dir).sampling_defaults == {}
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "top_k": 20,
         "do_sample": True, "max_new_tokens": 100, "min_p": None}))
    loaded = load_model_metadata(model_dir)
    assert loaded.tokenizer.eos_token_ids == (2, 7)
    assert loaded.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (model_dir / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        load_model_metadata(model_dir)
