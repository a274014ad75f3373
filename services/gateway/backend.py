"""The narrow interface the gateway needs from whatever generates tokens.

Colocated mode wraps one ``AsyncEngine``; the disaggregated backend (router + prefill + decode)
implements the same protocol. Token ids go in and come out: text stays in the gateway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tandem.services.protocol.outputs import EngineStats, RequestOutput
from tandem.services.protocol.request import GenerationRequest

if TYPE_CHECKING:  # the gateway runs without torch; only colocated mode builds an engine
    from tandem.services.engine.async_engine import AsyncEngine


@runtime_checkable
class GenerationBackend(Protocol):
    """Streams ``RequestOutput``s for a tokenized request.

    ``generate`` raises ``tandem.services.protocol.outputs.RequestError`` for an invalid request and
    ``EngineOverloadedError`` when its queues are full (both when the stream is first awaited);
    closing the stream before it finishes aborts the request and frees its KV blocks.
    """

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]: ...

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


@runtime_checkable
class HealthReporting(Protocol):
    """Optional: a backend that can tell it cannot serve (the gateway's /health says 503)."""

    def health_problem(self) -> str | None:
        """None while the backend can serve; else why not, for an operator."""
        ...


class EngineBackend:
    """Colocated mode: one in-process engine does prefill and decode."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(request)

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def attention_backend(self) -> str:
        """The attention backend the engine runs (auto resolved)."""
        return self.engine.llm.attention_backend

    def health_problem(self) -> str | None:
        return None if self.engine.healthy else f"the engine stopped: {self.engine.health_error}"

    @property
    def model_id(self) -> str:
        return self.engine.llm.model_config.model_id

    @property
    def max_model_len(self) -> int:
        return self.engine.llm.max_model_len
