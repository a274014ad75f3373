"""The decode role: pull a prefilled prompt's KV, release the prefill worker's lease, decode.

Protocol (pull): allocate blocks (reusing any this worker caches), READ the rest from the
prefill worker, verify (debug checksums), then *release* the lease. The release answer says
whether the lease was still held while we read; only then are the blocks trusted. A request
this worker will not take is *rejected* so the prefill worker frees its blocks at once. A
failed transfer recomputes the prefill here, or fails with a clear error when so configured;
it never decodes from blocks it could not vouch for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, use_span

from tandem.services import tracing
from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.kv_cache import block_bytes, kv_storage
from tandem.services.engine.llm_engine import ImportSlot, LLMEngine
from tandem.services.handoff.pairing import PairingError, PairingInfo, check_pairing
from tandem.services.handoff.staging import TransferArea
from tandem.services.kv_transfer.checksum import block_checksums
from tandem.services.kv_transfer.transport import (
    KVChecksumError,
    KVTransferError,
    KVTransferStuckError,
    KVTransport,
)
from tandem.services.protocol.handoff import KVHandle
from tandem.services.protocol.kv_events import KVEvent
from tandem.services.protocol.messages import TRANSFER_SECONDS_BUCKETS
from tandem.services.protocol.outputs import (
    DecodeRejectedError,
    EngineDeadError,
    EngineOverloadedError,
    KVTransferFailedError,
    RequestError,
    RequestOutput,
)
from tandem.services.protocol.request import GenerationRequest

ON_FAILURE = ("recompute", "fail")


@dataclass(frozen=True)
class DecodeConfig:
    # A failed or timed-out transfer: prefill the prompt here ("recompute") or fail the
    # request with KVTransferFailedError ("fail").
    on_transfer_failure: str = "recompute"
    transfer_timeout_s: float = 10.0
    control_timeout_s: float = 5.0  # release/reject calls to the prefill worker
    verify_checksums: bool = False  # debug: check pulled blocks against the sender's CRC32s

    def __post_init__(self) -> None:
        if self.on_transfer_failure not in ON_FAILURE:
            raise ValueError(f"on_transfer_failure must be one of {ON_FAILURE}, "
                             f"got {self.on_transfer_failure!r}")
        for name in ("transfer_timeout_s", "control_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class PrefillPeer(Protocol):
    async def pair(self, info: PairingInfo) -> PairingInfo: ...

    async def release(self, lease_id: str, reader: str) -> bool: ...

    async def reject(self, lease_id: str, reason: str) -> bool: ...


@dataclass(frozen=True)
class PeerLink:
    peer: PrefillPeer
    info: PairingInfo



@dataclass
class DecodeMetrics:
    """Counters for export."""

    imports: int = 0  # requests that arrived with a KV handle
    transfers: int = 0  # successful block reads
    bytes_moved: int = 0
    transfer_seconds: float = 0.0
    # Transfers per TRANSFER_SECONDS_BUCKETS bucket (not cumulative); the last one is +Inf.
    transfer_seconds_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1))
    blocks_pulled: int = 0
    blocks_reused: int = 0  # leading blocks already in this worker's prefix cache
    transfer_failures: int = 0  # read errors, timeouts, checksum mismatches, lost leases
    checksum_failures: int = 0
    recomputes: int = 0
    queued: int = 0  # imports with no room for the KV now, queued to prefill here instead
    rejects: Counter[str] = field(default_factory=Counter)  # by reason
    # Refused as unauthenticated or not meant for this worker: an unsigned pairing reply, a KV
    # handle that is unsigned or names another reader (the prompt is recomputed here).
    refusals: int = 0

    def observe_transfer(self, seconds: float) -> None:
        self.transfer_seconds += seconds
        self.transfer_seconds_buckets[bisect_left(TRANSFER_SECONDS_BUCKETS, seconds)] += 1

    def snapshot(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rejects"] = dict(self.rejects)
        return data


log = logging.getLogger(__name__)


class KVSource(enum.StrEnum):
    TRANSFER = "transfer"  # pulled from the prefill worker
    RECOMPUTE = "recompute"  # the transfer failed; prefilled here
    QUEUED = "queued"  # no room to import the KV; queued to prefill here when blocks free
    LOCAL = "local"  # no prefill worker involved


@dataclass
class DecodeStream:
    """The request's outputs after its first token (which the prefill worker produced)."""

    request_id: str
    kv_source: KVSource
    outputs: AsyncGenerator[RequestOutput, None]
    abort: Callable[[], None]  # abort the request in the engine
    _started: bool = False
    trace: DecodeTrace | None = None  # None when tracing is off

    def __aiter__(self) -> DecodeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        self._started = True
        if self.trace is None:
            return await anext(self.outputs)
        try:
            out = await anext(self.outputs)
        except StopAsyncIteration:
            self.trace.end("abort")  # ended without a finished output
            raise
        except BaseException as exc:
            self.trace.fail(exc)
            raise
        self.trace.output(out)
        return out

    async def aclose(self) -> None:
        """Stop early: aborts the request (if it has not finished) and frees its blocks."""
        try:
            if self._started:
                await self.outputs.aclose()  # aborts unless the stream finished
            else:
                self.abort()
        finally:
            if self.trace is not None:
                self.trace.end("abort")  # nothing if it finished


