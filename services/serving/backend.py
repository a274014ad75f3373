"""The disaggregated ``GenerationBackend``: route, prefill on P, first token at once, decode on D.

Token ids in, ``RequestOutput``s out, like the colocated ``EngineBackend``. The decode worker
streams lists of outputs (whatever its engine produced since the previous list), so a request
costs one streaming call to D, not one remote call per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle

from router import Router, RoutingDecision
from services import tracing
from services.control.codec import logprobs_from_dict, params_to_dict
from services.decode.errors import DecodeRejectedError
from services.engine.engine import EngineOverloadedError, EngineStats, RequestError, RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import FinishReason
from services.prefill.result import PrefillResult
from services.serving.cluster_view import ClusterView, WorkerSnapshot

log = logging.getLogger(__name__)


class DisaggBackend:
    def __init__(self, router: Router, view: ClusterView, prefill: DeploymentHandle,
                 decode: DeploymentHandle, model_id: str, max_model_len: int) -> None:
        self.router = router
        self.view = view
        self.prefill = prefill
        self.decode = decode.options(stream=True)
        self._model_id = model_id
        self._max_model_len = max_model_len
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def stats(self) -> EngineStats:
        return sum_stats([w.stats for w in self.view.workers.values()])

    def worker_stats(self) -> Mapping[str, EngineStats]:
        return {w.worker_id: w.stats for w in self.view.workers.values()}

    def snapshots(self) -> list[WorkerSnapshot]:
        return list(self.view.workers.values())

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams, cache_salt: str | None = None
                 ) -> AsyncIterator[RequestOutput]:
        # The caller's trace context now (the gateway's request span) parents the router's and
        # the workers' spans, whichever task later iterates the stream.
        parent = otel_context.get_current() if tracing.enabled() else None
        return self._generate(request_id, list(prompt_token_ids), params, cache_salt, parent)

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                        cache_salt: str | None, parent: Context | None
                        ) -> AsyncIterator[RequestOutput]:
        decision = self._route(request_id, prompt, cache_salt, parent)
        carrier = tracing.inject(parent)
        wire_params = params_to_dict(params)
        first: PrefillResult | None = None
        address = None
        if decision.prefill_worker is not None:
            try:
                reply = await _call(self.prefill.prefill.remote(
                    request_id, prompt, wire_params, cache_salt,
                    route_to=decision.prefill_worker, trace=carrier))
            finally:
                self.router.release(request_id)
            self.view.ingest(reply)
            first, address = PrefillResult.from_dict(reply["result"]), reply["address"]
            handed_over = False
            try:
                yield _first_output(first, len(prompt))
                handed_over = True
            finally:
                if not handed_over and first.kv is not None:
                    # Closed before D took the lease (D rejects it itself once it has it).
                    self._reject_later(reply["worker_id"], first.kv.lease_id, request_id)
            if first.finished:
                return
        async for output in self._decode(request_id, prompt, wire_params, first, address,
                                         cache_salt, decision.decode_worker, carrier):
            yield output

    def _route(self, request_id: str, prompt: list[int], cache_salt: str | None,
               parent: Context | None) -> RoutingDecision:
        span = tracing.start_span("router.decision", parent)
        try:
            decision = self.router.route(prompt, cache_salt=cache_salt, request_id=request_id)
        except BaseException as exc:
            tracing.end_with_error(span, exc)
            raise
        if span.is_recording():
            span.set_attributes(decision_attributes(decision))
        span.end()
        return decision

    async def _decode(self, request_id: str, prompt: list[int], params: dict[str, Any],
                      first: PrefillResult | None, address: str | None,
                      cache_salt: str | None, decode_worker: str | None,
                      carrier: dict[str, str] | None) -> AsyncIterator[RequestOutput]:
        stream = self.decode.generate.remote(
            request_id, prompt, params, None if first is None else first.to_dict(), address,
            cache_salt, route_to=decode_worker, trace=carrier)
        cached = 0 if first is None else first.num_cached_tokens
        finished = False
        try:
            async for batch in _stream(stream):
                for item in batch:
                    if "report" in item:
                        self.view.ingest(item["report"])
                        continue
                    out = _output(request_id, item, len(prompt), cached)
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                stream.cancel()

    def _reject_later(self, worker_id: str, lease_id: str, request_id: str) -> None:
        async def reject() -> None:
            try:
                await self.prefill.reject.remote(lease_id, "aborted", route_to=worker_id)
            except Exception as exc:  # the lease expires on its own
                log.warning("request %s: reject of lease %s failed: %r", request_id, lease_id,
                            exc)

        task = asyncio.ensure_future(reject())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(Exception):
                await task


# Candidates named on a router span, at most: enough to see a choice, bounded for big clusters.
MAX_TRACED_CANDIDATES = 16


def decision_attributes(decision: RoutingDecision) -> dict[str, Any]:
    """The router's choice, its reason and the candidates' scores, as span attributes."""
    attributes: dict[str, Any] = {
        "tandem.request_id": decision.request_id,
        "tandem.router.reason": decision.reason,
        "tandem.router.detail": decision.detail,
        "tandem.router.prefill_worker": decision.prefill_worker or "",
        "tandem.router.decode_worker": decision.decode_worker or "",
        "tandem.router.prompt_blocks": decision.prompt_blocks,
        "tandem.router.cached_blocks": decision.cached_blocks,
    }
    for role, scores in (("prefill", decision.prefill_scores),
                         ("decode", decision.decode_scores)):
        shown = list(scores.items())[:MAX_TRACED_CANDIDATES]
        attributes[f"tandem.router.{role}_candidates"] = [worker for worker, _ in shown]
        attributes[f"tandem.router.{role}_scores"] = [float(score) for _, score in shown]
    return attributes


def _first_output(first: PrefillResult, num_prompt: int) -> RequestOutput:
    return RequestOutput(first.request_id, [first.first_token], list(first.logprobs),
                         first.finished,
                         None if first.finish_reason is None else FinishReason(first.finish_reason),
                         num_prompt, 1, first.num_cached_tokens)


def _output(request_id: str, item: dict[str, Any], num_prompt: int, cached: int
            ) -> RequestOutput:
    reason = item["f"]
    return RequestOutput(request_id, list(item["t"]), [logprobs_from_dict(lp) for lp in item["lp"]],
                         reason is not None, None if reason is None else FinishReason(reason),
                         num_prompt, int(item["n"]), cached)


def _clean(exc: BaseException) -> BaseException:
    """Replica errors arrive wrapped in RayTaskError; give the gateway the plain error."""
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    if isinstance(cause, RequestError):
        return RequestError(str(cause))
    if isinstance(cause, EngineOverloadedError | DecodeRejectedError):
        return EngineOverloadedError(str(cause))
    return exc


async def _call(response: Any) -> Any:
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise
    except Exception as exc:
        cleaned = _clean(exc)
        if cleaned is exc:
            raise
        raise cleaned from None


async def _stream(stream: Any) -> AsyncIterator[Any]:
    try:
        async for batch in stream:
            yield batch
    except Exception as exc:
        cleaned = _clean(exc)
        if cleaned is exc:
            raise
        raise cleaned from None


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    blocks = sum(s.num_blocks for s in stats)
    free = sum(s.num_free_blocks for s in stats)
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats), num_free_blocks=free,
        num_blocks=blocks, kv_cache_usage=1.0 - free / blocks if blocks else 0.0,
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_pinned=sum(s.num_pinned for s in stats),
        num_importing=sum(s.num_importing for s in stats),
        spec_draft_tokens=sum(s.spec_draft_tokens for s in stats),
        spec_accepted_tokens=sum(s.spec_accepted_tokens for s in stats),
        spec_steps=sum(s.spec_steps for s in stats))
