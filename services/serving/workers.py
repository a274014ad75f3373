"""Prefill and decode worker replicas: one engine each, wrapped as Ray Serve deployments.

A replica's worker id is its Serve replica id, so the router's choice names a replica. Every
call between processes goes through Serve handles (one control plane, docs/architecture.md):
the gateway's ``prefill`` / ``reject`` / ``status``, its decode ``channel`` (one stream per
gateway and decode replica: services/serving/decode_channel.py, ``ChannelOutbox``) /
``submit`` / ``abort``, and the decode replica's ``pair`` / ``release`` / ``reject`` on the
prefill replica. Each call names its replica with ``route_to``; a replica that is not the one
named raises ``ReplicaGoneError`` (see request_router.py). KV blocks move over the configured
transport (NIXL or TCP).

Worker side of the router's inputs: numbered KV events and load, in-process or over Redis.

The engine thread hands each drained batch of KV events to ``WorkerEvents.on_engine_events``,
which only numbers, mirrors and queues them (``router.WorkerEventForwarder``); nothing on the
engine thread encodes or touches the network. Then:

- in-process mode (no ``redis_url``) the gateway owns the index: the queued events travel in the
  worker's next report (a response or a status poll, ``report_events``); when the gateway's
  router saw a gap in the numbers it asks for a snapshot with the next status poll;
- with Redis, one background thread sends them in pipelined batches to the Redis Stream and
  heartbeats, which keeps the worker registered (and resyncs the stream when routers ask, or
  after any failure). Redis may be down, read-only or full: the worker starts and serves all
  the same, and catches up when Redis accepts writes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from tandem.router import (
    RedisRegistry,
    RedisStreamEventBus,
    RegistrationRefused,
    WorkerEventForwarder,
    WorkerInfo,
    WorkerLoad,
    WorkerMembership,
    attach_worker,
    connect,
)
from tandem.router.wire import WorkerEvent, encode_event
from tandem.services import tracing
from tandem.services.engine.faults import fault_hook_from_env, planned_faults
from tandem.services.engine.kv_cache import kv_storage
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.handoff.decode import DecodeConfig, DecodeWorker
from tandem.services.handoff.pairing import PairingError, PairingInfo
from tandem.services.handoff.prefill import PrefillConfig, PrefillWorker
from tandem.services.handoff.staging import TransferArea
from tandem.services.kv_transfer.factory import make_transport
from tandem.services.protocol.handoff import ClusterKey, PrefillResult
from tandem.services.protocol.kv_events import KVEvent
from tandem.services.protocol.messages import ChannelClosedError, ReplicaGoneError, WorkerReport
from tandem.services.protocol.request import GenerationRequest
from tandem.services.serving.config import WILDCARD_HOSTS, AppConfig
from tandem.services.serving.decode_channel import ChannelItem, ChannelOutbox

Worker = PrefillWorker | DecodeWorker
log = logging.getLogger(__name__)


def reachable_host(worker_host: str) -> str:
    """The address a replica listens on and gives its peers: a wildcard ``worker_host`` (the
    Helm chart's) becomes this Ray node's IP, a pod's own IP under KubeRay."""
    return ray.util.get_node_ip_address() if worker_host in WILDCARD_HOSTS else worker_host


class _Replica:
    """What both roles share: identity, load reports, KV events, status."""

    role: str
    worker: Worker

    def _setup(self, config: AppConfig) -> LLMEngine:
        self.config = config
        tracing.configure(self.role)
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        self.engine = LLMEngine(config.engine_config(decodes=self.role == "decode"))
        self.engine.fault_hook = fault_hook_from_env(self.role)  # test-only, off by default
        self.area = TransferArea(self.engine)  # the blocks KV transfers read or write
        self._faults = planned_faults(self.role)
        self.events = WorkerEvents(self.worker_id, config.redis_url)
        # Reports can reach the gateway out of order (a slow status poll after a response);
        # the sequence lets it keep the newest load.
        self._report_seq = itertools.count(1)
        self.host = reachable_host(config.worker_host)
        # The cluster secret: KV reads prove it, lease handles and pairings are signed with it.
        self.key = (ClusterKey.from_file(config.cluster_secret_file)
                    if config.cluster_secret_file else None)
        return self.engine

    def _transport(self):  # type: ignore[no-untyped-def]
        return make_transport(self.config.kv_transport, self.worker_id, host=self.host,
                              device=self.engine.config.device, key=self.key,
                              kv_cache=kv_storage(self.area.cache),
                              tls=self.config.internal_tls())

    def _check_route(self, route_to: str | None) -> None:
        if route_to is not None and route_to != self.worker_id:
            raise ReplicaGoneError(f"{self.role} replica {route_to} is gone (the call reached "
                                   f"{self.worker_id})")

    def check_health(self) -> None:
        """Ray Serve's health check: raises once the engine stopped after a fatal fault, so
        Serve replaces this replica (the gateway stops routing to it at its next poll)."""
        self.worker.engine.check_health()

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, self.role, self.host, self.config.block_size,
                          self.engine.model_config.model_id, self.engine.kv_spec.num_blocks)

    def load(self) -> WorkerLoad:
        stats = self.worker.engine.stats  # the engine thread's snapshot after its last step
        return WorkerLoad(pending_prefill_blocks=stats.pending_prefill_blocks,
                          kv_usage=stats.kv_cache_usage,
                          running_sequences=stats.num_running + stats.num_waiting)

    def report(self, snapshot: bool = False) -> WorkerReport:
        """Load and queued KV events, piggy-backed on every response to the gateway."""
        return WorkerReport(self.worker_id, next(self._report_seq), self.load(),
                            self.events.report_events(snapshot))

    async def status(self, route_to: str | None = None, snapshot: bool = False
                     ) -> dict[str, Any] | None:
        """Registration info, engine stats, worker metrics and a report; None if misrouted.
        ``snapshot``: the report's events start with this worker's whole cache (the gateway's
        router found a gap in its numbered events)."""
        if route_to is not None and route_to != self.worker_id:
            return None
        engine = self.worker.engine
        if not engine.healthy:  # its stats would wait on a stopped engine
            return {"worker_id": self.worker_id, "healthy": False,
                    "health_error": engine.health_error, "engine": dataclasses.asdict(
                        engine.stats), "info": dataclasses.asdict(self.info()),
                    "max_model_len": self.engine.max_model_len}
        status = await self.worker.status()
        return {**status, "healthy": True, "report": self.report(snapshot),
                "info": dataclasses.asdict(self.info()),
                "max_model_len": self.engine.max_model_len,
                "attention_backend": self.engine.attention_backend}

    async def _close_events(self) -> None:
        await self.events.close()