@dataclass(frozen=True)
class DecodeResult:
    request_id: str
    output_token_ids: list[int]  # the whole output, the prefill's first token included
    finish_reason: str | None
    kv_source: KVSource


class DecodeWorker:
    role = "decode"

    def __init__(self, engine: LLMEngine, transport: KVTransport,
                 config: DecodeConfig | None = None, worker_id: str = "decode-0",
                 on_events: Callable[[list[KVEvent]], None] | None = None,
                 area: TransferArea | None = None) -> None:
        """``on_events``: the sink of the engine's KV events (see ``AsyncEngine``). ``area``:
        the blocks the transport writes (services/handoff/staging.py; the transport was made
        for its ``cache``): by default the engine's own, or with tensor parallelism staging
        blocks each import scatters to every rank when it commits."""
        self.worker_id = worker_id
        self.config = config or DecodeConfig()
        self.transport = transport
        self.engine = AsyncEngine(engine, on_events)
        self.metrics = DecodeMetrics()
        self.accepting = True
        self.area = area or TransferArea(engine)
        self._blocks = block_bytes(kv_storage(self.area.cache))
        self._block_size = engine.config.block_size
        self._peers: dict[str, PeerLink] = {}
        self._phases: dict[str, str] = {}
        self._info: PairingInfo | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.transport.start(kv_storage(self.area.cache))
        self._info = PairingInfo.for_engine(self.engine.llm, self.worker_id, self.role,
                                            self.transport).signed(self.transport.key)

    def drain(self) -> None:
        """Stop taking new requests (they are rejected); running ones finish."""
        self.accepting = False

    async def close(self) -> None:
        self.accepting = False
        await self.transport.close()
        await asyncio.to_thread(self.engine.shutdown)

    @property
    def info(self) -> PairingInfo:
        if self._info is None:
            raise RuntimeError(f"decode worker {self.worker_id} is not started")
        return self._info

    async def pair(self, peer: PrefillPeer) -> PairingInfo:
        """Meet a prefill worker once: check its signature and settings both ways, load its
        transport metadata."""
        theirs = await peer.pair(self.info)
        try:
            theirs.check_signed(self.transport.key)
        except PairingError:
            self.metrics.refusals += 1
            raise
        check_pairing(self.info, theirs)
        self.transport.add_peer(theirs.worker_id, theirs.transport_metadata)
        self._peers[theirs.worker_id] = PeerLink(peer, theirs)
        return theirs

    def phase(self, request_id: str) -> str | None:
        """Where an import stands: "allocating", "transferring", "confirming" or None."""
        return self._phases.get(request_id)

    async def status(self) -> dict[str, Any]:
        """Engine stats and metrics, as JSON-able data."""
        stats = await self.engine.call(lambda engine: engine.stats)
        return {"worker_id": self.worker_id, "engine": dataclasses.asdict(stats),
                "accepting": self.accepting, "metrics": self._metrics(),
                **self.transport.describe()}

    # -- requests -------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> DecodeResult:
        """Run the request to the end; see ``submit``."""
        stream = await self.submit(request)
        tokens = [] if request.prefill is None else [request.prefill.first_token]
        finish_reason = None
        async for out in stream:
            tokens.extend(out.new_token_ids)
            finish_reason = out.finish_reason
        return DecodeResult(request.request_id, tokens,
                            None if finish_reason is None else str(finish_reason),
                            stream.kv_source)

    async def submit(self, request: GenerationRequest) -> DecodeStream:
        """Import the prompt's KV named by ``request.prefill`` (None: prefill here, after the
        tokens it already generated elsewhere, ``request.output_token_ids``) and start
        decoding.

        Raises ``DecodeRejectedError`` when this worker will not take the request,
        ``KVTransferFailedError`` when the pull failed and ``on_transfer_failure`` is "fail",
        ``RequestError`` for an invalid request. Cancelling it aborts the request and rejects
        the lease. The ``decode`` span starts here, under the current trace context.
        """
        trace = DecodeTrace(request.request_id, self.worker_id, request.num_prompt_tokens)
        try:
            return await self._submit(request, trace)
        except BaseException as exc:
            trace.fail(exc)
            raise

    async def _submit(self, request: GenerationRequest, trace: DecodeTrace) -> DecodeStream:
        request_id, prefill = request.request_id, request.prefill
        if prefill is None:
            if not self.accepting:
                raise DecodeRejectedError(f"decode worker {self.worker_id} is shutting down")
            return self._stream(request_id, KVSource.LOCAL, lambda e: e.add_request(request),
                                trace)
        # Prefilled elsewhere: from here it is the prompt and its first token (a recompute or
        # a queued import prefills both here).
        after_first = dataclasses.replace(request, output_token_ids=(prefill.first_token,))
        if request.output_token_ids:
            raise RequestError("a resumed request carries no prefill result")
        kv = prefill.kv
        if kv is None and prefill.finish_reason is not None:
            raise RequestError(f"request {request_id!r} finished at its first token "
                               f"({prefill.finish_reason}); there is nothing to decode")
        if kv is None:  # the prefill worker held no KV for it (its staging was full; it logs)
            if not self.accepting:
                raise DecodeRejectedError(f"decode worker {self.worker_id} is shutting down")
            self.metrics.recomputes += 1
            return self._stream(request_id, KVSource.RECOMPUTE,
                                lambda e: e.add_request(after_first), trace)
        self.metrics.imports += 1
        link = self._peers.get(kv.worker_id)
        if not self.accepting:
            await self._reject(link, kv, "shutting_down")
            raise DecodeRejectedError(f"decode worker {self.worker_id} is shutting down")
        num_prompt = request.num_prompt_tokens
        if kv.num_tokens != num_prompt or len(kv.block_ids) != -(-num_prompt
                                                                // self._block_size):
            await self._reject(link, kv, "invalid_request")
            raise RequestError(f"KV handle covers {kv.num_tokens} tokens in "
                               f"{len(kv.block_ids)} blocks; the prompt has {num_prompt}")

        self._phases[request_id] = "allocating"
        try:
            # Current while it runs: the lease release on P becomes its child.
            with use_span(trace.transfer(), end_on_exit=True) as span:
                slot = await self._reserve(request, prefill.first_token, link, kv)
                failure = None if slot is None else await self._pull(request_id, link, kv,
                                                                     *slot, span)
                if failure is not None:
                    tracing.mark_failed(span, failure)
        except asyncio.CancelledError:
            await asyncio.shield(self._abandon(request_id, link, kv))
            raise
        finally:
            self._phases.pop(request_id, None)

        start: Callable[[LLMEngine], None]
        if slot is None:
            self.metrics.queued += 1
            start, source = (lambda e: e.add_request(after_first)), KVSource.QUEUED
        elif failure is None:
            start, source = self._commit(request_id), KVSource.TRANSFER
        elif self.config.on_transfer_failure == "fail":
            await self.engine.call(self._drop(request_id))
            raise KVTransferFailedError(
                f"request {request_id!r}: the KV transfer from prefill worker {kv.worker_id!r} "
                f"failed ({failure}) and on_transfer_failure is 'fail'") from failure
        else:
            log.warning("%s: request %s: recomputing the prefill after: %s", self.worker_id,
                        request_id, failure)
            self.metrics.recomputes += 1
            start, source = self._recompute(request_id), KVSource.RECOMPUTE
        return self._stream(request_id, source, start, trace)

    def _metrics(self) -> dict[str, Any]:
        """The worker's counters; its refusals include its transport's."""
        data = self.metrics.snapshot()
        data["refusals"] += self.transport.refusals
        return data

    # -- internals ------------------------------------------------------------------------

    def _stream(self, request_id: str, source: KVSource, start: Callable[[LLMEngine], None],
                trace: DecodeTrace) -> DecodeStream:
        trace.queued(str(source))
        outputs = self.engine.stream(request_id, start)
        assert isinstance(outputs, AsyncGenerator)
        return DecodeStream(request_id, source, outputs, lambda: self.engine.abort(request_id),
                            trace=trace if trace.recording else None)

    async def _reserve(self, request: GenerationRequest, first_token: int,
                       link: PeerLink | None, kv: KVHandle
                       ) -> tuple[ImportSlot, tuple[int, ...]] | None:
        """Blocks for the import and the blocks the transfer writes (``TransferArea``), or
        None (the lease rejected) when either has no room now: the request is then queued to
        prefill here, never refused after its first token."""
        def begin(engine: LLMEngine) -> tuple[ImportSlot, tuple[int, ...]]:
            slot = engine.begin_import(request, first_token)
            ids = self.area.reserve(request.request_id, slot.filled_block_ids)
            if ids is None:
                engine.abort_request(request.request_id)
                raise EngineOverloadedError(
                    f"no room to stage {len(slot.filled_block_ids)} KV blocks for import "
                    f"({self.area.num_free} staging blocks free)")
            return slot, ids

        try:
            return await self.engine.call(begin)
        except EngineOverloadedError as exc:
            log.info("%s: request %s: %s; queued to prefill here", self.worker_id,
                     request.request_id, exc)
            await self._reject(link, kv, "no_capacity")
            return None
        except RequestError:
            await self._reject(link, kv, "invalid_request")
            raise

    async def _pull(self, request_id: str, link: PeerLink | None, kv: KVHandle,
                    slot: ImportSlot, transfer_ids: tuple[int, ...], span: Span = INVALID_SPAN
                    ) -> KVTransferError | None:
        """Fill the import's blocks and confirm the lease; the failure, if any."""
        skip = slot.num_cached_blocks
        self.metrics.blocks_reused += skip
        if span.is_recording():
            span.set_attributes({"tandem.request_id": request_id,
                                 "tandem.kv.source_worker": kv.worker_id,
                                 "tandem.kv.transport": self.transport.kind,
                                 "tandem.kv.blocks": len(kv.block_ids),
                                 "tandem.kv.blocks_reused": skip,
                                 "tandem.kv.blocks_pulled": 0, "tandem.kv.bytes": 0})
        try:
            if link is None:
                raise KVTransferError(f"not paired with prefill worker {kv.worker_id!r}")
            self._check_handle(kv)
            self._phases[request_id] = "transferring"
            if skip < len(kv.block_ids):
                start = time.perf_counter()
                nbytes = await self.transport.read_blocks(
                    kv.worker_id, kv.block_ids[skip:], transfer_ids,
                    self.config.transfer_timeout_s, kv.lease_id)
                self.metrics.observe_transfer(time.perf_counter() - start)
                self.metrics.bytes_moved += nbytes
                self.metrics.blocks_pulled += len(kv.block_ids) - skip
                self.metrics.transfers += 1
                if span.is_recording():
                    span.add_event("blocks_read")
                    span.set_attributes({"tandem.kv.blocks_pulled": len(kv.block_ids) - skip,
                                         "tandem.kv.bytes": nbytes})
                if self.config.verify_checksums and kv.checksums is not None:
                    self._verify(kv, transfer_ids, skip)
        except KVTransferStuckError as exc:
            # Its blocks may still be written: stop the engine (the worker is replaced); the
            # gateway sends its requests on.
            self.metrics.transfer_failures += 1
            self.engine.stop(f"request {request_id}: {exc}")
            await self._reject(link, kv, "transfer_failed")
            raise EngineDeadError(f"the engine stopped: {exc}") from None
        except KVTransferError as exc:
            self.metrics.transfer_failures += 1
            self.metrics.checksum_failures += isinstance(exc, KVChecksumError)
            await self._reject(link, kv, "transfer_failed")
            return exc
        assert link is not None
        self._phases[request_id] = "confirming"
        try:
            async with asyncio.timeout(self.config.control_timeout_s):
                held = await link.peer.release(kv.lease_id, self.worker_id)
        except Exception as exc:
            if skip == len(kv.block_ids):
                return None  # nothing was read, so nothing needs vouching for
            self.metrics.transfer_failures += 1
            return KVTransferError(f"could not confirm lease {kv.lease_id} with "
                                   f"{kv.worker_id!r}: {exc!r}")
        if span.is_recording():
            span.add_event("lease_released", {"tandem.kv.lease_held": held})
        if not held and skip < len(kv.block_ids):
            self.metrics.transfer_failures += 1
            return KVTransferError(f"{kv.worker_id!r} no longer held lease {kv.lease_id} "
                                   f"(expired?), so the blocks read may not be this prompt's")
        return None

    def _check_handle(self, kv: KVHandle) -> None:
        """Pull only under a handle a worker of this cluster signed, offered to this worker
        (another's, e.g. after the gateway failed over from its decode worker, is recomputed
        here and its lease rejected)."""
        if not kv.verified(self.transport.key):
            problem = "is not signed with the cluster secret"
        elif kv.reader is not None and kv.reader != self.worker_id:
            problem = f"was offered to decode worker {kv.reader!r}"
        else:
            return
        self.metrics.refusals += 1
        raise KVTransferError(f"the KV handle for lease {kv.lease_id} of {kv.worker_id!r} "
                              f"{problem}")

    def _verify(self, kv: KVHandle, transfer_ids: tuple[int, ...], skip: int) -> None:
        assert kv.checksums is not None
        got = block_checksums(self._blocks, transfer_ids)
        for i, (want, have) in enumerate(zip(kv.checksums[skip:], got, strict=True), skip):
            if want != have:
                raise KVChecksumError(f"block {i} of lease {kv.lease_id}: CRC32 {have:#010x}, "
                                      f"the prefill worker sent {want:#010x}")

    async def _reject(self, link: PeerLink | None, kv: KVHandle, reason: str) -> None:
        """Tell the prefill worker to free the blocks now; best effort (else they expire)."""
        self.metrics.rejects[reason] += 1
        if link is None:
            return
        try:
            async with asyncio.timeout(self.config.control_timeout_s):
                await link.peer.reject(kv.lease_id, reason)
        except Exception as exc:
            log.warning("%s: reject of lease %s at %s failed (%r); it will expire",
                        self.worker_id, kv.lease_id, kv.worker_id, exc)

    async def _abandon(self, request_id: str, link: PeerLink | None, kv: KVHandle) -> None:
        with contextlib.suppress(Exception):
            await self.engine.call(self._drop(request_id))
        await self._reject(link, kv, "aborted")

    # The import's ends, on the engine thread: its blocks (and staging blocks) in every case.

    def _commit(self, request_id: str) -> Callable[[LLMEngine], None]:
        def commit(engine: LLMEngine) -> None:
            engine.commit_import(request_id)  # first: it checks the import is still there
            self.area.commit(request_id)  # before the next step reads the blocks
        return commit

    def _recompute(self, request_id: str) -> Callable[[LLMEngine], None]:
        def recompute(engine: LLMEngine) -> None:
            self.area.free(request_id)
            engine.recompute_import(request_id)
        return recompute

    def _drop(self, request_id: str) -> Callable[[LLMEngine], None]:
        def drop(engine: LLMEngine) -> None:
            self.area.free(request_id)
            engine.abort_request(request_id)
        return drop


MAX_STEP_EVENTS = 32  # per request: a long generation must not make a huge span


# The decode span of one request: its KV transfer, its wait for the first decode step, its
# steps and how it finished, all seen from the worker (the engine knows nothing of tracing).
#
#     decode
#     ├── kv_transfer       reserve blocks, READ them from P, confirm the lease (bytes, blocks)
#     ├── decode.queue      KV in place (or prompt queued) -> first output of the engine
#     └── decode.steps      first -> last output; one ``step`` event per output, at most
#                           MAX_STEP_EVENTS; the ``finish`` event is on ``decode``


class DecodeTrace:
    def __init__(self, request_id: str, worker_id: str, num_prompt_tokens: int) -> None:
        self.span = tracing.start_span("decode", kind=SpanKind.SERVER)
        self.recording = self.span.is_recording()
        self._queued_ns = 0
        self._steps: Span = INVALID_SPAN
        self._last_ns = 0
        self._outputs = 0
        self._tokens = 0
        self._max_gap_ns = 0
        self._ended = False
        if self.recording:
            self.span.set_attributes({"tandem.request_id": request_id,
                                      "tandem.worker_id": worker_id,
                                      "tandem.prompt_tokens": num_prompt_tokens})

    def transfer(self) -> Span:
        """The ``kv_transfer`` span (the caller ends it)."""
        return tracing.start_span("kv_transfer", self.span)

    def queued(self, kv_source: str) -> None:
        """The request is handed to the engine (KV committed, recomputing, or a local prompt)."""
        self._queued_ns = time.time_ns()
        if self.recording:
            self.span.set_attribute("tandem.kv.source", kv_source)

    def output(self, out: RequestOutput) -> None:
        now = time.time_ns()
        if self._outputs == 0:
            tracing.record_span(self.span, "decode.queue", self._queued_ns or now, now)
            self._steps = tracing.start_span("decode.steps", self.span, start_ns=now)
        else:
            self._max_gap_ns = max(self._max_gap_ns, now - self._last_ns)
        self._outputs += 1
        self._tokens += len(out.new_token_ids)
        self._last_ns = now
        if self._outputs <= MAX_STEP_EVENTS:
            self._steps.add_event("step", {"tandem.tokens": len(out.new_token_ids),
                                           "tandem.output_tokens": out.num_output_tokens},
                                  timestamp=now)
        if out.finished:
            self.end(str(out.finish_reason), out.num_output_tokens)

    def end(self, finish_reason: str, output_tokens: int | None = None) -> None:
        """The request left this worker: finished, aborted (``abort``) or failed."""
        if self._ended:
            return
        self._ended = True
        if self._outputs:
            self._steps.set_attributes({
                "tandem.decode.outputs": self._outputs, "tandem.decode.tokens": self._tokens,
                "tandem.decode.max_gap_ms": self._max_gap_ns / 1e6,
                "tandem.decode.step_events_dropped": max(0, self._outputs - MAX_STEP_EVENTS)})
            self._steps.end(end_time=self._last_ns)
        attributes: dict[str, str | int] = {"tandem.finish_reason": finish_reason}
        if output_tokens is not None:
            attributes["tandem.output_tokens"] = output_tokens
        self.span.add_event("finish", attributes)
        self.span.set_attribute("tandem.finish_reason", finish_reason)
        self.span.end()

    def fail(self, exc: BaseException) -> None:
        if self._ended:
            return
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self.end("abort")
            return
        self._ended = True
        if self._outputs:
            self._steps.end(end_time=self._last_ns)
        tracing.end_with_error(self.span, exc)
