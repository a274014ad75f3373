"""The prefill role: chunked prefill, first token, prompt KV pinned under a lease.

A decode worker pulls the blocks, then sends *release*; if it will not take the request it
sends *reject*; if neither arrives before the lease's TTL, the blocks are freed anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind

from tandem.services import tracing
from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.kv_cache import block_bytes, kv_storage
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.handoff.pairing import PairingError, PairingInfo, check_pairing
from tandem.services.handoff.staging import TransferArea
from tandem.services.kv_transfer.checksum import block_checksums
from tandem.services.kv_transfer.transport import KVTransport
from tandem.services.protocol.handoff import KVHandle, PrefillResult
from tandem.services.protocol.kv_events import KVEvent
from tandem.services.protocol.outputs import PinnedKV, RequestOutput
from tandem.services.protocol.request import GenerationRequest


@dataclass(frozen=True)
class PrefillConfig:
    lease_ttl_s: float = 30.0  # pinned blocks are freed this long after the first token
    reap_interval_s: float | None = None  # how often expiry is checked; None: ttl/4, <= 1 s
    checksums: bool = False  # debug: send a CRC32 per block for the decode worker to verify

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.reap_interval_s is not None and self.reap_interval_s <= 0:
            raise ValueError(f"reap_interval_s must be > 0, got {self.reap_interval_s}")

    @property
    def reap_every_s(self) -> float:
        return self.reap_interval_s or min(1.0, self.lease_ttl_s / 4)


Clock = Callable[[], float]


@dataclass(frozen=True)
class Lease:
    lease_id: str  # 128 random bits: the reader holding it may read block_ids (no more)
    request_id: str
    expires_at: float  # on the table's clock
    block_ids: frozenset[int] = frozenset()
    reader: str | None = None  # the decode worker it was offered to; None: any

    def for_reader(self, reader: str | None) -> bool:
        return self.reader is None or self.reader == reader


class LeaseTable:
    def __init__(self, ttl_s: float, clock: Clock = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, request_id: str, block_ids: Iterable[int] = (),
              reader: str | None = None) -> Lease:
        lease = Lease(secrets.token_hex(16), request_id, self.clock() + self.ttl_s,
                      frozenset(block_ids), reader)
        self._leases[lease.lease_id] = lease
        return lease

    def covers(self, lease_id: str, block_ids: Sequence[int], reader: str) -> bool:
        """Whether a live lease ``lease_id`` offered to ``reader`` holds every one of
        ``block_ids`` (the KV transport's ``reads_allowed``: one dict lookup)."""
        lease = self._leases.get(lease_id)
        return (lease is not None and lease.expires_at > self.clock()
                and lease.for_reader(reader) and lease.block_ids.issuperset(block_ids))

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def take(self, lease_id: str) -> Lease | None:
        """End a lease (release or reject); None if it already ended or never existed."""
        return self._leases.pop(lease_id, None)

    def take_expired(self) -> list[Lease]:
        now = self.clock()
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.lease_id]
        return expired


@dataclass
class PrefillMetrics:
    """Counters for export; every lease ends released, rejected or expired."""

    prefills: int = 0
    leases_granted: int = 0
    leases_released: int = 0
    leases_rejected: int = 0
    leases_expired: int = 0
    # Prefills that ended without a lease: tensor parallelism, every staging block held
    # (the decode worker recomputes the prompt)
    unstaged: int = 0
    late_messages: int = 0  # release/reject for a lease that had already ended
    # Refused as unauthenticated or not meant for the sender: an unsigned pairing, a release by
    # a worker the lease was not offered to (the KV transport counts its own refusals).
    refusals: int = 0
    reject_reasons: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["reject_reasons"] = dict(self.reject_reasons)
        return data


log = logging.getLogger(__name__)


