"""The prefill role: chunked prefill, first token, prompt KV pinned under a lease.

A decode worker pulls the blocks, then sends *release*; if it will not take the request it
sends *reject*; if neither arrives before the lease's TTL, the blocks are freed anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.kv_cache import block_bytes, kv_storage
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.kv_transfer.checksum import block_checksums
from tandem.services.kv_transfer.pairing import PairingError, PairingInfo, check_pairing
from tandem.services.kv_transfer.transport import KVTransport
from tandem.services.prefill.config import PrefillConfig
from tandem.services.prefill.leases import Clock, Lease, LeaseTable
from tandem.services.prefill.metrics import PrefillMetrics
from tandem.services.prefill.trace import PrefillTrace
from tandem.services.protocol.handoff import KVHandle, PrefillResult
from tandem.services.protocol.kv_events import KVEvent
from tandem.services.protocol.outputs import RequestOutput
from tandem.services.protocol.request import GenerationRequest

log = logging.getLogger(__name__)


class PrefillWorker:
    role = "prefill"

    def __init__(self, engine: LLMEngine, transport: KVTransport,
                 config: PrefillConfig | None = None, worker_id: str = "prefill-0",
                 clock: Clock = time.monotonic,
                 on_events: Callable[[list[KVEvent]], None] | None = None) -> None:
        """``on_events``: the sink of the engine's KV events (see ``AsyncEngine``). With
        tensor parallelism the transport serves the engine's staging blocks (``transfer_cache``),
        into which each pinned prompt's blocks are gathered from every rank."""
        self.worker_id = worker_id
        self.config = config or PrefillConfig()
        self.transport = transport
        self.engine = AsyncEngine(engine, on_events)
        self.leases = LeaseTable(self.config.lease_ttl_s, clock)
        self.transport.reads_allowed = self.leases.covers  # a read needs a live lease
        self.metrics = PrefillMetrics()
        self.peers: dict[str, PairingInfo] = {}  # decode workers met so far
        self._blocks = block_bytes(kv_storage(engine.transfer_cache))
        self._info: PairingInfo | None = None
        self._reaper: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.transport.start(kv_storage(self.engine.llm.transfer_cache))
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
        if last.kv is None and last.finish_reason is None:
            # Tensor parallelism with every staging block held by other leases: no KV to
            # offer; the decode worker prefills the prompt itself.
            self.metrics.unstaged += 1
            log.warning("%s: request %s: no free staging blocks for its %d prompt blocks; "
                        "the decode worker will recompute its prefill", self.worker_id,
                        request_id,
                        -(-request.num_prompt_tokens // self.engine.llm.config.block_size))
        if last.kv is not None:
            lease = self.leases.grant(request_id, last.kv.block_ids, reader)
            self.metrics.leases_granted += 1
            self.transport.expect_reads(self.config.lease_ttl_s)  # until the lease expires
            checksums = (tuple(block_checksums(self._blocks, last.kv.block_ids))
                         if self.config.checksums else None)
            handle = KVHandle(self.worker_id, lease.lease_id, last.kv.block_ids,
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

    async def _free(self, leases: list[Lease]) -> None:
        ids = [lease.request_id for lease in leases]
        await self.engine.call(lambda engine: [engine.release_kv(i) for i in ids])

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_every_s)
            try:
                await self.expire_leases()
            except Exception:
                log.exception("%s: lease expiry failed", self.worker_id)
