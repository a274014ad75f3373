"""The disaggregated ``GenerationBackend``: route, prefill on P, first token at once, decode on D.

Token ids in, ``RequestOutput``s out, like the colocated ``EngineBackend``. Each decode worker
streams this gateway the outputs of all its requests on one channel (``DecodeChannel``, opened
on the first request routed there), so a request costs one unary submit to D, not a stream of
its own (Serve's streams deliver a limited number of spaced items a second in all) nor one
remote call per token.

A request whose decode worker fails (its replica died, its engine stopped, it sent the request
nothing for ``stream_idle_s``) migrates: it goes to the router's next decode worker with the
tokens it already produced (``GenerationRequest.output_token_ids``); that worker recomputes
them with the prompt (or finds them in its prefix cache) and continues. Sampling draws depend
only on the request's seed and the token's position (engine/sampler.py), so the caller sees one
stream, exactly as an undisturbed worker would have produced it.

A stream survives ``max_migrations`` such failures. The next worker that fails while running it
fails it instead (500 ``engine_error``): a request that every worker it reaches dies on (a poison
request: a kernel fault, a hang) would otherwise take each worker down in turn.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from ray.serve.handle import DeploymentHandle

from tandem.router import NoHealthyWorkers, Router, RoutingDecision
from tandem.services import tracing
from tandem.services.protocol.handoff import PrefillResult
from tandem.services.protocol.messages import ReplicaGoneError
from tandem.services.protocol.outputs import (
    DeadlineExceededError,
    EngineDeadError,
    EngineError,
    EngineStats,
    FinishReason,
    RequestOutput,
    UnavailableError,
)
from tandem.services.protocol.request import GenerationRequest
from tandem.services.serving.cluster_view import ClusterView, WorkerSnapshot, known_replicas
from tandem.services.serving.decode_channel import DecodeChannel, StreamStalledError, call

log = logging.getLogger(__name__)


# Calls that find the chosen replica gone are sent to another worker at most this many times.
MAX_FAILOVERS = 2
# Time from a decode worker's failure to the migrated stream's next token.
RESUME_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class MigrationStats:
    """Decode streams moved to another worker, by reason, and how long each took to resume."""

    by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    resume_buckets: list[int] = dataclasses.field(
        default_factory=lambda: [0] * (len(RESUME_SECONDS_BUCKETS) + 1))  # the last: +Inf
    resume_sum: float = 0.0

    def migrated(self, reason: str) -> None:
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def resumed(self, seconds: float) -> None:
        self.resume_buckets[bisect.bisect_left(RESUME_SECONDS_BUCKETS, seconds)] += 1
        self.resume_sum += seconds


@dataclass(frozen=True)
class BackendTimeouts:
    """Per-hop limits (the request's own deadline is the gateway's to enforce)."""

    prefill_s: float = 60.0  # a prefill call; then the router's next choice (or D) prefills
    stream_idle_s: float = 60.0  # the longest a request may wait for D's next output
    # Decode worker failures one stream survives; the next one fails it (a poison request).
    max_migrations: int = 1


class DisaggBackend:
    def __init__(self, router: Router, view: ClusterView, prefill: DeploymentHandle,
                 decode: DeploymentHandle, model_id: str, max_model_len: int,
                 timeouts: BackendTimeouts | None = None) -> None:
        self.timeouts = timeouts or BackendTimeouts()
        self.router = router
        self.view = view
        self.prefill = prefill
        self.decode = decode
        self._channels: dict[str, DecodeChannel] = {}  # by decode worker id
        self._model_id = model_id
        self._max_model_len = max_model_len
        self._background: set[asyncio.Task[Any]] = set()
        self.migrations = MigrationStats()
        view.after_poll(self._close_stopping_channels)

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

    def health_problem(self) -> str | None:
        return self.view.health_problem()

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        # The caller's trace context now (the gateway's request span) parents the router's and
        # the workers' spans, whichever task later iterates the stream.
        parent = otel_context.get_current() if tracing.enabled() else None
        request = dataclasses.replace(request, trace=tracing.inject(parent))
        return self._generate(request, parent)

    async def _generate(self, request: GenerationRequest, parent: Context | None
                        ) -> AsyncIterator[RequestOutput]:
        decision = self._route(request, parent)
        if decision.prefill_worker is not None:
            request, decision = await self._prefill(request, decision, parent)
        first = request.prefill
        if first is not None:
            handed_over = False
            try:
                yield _first_output(request.request_id, first, request.num_prompt_tokens)
                handed_over = True
            finally:
                if not handed_over and first.kv is not None:
                    # Closed before D took the lease (D rejects it itself once it has it).
                    self._reject_later(first.kv.worker_id, first.kv.lease_id,
                                       request.request_id)
            if first.finished:
                return
        async for output in self._decode(request, decision):
            yield output

    def _route(self, request: GenerationRequest, parent: Context | None) -> RoutingDecision:
        span = tracing.start_span("router.decision", parent)
        try:
            decision = self.router.route(
                request.prompt_token_ids, cache_salt=request.cache_salt,
                request_id=request.request_id,
                session=None if request.session is None else (request.tenant, request.session))
            if decision.decode_worker is None:
                self.router.release(request.request_id)
                raise UnavailableError("no healthy decode worker; retry shortly")
        except NoHealthyWorkers as exc:
            tracing.end_with_error(span, exc)
            raise UnavailableError(f"{exc}; retry shortly") from None
        except BaseException as exc:
            tracing.end_with_error(span, exc)
            raise
        if span.is_recording():
            span.set_attributes(decision_attributes(decision))
        span.end()
        return decision

    async def _prefill(self, request: GenerationRequest, decision: RoutingDecision,
                       parent: Context | None
                       ) -> tuple[GenerationRequest, RoutingDecision]:
        """P's first token and lease, on the replica the router chose; if that replica is gone,
        fail over (logged, counted) to the router's next choice."""
        for attempt in range(MAX_FAILOVERS + 1):
            worker = decision.prefill_worker
            assert worker is not None
            try:
                async with asyncio.timeout(self.timeouts.prefill_s):
                    result, report = await call(self.prefill.prefill.remote(
                        request, route_to=worker, reader=decision.decode_worker))
            except (ReplicaGoneError, EngineDeadError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    log.warning("request %s: prefill worker %s did not answer within %.1f s",
                                request.request_id, worker, self.timeouts.prefill_s)
                self.router.release(request.request_id)
                self.router.mark_down(worker, _failover_reason(exc))
                if attempt == MAX_FAILOVERS:
                    if isinstance(exc, TimeoutError):
                        raise DeadlineExceededError(
                            f"no prefill worker answered within {self.timeouts.prefill_s:.0f} s"
                        ) from None
                    raise
                decision = self._route(request, parent)
                if decision.prefill_worker is None:  # nothing left to prefill on: D does it
                    return request, decision
                continue
            except BaseException:
                self.router.release(request.request_id)
                raise
            self.router.release(request.request_id)
            self.view.ingest(report)
            return dataclasses.replace(request, prefill=result), decision
        raise AssertionError("unreachable")

    async def _decode(self, request: GenerationRequest, decision: RoutingDecision
                      ) -> AsyncIterator[RequestOutput]:
        """D's outputs. A D that fails before its first output is replaced by the router's
        next choice (the same request: P's lease may still hold); one that fails later is
        migrated from (the request goes on elsewhere with ``output_token_ids``)."""
        worker = decision.decode_worker
        # The prompt tokens found cached where the prompt was prefilled: on P, or (no P: the
        # router skipped it) on this D, from its first output; kept across a migration.
        cached = None if request.prefill is None else request.prefill.num_cached_tokens
        emitted = [] if request.prefill is None else [request.prefill.first_token]
        failed_at: float | None = None  # when the stream being migrated failed
        failovers = migrations = ran_on = 0
        while True:
            assert worker is not None  # _route raises without a decode worker
            started = False
            try:
                # Closed at once when the caller leaves: D aborts the request.
                async with contextlib.aclosing(self._channel(worker).generate(
                        request, self.timeouts.stream_idle_s)) as outputs:
                    async for item in outputs:
                        started = True
                        if failed_at is not None:
                            self.migrations.resumed(time.monotonic() - failed_at)
                            failed_at = None
                        emitted += item.new_token_ids
                        if cached is None:
                            cached = item.num_cached_tokens
                        yield _with_cached(item, request.num_prompt_tokens, cached)
                return
            except (ReplicaGoneError, EngineDeadError, StreamStalledError) as exc:
                reason = _failover_reason(exc)
                self.router.mark_down(worker, reason)
                migrate = started or request.output_token_ids != ()
                if started or isinstance(exc, EngineDeadError | StreamStalledError):
                    ran_on += 1  # the worker failed with the request in its steps
                    if ran_on > max(1, self.timeouts.max_migrations):
                        raise EngineError(
                            f"the {ran_on} decode workers that ran this request all failed while "
                            f"running it (the last: {exc}); it is not sent to another, in case "
                            f"it is what makes them fail") from exc
                if (migrations if migrate else failovers) >= (
                        self.timeouts.max_migrations if migrate else MAX_FAILOVERS):
                    raise
                try:
                    worker = self._route(request, None).decode_worker
                except UnavailableError:  # nowhere else to go: the first failure says why
                    raise exc from None
                self.router.release(request.request_id)
                if migrate:
                    migrations += 1
                    failed_at = failed_at or time.monotonic()
                    self.migrations.migrated(reason)
                    log.warning("request %s: decode worker failed after %d tokens (%s); "
                                "resuming on %s", request.request_id, len(emitted), exc, worker)
                    # The client has the prompt's logprobs (with the first token): the next
                    # worker may use its prefix cache.
                    request = dataclasses.replace(
                        request, prefill=None, output_token_ids=tuple(emitted),
                        params=dataclasses.replace(request.params, prompt_logprobs=None))
                else:
                    failovers += 1
            finally:
                self._close_stopping_channels()

    def _channel(self, worker: str) -> DecodeChannel:
        """The decode worker's channel, opened now if it has none (or its last one failed)."""
        self._close_stopping_channels()
        channel = self._channels.get(worker)
        if channel is None:
            channel = self._channels[worker] = DecodeChannel(
                self.decode, worker, self.view.ingest, self._channel_closed)
        return channel

    def _close_stopping_channels(self) -> None:
        """Close the idle channels to decode replicas Serve no longer has or is replacing (an
        unhealthy one): a replica being stopped waits for its calls (a channel is one) up to
        ``drain_timeout_s``. Run around each request and after each poll of the workers."""
        live = known_replicas(self.decode.deployment_name)
        for channel in list(self._channels.values()):
            worker = self.view.workers.get(channel.worker_id)
            stopping = (live and channel.worker_id not in live) or (
                worker is not None and not worker.healthy)
            if stopping and channel.idle:
                channel.close(ReplicaGoneError(f"decode replica {channel.worker_id} is gone"))

    def _channel_closed(self, channel: DecodeChannel) -> None:
        if self._channels.get(channel.worker_id) is channel:
            del self._channels[channel.worker_id]

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
        for channel in list(self._channels.values()):
            await channel.aclose()
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


def _failover_reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):  # a hop's timeout, or StreamStalledError
        return "timeout"
    return "unhealthy" if isinstance(exc, EngineDeadError) else "replica_gone"