class PrefillWorker:
    role = "prefill"

    def __init__(self, engine: LLMEngine, transport: KVTransport,
                 config: PrefillConfig | None = None, worker_id: str = "prefill-0",
                 clock: Clock = time.monotonic,
                 on_events: Callable[[list[KVEvent]], None] | None = None,
                 area: TransferArea | None = None) -> None:
        """``on_events``: the sink of the engine's KV events (see ``AsyncEngine``). ``area``:
        the blocks the transport serves (services/handoff/staging.py; the transport was made
        for its ``cache``); by default the engine's own, or with tensor parallelism staging
        blocks into which each pinned prompt's blocks are gathered from every rank."""
        self.worker_id = worker_id
        self.config = config or PrefillConfig()
        self.transport = transport
        self.engine = AsyncEngine(engine, on_events)
        self.leases = LeaseTable(self.config.lease_ttl_s, clock)
        self.transport.reads_allowed = self.leases.covers  # a read needs a live lease
        self.metrics = PrefillMetrics()
        self.peers: dict[str, PairingInfo] = {}  # decode workers met so far
        self.area = area or TransferArea(engine)
        self._blocks = block_bytes(kv_storage(self.area.cache))
        self._info: PairingInfo | None = None
        self._reaper: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.transport.start(kv_storage(self.area.cache))
        self._info = PairingInfo.for_engine(self.engine.llm, self.worker_id, self.role,
                                            self.transport).signed(self.transport.key)
        self._reaper = asyncio.create_task(self._reap(), name=f"{self.worker_id}-leases")

    async def drain(self, timeout_s: float, poll_s: float = 0.1) -> int:
        """Before stopping: wait (at most ``timeout_s``) until every lease is released,
        rejected or expired, so that decode workers pull the KV they were promised; returns
        how many were still held."""
        deadline = time.monotonic() + timeout_s
        while len(self.leases) and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return len(self.leases)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.transport.close()
        await asyncio.to_thread(self.engine.shutdown)

    @property
    def info(self) -> PairingInfo:
        if self._info is None:
            raise RuntimeError(f"prefill worker {self.worker_id} is not started")
        return self._info

    async def pair(self, decode: PairingInfo) -> PairingInfo:
        """Meet a decode worker: refuse an info not signed with the cluster secret or any
        setting mismatch, else return our info (signed)."""
        try:
            decode.check_signed(self.transport.key)
        except PairingError:
            self.metrics.refusals += 1
            log.warning("%s: refused to pair with %r: not signed with the cluster secret",
                        self.worker_id, decode.worker_id)
            raise
        check_pairing(self.info, decode)
        self.peers[decode.worker_id] = decode
        self.transport.expect_reads(self.config.lease_ttl_s)  # it wires up to us next
        return self.info

    # -- requests -------------------------------------------------------------------------

    async def prefill(self, request: GenerationRequest, reader: str | None = None
                      ) -> PrefillResult:
        """Prefill the prompt and sample its first token; unless that ends the request, the
        prompt's blocks stay pinned under a lease until released, rejected or expired. Only
        the decode worker ``reader`` may read them under it (None: any paired one)."""
        trace = PrefillTrace(request.request_id, self.worker_id, request.num_prompt_tokens)
        try:
            result = await self._prefill(request, reader, trace)
        except BaseException as exc:
            trace.fail(exc)
            raise
        trace.finish(result)
        return result

    async def _prefill(self, request: GenerationRequest, reader: str | None,
                       trace: PrefillTrace) -> PrefillResult:
        request_id = request.request_id

        def start(engine: LLMEngine) -> None:
            if trace.recording:
                trace.admitted(engine)
            engine.add_request(request, prefill_only=True)

        last: RequestOutput | None = None
        async for out in self.engine.stream(request_id, start):
            last = out
        assert last is not None and last.finished
        trace.first_token(last, self.engine.llm.config.max_num_batched_tokens)
        self.metrics.prefills += 1
        handle = None
        transfer_ids = None if last.kv is None else await self._export(request_id, last.kv)
        if last.kv is not None and transfer_ids is None:
            # Tensor parallelism with every staging block held by other leases: no KV to
            # offer; the decode worker prefills the prompt itself.
            self.metrics.unstaged += 1
            log.warning("%s: request %s: no free staging blocks for its %d prompt blocks; "
                        "the decode worker will recompute its prefill", self.worker_id,
                        request_id, len(last.kv.block_ids))
        if last.kv is not None and transfer_ids is not None:
            lease = self.leases.grant(request_id, transfer_ids, reader)
            self.metrics.leases_granted += 1
            self.transport.expect_reads(self.config.lease_ttl_s)  # until the lease expires
            checksums = (tuple(block_checksums(self._blocks, transfer_ids))
                         if self.config.checksums else None)
            handle = KVHandle(self.worker_id, lease.lease_id, transfer_ids,
                              last.kv.num_tokens, checksums, reader
                              ).signed(self.transport.key)
        return PrefillResult(
            request_id=request_id, first_token=last.new_token_ids[0],
            finish_reason=None if last.finish_reason is None else str(last.finish_reason),
            num_prompt_tokens=last.num_prompt_tokens, num_cached_tokens=last.num_cached_tokens,
            kv=handle, logprobs=tuple(last.new_logprobs),
            prompt_logprobs=None if last.prompt_logprobs is None else tuple(last.prompt_logprobs))

    async def release(self, lease_id: str, reader: str | None = None) -> bool:
        """The decode worker ``reader`` has the blocks. True if the lease was still held for
        it, i.e. the blocks it read were this prompt's; False if it had already ended (e.g.
        expired) or was offered to another worker (then it stays)."""
        lease = self.leases.get(lease_id)
        if lease is not None and not lease.for_reader(reader):
            self.metrics.refusals += 1
            log.warning("%s: refused %r's release of lease for %s: it was offered to %r",
                        self.worker_id, reader, lease.request_id, lease.reader)
            return False
        lease = self.leases.take(lease_id)
        if lease is None:
            self.metrics.late_messages += 1
            return False
        await self._free([lease])
        self.metrics.leases_released += 1
        return True

    async def reject(self, lease_id: str, reason: str) -> bool:
        """The decode worker will not take the request (or its transfer failed, or it was not
        the lease's reader), or the gateway dropped it: the blocks are freed now. Anyone
        holding the lease id may: it only frees (its reader then recomputes)."""
        lease = self.leases.take(lease_id)
        if lease is None:
            self.metrics.late_messages += 1
            return False
        await self._free([lease])
        self.metrics.leases_rejected += 1
        self.metrics.reject_reasons[reason] += 1
        return True

    async def expire_leases(self) -> int:
        """Free the blocks of every lease past its TTL; returns how many expired."""
        expired = self.leases.take_expired()
        if expired:
            log.warning("%s: %d lease(s) expired without release or reject: %s",
                        self.worker_id, len(expired), [lease.request_id for lease in expired])
            await self._free(expired)
            self.metrics.leases_expired += len(expired)
        return len(expired)

    async def status(self) -> dict[str, Any]:
        """Engine stats, lease count and metrics, as JSON-able data."""
        stats = await self.engine.call(lambda engine: engine.stats)
        return {"worker_id": self.worker_id, "engine": dataclasses.asdict(stats),
                "leases": len(self.leases), "metrics": self._metrics(),
                **self.transport.describe()}

    def _metrics(self) -> dict[str, Any]:
        """The worker's counters; its refusals include its transport's."""
        data = self.metrics.snapshot()
        data["refusals"] += self.transport.refusals
        return data

    # -- internals ------------------------------------------------------------------------

    async def _export(self, request_id: str, pinned: PinnedKV) -> tuple[int, ...] | None:
        """The blocks the lease offers for a pinned prompt (``TransferArea.export``); None
        (its blocks freed) when there is no room to stage them."""
        if not self.area.staged:
            return self.area.export(request_id, pinned.block_ids)
        try:
            ids = await self.engine.call(lambda _: self.area.export(request_id,
                                                                     pinned.block_ids))
        except BaseException:  # cancelled while gathering: nobody will lease the blocks
            await asyncio.shield(self._unpin([request_id]))
            raise
        if ids is None:
            await self._unpin([request_id])
        return ids

    async def _free(self, leases: list[Lease]) -> None:
        await self._unpin([lease.request_id for lease in leases])

    async def _unpin(self, ids: list[str]) -> None:
        def unpin(engine: LLMEngine) -> None:
            for request_id in ids:
                self.area.free(request_id)
                engine.release_kv(request_id)

        await self.engine.call(unpin)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_every_s)
            try:
                await self.expire_leases()
            except Exception:
                log.exception("%s: lease expiry failed", self.worker_id)


