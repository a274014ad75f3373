"""Small helpers the engine tests share."""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams


def chat(engine: LLMEngine, text: str) -> list[int]:
    """A one-message chat prompt, as the gateway renders it."""
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams,
        output: Sequence[int] = ()) -> list[int]:
    """One request to its end, stepping the engine; ``output``: tokens it made elsewhere
    (a resumed request), not repeated in the result."""
    engine.add_request("r", prompt, params, output_token_ids=output)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens
