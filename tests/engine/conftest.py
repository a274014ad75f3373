from __future__ import annotations

import pytest

from services.engine.model_loader import LoadedModel
from tests.conftest import MAX_NEW_TOKENS
from tests.hf_reference import Reference, hf_greedy, load_hf_model
from tests.prompts import prompt_set, shared_prefix_prompts


@pytest.fixture(scope="session")
def prompts(loaded_model: LoadedModel) -> list[list[int]]:
    return prompt_set(loaded_model.tokenizer)


@pytest.fixture(scope="session")
def prefix_prompts(loaded_model: LoadedModel) -> list[list[int]]:
    return shared_prefix_prompts(loaded_model.tokenizer)


@pytest.fixture(scope="session")
def hf_model(loaded_model: LoadedModel):  # type: ignore[no-untyped-def]
    return load_hf_model(loaded_model.source)


@pytest.fixture(scope="session")
def references(hf_model, prompts: list[list[int]]) -> list[Reference]:  # type: ignore[no-untyped-def]
    return [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="session")
def prefix_references(hf_model, prefix_prompts: list[list[int]]) -> list[Reference]:  # type: ignore[no-untyped-def]
    return [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prefix_prompts]
