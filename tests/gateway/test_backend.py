from __future__ import annotations

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.gateway.backend import EngineBackend, GenerationBackend
from tests.gateway.conftest import MAX_MODEL_LEN


def test_colocated_engine_is_a_generation_backend(async_engine: AsyncEngine) -> None:
    backend = EngineBackend(async_engine)
    assert isinstance(backend, GenerationBackend)
    assert backend.model_id == "SmolLM2-135M-Instruct"
    assert backend.max_model_len == MAX_MODEL_LEN
    assert backend.stats.num_blocks == async_engine.stats.num_blocks