class PrefillTrace:
    def __init__(self, request_id: str, worker_id: str, num_prompt_tokens: int) -> None:
        self.arrived_ns = time.time_ns()
        self.span = tracing.start_span("prefill", kind=SpanKind.SERVER, start_ns=self.arrived_ns)
        self.recording = self.span.is_recording()
        self._admitted: tuple[int, int, int] | None = None  # (time, waiting, running)
        if self.recording:
            self.span.set_attributes({"tandem.request_id": request_id,
                                      "tandem.worker_id": worker_id,
                                      "tandem.prompt_tokens": num_prompt_tokens})

    def admitted(self, engine: LLMEngine) -> None:
        """On the engine thread, just before the request joins its queue."""
        stats = engine.stats
        self._admitted = (time.time_ns(), stats.num_waiting, stats.num_running)

    def first_token(self, out: RequestOutput, chunk_tokens: int) -> None:
        if not self.recording:
            return
        now = time.time_ns()
        admitted, waiting, running = self._admitted or (self.arrived_ns, 0, 0)
        tracing.record_span(self.span, "prefill.queue", self.arrived_ns, admitted,
                            {"tandem.engine.waiting": waiting, "tandem.engine.running": running})
        computed = out.num_prompt_tokens - out.num_cached_tokens
        tracing.record_span(self.span, "prefill.chunks", admitted, now, {
            "tandem.prefill.computed_tokens": computed,
            "tandem.prefill.chunk_tokens": chunk_tokens,
            "tandem.prefill.chunks": -(-computed // chunk_tokens)})
        self.span.add_event("first_token", timestamp=now)
        self.span.set_attribute("tandem.cached_tokens", out.num_cached_tokens)

    def finish(self, result: PrefillResult) -> None:
        if self.recording:
            self.span.set_attributes({
                "tandem.lease_id": "" if result.kv is None else result.kv.lease_id,
                "tandem.kv.blocks": 0 if result.kv is None else len(result.kv.block_ids),
                "tandem.finish_reason": result.finish_reason or ""})
        self.span.end()

    def fail(self, exc: BaseException) -> None:
        tracing.end_with_error(self.span, exc)
