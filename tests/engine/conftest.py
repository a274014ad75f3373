from __future__ import annotations

import pytest

from tandem.services.engine.model_loader import LoadedModel
from tests.conftest import MAX_NEW_TOKENS
from tests.hf_reference import Reference, hf_greedy
from tests.prompts import shared_prefix_prompts

# prompts, hf_model and references live in tests/conftest.py (the disaggregation tests use them).


@pytest.fixture(scope="session")
def prefix_prompts(loaded_model: LoadedModel) -> list[list[int]]:
    return shared_prefix_prompts(loaded_model.tokenizer)


@pytest.fixture(scope="session")
def prefix_references(hf_model, prefix_prompts: list[list[int]]) -> list[Reference]:  # type: ignore[no-untyped-def]
    return [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prefix_prompts]