class PrefillReplica(_Replica):
    role = "prefill"

    async def __init__(self, config: AppConfig) -> None:
        engine = self._setup(config)
        self._tripwire: tuple[str, signal.Signals] | None = None  # test-only: see _trip
        self.worker = PrefillWorker(engine, self._transport(),
                                    PrefillConfig(lease_ttl_s=config.lease_ttl_s), self.worker_id,
                                    on_events=self.events.on_engine_events, area=self.area)
        await self.worker.start()
        self.events.start(self.info(), self.load, lambda: self.worker.engine.healthy)

    async def prefill(self, request: GenerationRequest, route_to: str | None = None,
                      reader: str | None = None) -> tuple[PrefillResult, WorkerReport]:
        """``reader``: the decode replica the gateway will hand the lease to (only it may
        read the blocks and release the lease)."""
        self._check_route(route_to)
        with tracing.attached(request.trace):  # the gateway's request span parents this one
            result = await self.worker.prefill(request, reader)
        fault = self._faults.get(request.params.seed) if request.params.seed is not None else None
        if fault in ("sigstop", "sigkill") and result.kv is not None:
            self._tripwire = (result.kv.lease_id, signal.SIGSTOP if fault == "sigstop"
                              else signal.SIGKILL)
        return result, self.report()

    def _trip(self, lease_id: str | None = None) -> None:
        """Test-only (services/engine/faults.py ``sigstop``/``sigkill``): at the decode worker's
        next call about an armed lease (its pairing, if first, or the lease's release), stop
        or kill this process before answering, as a hung or dead machine would."""
        if self._tripwire is not None and lease_id in (None, self._tripwire[0]):
            sig = self._tripwire[1]
            self._tripwire = None
            log.warning("%s: sending this process %s (injected fault)", self.worker_id,
                        sig.name)
            os.kill(os.getpid(), sig)

    # The lease calls run in ``control.<method>`` spans under the caller's (the decode worker's
    # kv_transfer span), as the same calls do over the control RPC of workers run without Ray.

    async def pair(self, decode: PairingInfo, route_to: str | None = None,
                   trace: dict[str, str] | None = None) -> PairingInfo:
        self._check_route(route_to)
        self._trip()
        with tracing.served("control.pair", trace):
            return await self.worker.pair(decode)

    async def release(self, lease_id: str, reader: str, route_to: str | None = None,
                      trace: dict[str, str] | None = None) -> bool:
        self._check_route(route_to)
        self._trip(lease_id)
        with tracing.served("control.release", trace):
            return await self.worker.release(lease_id, reader)

    async def reject(self, lease_id: str, reason: str, route_to: str | None = None,
                     trace: dict[str, str] | None = None) -> bool:
        self._check_route(route_to)
        with tracing.served("control.reject", trace):
            return await self.worker.reject(lease_id, reason)

    async def __del__(self) -> None:
        # Serve stops a replica (scale-down, upgrade) after its calls ended or drain_timeout_s
        # passed; its leases may still be pulled: keep them until then (or their TTL).
        held = await self.worker.drain(self.config.lease_ttl_s)
        if held:
            log.warning("%s: stopping with %d lease(s) still held", self.worker_id, held)
        await self._close_events()
        await self.worker.close()
        tracing.flush()


