"""Small helpers the engine tests share."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.protocol.outputs import RequestOutput
from tandem.services.protocol.request import GenerationRequest, SamplingParams


def chat(engine: LLMEngine, text: str) -> list[int]:
    """A one-message chat prompt, as the gateway renders it."""
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams,
        output: Sequence[int] = ()) -> list[int]:
    """One request to its end, stepping the engine; ``output``: tokens it made elsewhere
    (a resumed request), not repeated in the result."""
    return [t for out in outputs(engine, prompt, params, output) for t in out.new_token_ids]


def outputs(engine: LLMEngine, prompt: list[int], params: SamplingParams,
            output: Sequence[int] = (), request_id: str = "r") -> list[RequestOutput]:
    """``run``'s request, as the engine's outputs."""
    engine.add_request(GenerationRequest(request_id, prompt, params,
                                         output_token_ids=tuple(output)))
    found: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        found += [out for out in engine.step() if out.request_id == request_id]
    return found
