"""``python -m tandem.loadtest.export_hf``: the directory our loader writes is the same model to
transformers (the peers' loader): greedy tokens equal the GGUF reference's, the tokenizer
encodes and the chat template renders as ours."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.loadtest.export_hf import main
from tests.hf_reference import hf_greedy

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "naïve café — 東京 🚀",
         "def f(x):\n    return x ** 2  # code"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    assert main(["--out", str(out)]) == 0
    return out


def test_transformers_generates_the_reference_tokens(exported, prompts, references) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert hf_greedy(model, prompts[0], 16).tokens == references[0].tokens[:16]


def test_tokenizer_and_chat_template_are_ours(exported, loaded_model) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(exported))
    ours = loaded_model.tokenizer
    for text in TEXTS:
        assert theirs.encode(text) == ours.encode(text), text
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a prime number?"}]
    assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ours.apply_chat_template(messages, add_generation_prompt=True))
