"""Bad input raises a clear error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import shutil

import pytest

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import ModelLoadError, builtin_model_path, load_model
from tandem.services.protocol.outputs import EngineOverloadedError, RequestError
from tandem.services.protocol.request import GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_k": -2}, "top_k"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_leave_the_engine_serving(make_engine):
    engine = make_engine(max_model_len=256)
    good = engine.tokenizer.encode("The sky is")
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(GenerationRequest("empty", [], GREEDY))
    with pytest.raises(RequestError, match="context length is 256"):
        engine.add_request(GenerationRequest("long", [42] * 300, GREEDY))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request(GenerationRequest("vocab", [10**9], GREEDY))
    engine.add_request(GenerationRequest("dup", good, GREEDY))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request(GenerationRequest("dup", good, GREEDY))
    engine.abort_request("dup")
    assert engine.generate([good], GREEDY)[0] == make_engine().generate([good], GREEDY)[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_full_waiting_queue_is_refused(make_engine):
    engine = make_engine(max_waiting=2)
    prompt = engine.tokenizer.encode("Hello")
    engine.add_request(GenerationRequest("a", prompt, GREEDY))
    engine.add_request(GenerationRequest("b", prompt, GREEDY))
    with pytest.raises(EngineOverloadedError, match="retry later"):
        engine.add_request(GenerationRequest("c", prompt, GREEDY))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(GenerationRequest("c", prompt, GREEDY))  # room again


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope.gguf")))


def test_corrupt_gguf(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file" * 100)
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(garbage)
    truncated = tmp_path / "truncated.gguf"
    with builtin_model_path().open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(4_000_000))
    with pytest.raises(ModelLoadError, match=r"truncated.gguf \(tensor .* runs past the end"):
        load_model(truncated)


def test_directory_without_model(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_model(tmp_path)
    shutil.copy(builtin_model_path(), tmp_path / "copy.gguf")  # a valid model next door loads
    assert load_model(tmp_path / "copy.gguf", progress=False).config.num_layers == 30


def test_bad_engine_config():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