class ServePrefillPeer:
    """A prefill replica as the decode worker's ``PrefillPeer``, reached through Serve."""

    def __init__(self, handle: DeploymentHandle, worker_id: str) -> None:
        self.handle = handle
        self.worker_id = worker_id

    async def pair(self, info: PairingInfo) -> PairingInfo:
        result: PairingInfo = await self.handle.pair.remote(info, route_to=self.worker_id,
                                                            trace=tracing.inject())
        return result

    async def release(self, lease_id: str, reader: str) -> bool:
        return bool(await self.handle.release.remote(lease_id, reader, route_to=self.worker_id,
                                                     trace=tracing.inject()))

    async def reject(self, lease_id: str, reason: str) -> bool:
        return bool(await self.handle.reject.remote(lease_id, reason, route_to=self.worker_id,
                                                    trace=tracing.inject()))


class DecodeReplica(_Replica):
    role = "decode"

    async def __init__(self, config: AppConfig, prefill: DeploymentHandle) -> None:
        engine = self._setup(config)
        decode_config = DecodeConfig(transfer_timeout_s=config.kv_transfer_timeout_s,
                                     control_timeout_s=config.control_timeout_s)
        self.worker = DecodeWorker(engine, self._transport(), decode_config, self.worker_id,
                                   on_events=self.events.on_engine_events, area=self.area)
        await self.worker.start()
        self.prefill = prefill
        self._pairing: dict[str, asyncio.Lock] = {}  # one lock per prefill worker
        self._paired: set[str] = set()
        self._channels: dict[str, ChannelOutbox] = {}  # the gateways' decode channels
        self.events.start(self.info(), self.load, lambda: self.worker.engine.healthy)

    async def channel(self, channel_id: str, route_to: str | None = None
                      ) -> AsyncIterator[list[ChannelItem]]:
        """A gateway's decode channel (services/serving/decode_channel.py, ``ChannelOutbox``): a
        hello, then one list whenever any of its requests produced output. Ends only when the
        gateway cancels it (or goes away); then every request still on it is aborted."""
        self._check_route(route_to)
        outbox = self._channels[channel_id] = ChannelOutbox(channel_id, self.report)
        try:
            async for batch in outbox.batches():
                yield batch
        finally:
            del self._channels[channel_id]
            await outbox.close()

    async def submit(self, request: GenerationRequest, channel_id: str,
                     route_to: str | None = None) -> None:
        """Start decoding the request after its first token (pairing with its prefill worker
        and pulling its KV first); its outputs go to the channel ``channel_id``."""
        self._check_route(route_to)
        outbox = self._channels.get(channel_id)
        if outbox is None:
            raise ChannelClosedError(f"decode replica {self.worker_id} has no channel "
                                     f"{channel_id}")
        first = request.prefill
        with tracing.attached(request.trace):  # the gateway's request span parents this one
            if first is not None and first.kv is not None:
                await self._pair(first.kv.worker_id)
            stream = await self.worker.submit(request)
        await outbox.add(stream)

    async def abort(self, channel_id: str, request_id: str, route_to: str | None = None
                    ) -> None:
        """Stop a request on a channel (nothing if it ended, or the channel did): its engine
        stream closes and its KV is freed."""
        self._check_route(route_to)
        outbox = self._channels.get(channel_id)
        if outbox is not None:
            await outbox.abort(request_id)

    async def _pair(self, prefill_id: str) -> None:
        """Meet the prefill worker once (a lock per peer: a hung one holds up only the requests
        from it). A pairing that fails or times out is logged and left for the next request
        to retry; this request's pull then fails and D recomputes the prompt."""
        if prefill_id in self._paired:
            return
        async with self._pairing.setdefault(prefill_id, asyncio.Lock()):
            if prefill_id in self._paired:
                return
            with tracing.tracer().start_as_current_span("kv_transfer.pair") as span:
                try:
                    async with asyncio.timeout(self.config.control_timeout_s):
                        await self.worker.pair(ServePrefillPeer(self.prefill, prefill_id))
                except PairingError:  # the cluster is misconfigured: say so to the client
                    raise
                except Exception as exc:  # a timeout, the replica gone
                    tracing.mark_failed(span, exc)
                    log.warning("%s: pairing with prefill worker %s failed (%r); recomputing "
                                "its requests' prompts here", self.worker_id, prefill_id, exc)
                    return
            self._paired.add(prefill_id)

    async def __del__(self) -> None:
        await self._close_events()
        await self.worker.close()
        tracing.flush()


