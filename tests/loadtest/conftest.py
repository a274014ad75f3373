from __future__ import annotations

import pytest

from tandem.loadtest.bench.prompts import PromptMaker
from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.engine.tokenizer_loader import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="session")
def maker(tokenizer: Tokenizer) -> PromptMaker:
    return PromptMaker(tokenizer)