def _first_output(request_id: str, first: PrefillResult, num_prompt: int) -> RequestOutput:
    return RequestOutput(request_id, [first.first_token], list(first.logprobs),
                         first.finished,
                         None if first.finish_reason is None else FinishReason(first.finish_reason),
                         num_prompt, 1, first.num_cached_tokens,
                         prompt_logprobs=(None if first.prompt_logprobs is None
                                          else list(first.prompt_logprobs)))


def _with_cached(out: RequestOutput, num_prompt: int, cached: int) -> RequestOutput:
    """D's output as the client sees it: the prompt's length and its tokens found cached where
    it was prefilled (D's own count covers only what D computed)."""
    return dataclasses.replace(out, num_prompt_tokens=num_prompt, num_cached_tokens=cached,
                               kv=None)


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
        pending_prefill_blocks=sum(s.pending_prefill_blocks for s in stats),
        num_importing=sum(s.num_importing for s in stats),
        spec_draft_tokens=sum(s.spec_draft_tokens for s in stats),
        spec_accepted_tokens=sum(s.spec_accepted_tokens for s in stats),
        spec_steps=sum(s.spec_steps for s in stats),
        host_kv_restored_blocks=sum(s.host_kv_restored_blocks for s in stats),
        host_kv_offloaded_blocks=sum(s.host_kv_offloaded_blocks for s in stats),
        host_kv_blocks=sum(s.host_kv_blocks for s in stats),
        host_kv_capacity_blocks=sum(s.host_kv_capacity_blocks for s in stats))
