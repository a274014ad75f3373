"""The weight-free tokenizer loader reads the same fields as the gguf package."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.engine.tokenizer_loader import (
    ModelLoadError,
    builtin_model_path,
    load_tokenizer,
    read_gguf_metadata,
)


def test_metadata_matches_the_gguf_reader() -> None:
    import gguf
    path = builtin_model_path()
    ours = read_gguf_metadata(path)
    fields = gguf.GGUFReader(str(path)).fields
    assert set(ours) == {k for k in fields if not k.startswith("GGUF.")}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.bos_token_id", "general.architecture", "llama.context_length",
                "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"):
        assert ours[key] == fields[key].contents(), key


def test_loaded_tokenizer_round_trips(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello, world! 123")
    assert tokenizer.decode(ids) == "Hello, world! 123"
    assert tokenizer.vocab_size == 49152
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith(
        "<|im_start|>assistant\n")


def test_bad_paths_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_tokenizer(junk)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(builtin_model_path().read_bytes()[:100_000])
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load_tokenizer(truncated)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
