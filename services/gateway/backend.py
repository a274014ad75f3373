"""The narrow interface the gateway needs from whatever generates tokens.

Colocated mode wraps one ``AsyncEngine``; the disaggregated backend (router + prefill + decode)
implements the same protocol. Token ids go in and come out: text stays in the gateway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

from services.engine.async_engine import AsyncEngine
from services.engine.engine import EngineStats, RequestOutput
from services.engine.sampling_params import SamplingParams


@runtime_checkable
class GenerationBackend(Protocol):
    """Streams ``RequestOutput``s for a tokenized prompt.

    ``generate`` raises ``services.engine.engine.RequestError`` for an invalid request and
    ``EngineOverloadedError`` when its queues are full (both when the stream is first awaited);
    closing the stream before it finishes aborts the request and frees its KV blocks.
    """

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams, cache_salt: str | None = None
                 ) -> AsyncIterator[RequestOutput]: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def model_id(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...


@runtime_checkable
class MultiWorkerStats(Protocol):
    """Optional: a backend with several workers reports each one's stats (the ``worker`` label)."""

    def worker_stats(self) -> Mapping[str, EngineStats]: ...


class EngineBackend:
    """Colocated mode: one in-process engine does prefill and decode."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams, cache_salt: str | None = None
                 ) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(request_id, prompt_token_ids, params, cache_salt)

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def model_id(self) -> str:
        return self.engine.engine.model_config.model_id

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len
