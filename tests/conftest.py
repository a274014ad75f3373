from __future__ import annotations

import pytest

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import LoadedModel, load_model

MAX_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    return load_model(progress=False)


@pytest.fixture(scope="session")
def make_engine(loaded_model: LoadedModel):  # type: ignore[no-untyped-def]
    """Build an engine on the session's weights (a fresh KV cache and scheduler each time)."""

    def make(**overrides: object) -> LLMEngine:
        config = EngineConfig(**{"num_kv_blocks": 1024, **overrides})  # type: ignore[arg-type]
        return LLMEngine(config, loaded_model)

    return make
