from __future__ import annotations

import pytest

from tandem.services.engine.model_loader import LoadedModel
from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.gateway.pipeline import IncrementalDetokenizer

# CJK and emoji: byte-level BPE splits these characters across tokens.
TEXT = "Tandem says héllo 日本語 and 🤖🚀 — naïve café, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done."


@pytest.fixture(scope="module")
def tokenizer(loaded_model: LoadedModel) -> Tokenizer:
    return loaded_model.tokenizer


def stream(tokenizer: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt or [])
    deltas = [detok.push(t) for t in ids]
    return [*deltas, detok.flush()]


def test_tokens_ending_mid_character_are_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    # The case under test exists: some tokens are partial UTF-8 characters on their own.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    deltas = stream(tokenizer, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT


def test_prompt_context_does_not_leak_into_the_output(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Say something in Japanese: 日本")
    ids = tokenizer.encode("語 is a word 🤖")
    assert "".join(stream(tokenizer, ids, prompt)) == tokenizer.decode(ids)


def test_flush_emits_a_dangling_partial_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🤖")
    assert len(ids) > 1
    cut = ids[:-1]  # generation stopped inside the character
    deltas = stream(tokenizer, cut)
    assert deltas[:-1] == [""] * len(cut)
    assert "".join(deltas) == tokenizer.decode(cut)


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hi") + list(tokenizer.eos_token_ids)
    assert "".join(stream(tokenizer, ids)) == "Hi"