log = logging.getLogger(__name__)

PUBLISH_IDLE_S = 0.05  # the Redis publisher's longest sleep between checks


class ReportBus:
    """The in-process mode's ``EventBus``: holds a worker's published events (wire-encoded)
    until its next report takes them. Snapshots are asked for by the gateway, per report."""

    def __init__(self) -> None:
        self._events: list[str] = []
        self._lock = threading.Lock()

    def publish(self, events: Sequence[WorkerEvent]) -> None:
        encoded = [encode_event(e.worker_id, e.event, e.seq).decode() for e in events]
        with self._lock:
            self._events.extend(encoded)

    def drain(self) -> list[str]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def generation(self) -> str:
        return "report"

    def request_snapshots(self) -> None:  # the gateway asks through the status call instead
        pass

    def subscribe(self, replica_id: str):  # type: ignore[no-untyped-def]
        raise NotImplementedError("reports are read by the gateway, not subscribed to")


class WorkerEvents:
    """One worker's KV-event forwarding and (with Redis) registry membership.

    Redis is never on the engine's or the replica's path, and never needed to start: one
    background thread does all of its I/O (heartbeats and publishing), and each failure, be it
    a refused connection, a timeout or an error reply (READONLY, OOM), only marks the forwarder
    for a resync. The first heartbeat that reaches Redis registers the worker and republishes
    its whole cache.
    """

    def __init__(self, worker_id: str, redis_url: str | None, heartbeat_s: float = 1.0) -> None:
        self.worker_id = worker_id
        self._redis_url = redis_url
        self._heartbeat_s = heartbeat_s
        self._report_bus: ReportBus | None = None
        self.membership: WorkerMembership | None = None
        if redis_url:
            # Out of sync until the first heartbeat gets through (then it sends a snapshot of
            # the cache); nothing here touches Redis.
            self.forwarder = WorkerEventForwarder(RedisStreamEventBus(connect(redis_url)),
                                                  worker_id)
        else:
            self._report_bus = ReportBus()
            self.forwarder = attach_worker(self._report_bus, worker_id)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_engine_events(self, events: list[KVEvent]) -> None:
        """The engine thread's sink (``AsyncEngine(on_events=...)``): cheap, never blocks."""
        self.forwarder(events)
        self._wake.set()

    def report_events(self, snapshot: bool = False) -> list[str]:
        """In-process mode: the events queued since the last report (a snapshot first if the
        gateway asked), wire-encoded, for the report. Empty with Redis."""
        if self._report_bus is None:
            return []
        if snapshot:
            self.forwarder.resync(force=True)
        self.forwarder.flush()
        return self._report_bus.drain()

    def start(self, info: WorkerInfo, load: Callable[[], WorkerLoad],
              healthy: Callable[[], bool] = lambda: True) -> None:
        """With Redis: start the thread that registers, heartbeats and publishes. Returns at
        once, whether Redis is up or not. Once ``healthy()`` is False (the engine stopped) the
        worker leaves the registry and stops heartbeating, so routers never pick it again."""
        if not self._redis_url:
            return
        self.membership = WorkerMembership(RedisRegistry(connect(self._redis_url)), info,
                                           self.forwarder)
        self._thread = threading.Thread(target=self._run, args=(self.membership, load, healthy),
                                        daemon=True, name=f"redis-{self.worker_id}")
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        if self.membership is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.membership.leave)

    def _run(self, membership: WorkerMembership, load: Callable[[], WorkerLoad],
             healthy: Callable[[], bool]) -> None:
        """Heartbeat every ``heartbeat_s`` (the first at once), publish whenever events come."""
        next_beat = time.monotonic()
        while not self._stop.is_set():
            try:
                if not healthy():
                    log.error("%s: the engine stopped; leaving the registry", self.worker_id)
                    membership.leave()
                    return
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self._heartbeat_s
                    membership.heartbeat(load())  # False while Redis is unusable
                self.forwarder.flush()  # False on failure: the next heartbeat resyncs
            except RegistrationRefused:
                pass  # logged with its reason; routers refuse this worker as well
            except Exception:  # a bug: log, never stop
                log.exception("%s: Redis heartbeat or publish failed", self.worker_id)
            self._wake.wait(min(PUBLISH_IDLE_S, max(next_beat - time.monotonic(), 0.0)))
            self._wake.clear()
