"""Prefill and decode worker replicas: one engine each, wrapped as Ray Serve deployments.

A replica's worker id is its Serve replica id, so the router's choice names a replica. The
prefill replica also serves the control channel (services/control) on which decode workers
release or reject its leases; KV blocks move over the configured transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from router import WorkerInfo, WorkerLoad
from services import tracing
from services.control.codec import logprobs_to_dict, params_from_dict
from services.control.rpc import RpcServer
from services.decode import DecodeConfig, DecodeWorker
from services.engine.engine import LLMEngine, RequestOutput
from services.kv_transfer.factory import make_transport
from services.prefill import PrefillConfig, PrefillResult, PrefillWorker
from services.prefill.service import RemotePrefill, prefill_handlers
from services.serving.config import AppConfig
from services.serving.worker_events import EventBuffer, RedisMembership

Worker = PrefillWorker | DecodeWorker

_WILDCARDS = ("0.0.0.0", "::", "")


def reachable_host(worker_host: str) -> str:
    """The address a replica listens on and gives its peers: a wildcard ``worker_host`` (the
    Helm chart's) becomes this Ray node's IP, a pod's own IP under KubeRay."""
    return ray.util.get_node_ip_address() if worker_host in _WILDCARDS else worker_host


class _Replica:
    """What both roles share: identity, load reports, KV events, status."""

    role: str
    worker: Worker

    def _setup(self, config: AppConfig) -> LLMEngine:
        self.config = config
        tracing.configure(self.role)
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        engine = LLMEngine(config.engine_config(decodes=self.role == "decode"))
        self.engine = engine
        self.events = None if config.redis_url else EventBuffer(engine.kv_events, self.worker_id)
        # Reports can reach the gateway out of order (a slow status poll after a response);
        # the sequence lets it keep the newest load.
        self._report_seq = itertools.count(1)
        self.redis: RedisMembership | None = None
        self.host = reachable_host(config.worker_host)
        self.address = ""
        return engine

    def _transport(self):  # type: ignore[no-untyped-def]
        return make_transport(self.config.kv_transport, self.worker_id,
                              host=self.host)

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, self.role, self.address, self.config.block_size,
                          self.engine.model_config.model_id, self.engine.kv_spec.num_blocks)

    def _start_membership(self) -> None:
        if self.config.redis_url:
            self.redis = RedisMembership(self.config.redis_url, self.info(),
                                         self.engine.kv_events, self.load)
            self.redis.start()

    def load(self) -> WorkerLoad:
        stats = self.engine.stats
        return WorkerLoad(pending_prefill_blocks=self._pending_prefill_blocks(),
                          kv_usage=stats.kv_cache_usage,
                          running_sequences=stats.num_running + stats.num_waiting)

    def _pending_prefill_blocks(self) -> int:
        # Read off the engine thread: a racy but harmless estimate (lists are only appended to
        # and removed from; a stale count is what heartbeats are anyway).
        sched, size = self.engine.scheduler, self.config.block_size
        seqs = [*list(sched.waiting), *list(sched.running)]
        return sum(-(-(s.num_prompt_tokens - s.num_computed_tokens) // size)
                   for s in seqs if s.num_computed_tokens < s.num_prompt_tokens)

    def report(self) -> dict[str, Any]:
        """Load and buffered KV events, piggy-backed on every response to the gateway."""
        return {"worker_id": self.worker_id, "seq": next(self._report_seq),
                "load": dataclasses.asdict(self.load()),
                "events": self.events.drain() if self.events is not None else []}

    async def status(self, route_to: str | None = None) -> dict[str, Any] | None:
        """Registration info, engine stats, worker metrics; None if misrouted."""
        if route_to is not None and route_to != self.worker_id:
            return None
        status = await self.worker.status()
        return {**status, **self.report(), "info": dataclasses.asdict(self.info()),
                "max_model_len": self.engine.max_model_len}

    async def _close_membership(self) -> None:
        if self.redis is not None:
            await self.redis.close()


class PrefillReplica(_Replica):
    role = "prefill"

    async def __init__(self, config: AppConfig) -> None:
        engine = self._setup(config)
        self.worker = PrefillWorker(engine, self._transport(),
                                    PrefillConfig(lease_ttl_s=config.lease_ttl_s), self.worker_id)
        await self.worker.start()
        self.rpc = RpcServer(prefill_handlers(self.worker), self.host, 0)
        await self.rpc.start()
        self.address = f"{self.host}:{self.rpc.port}"
        self._start_membership()

    async def prefill(self, request_id: str, prompt: list[int], params: dict[str, Any],
                      cache_salt: str | None = None, route_to: str | None = None,
                      trace: dict[str, str] | None = None) -> dict[str, Any]:
        with tracing.attached(trace):  # the gateway's request span parents the prefill span
            result = await self.worker.prefill(request_id, prompt, params_from_dict(params),
                                               cache_salt)
        return {"result": result.to_dict(), "address": self.address, **self.report()}

    async def reject(self, lease_id: str, reason: str, route_to: str | None = None) -> bool:
        if route_to is not None and route_to != self.worker_id:
            return False
        return await self.worker.reject(lease_id, reason)

    async def __del__(self) -> None:
        await self._close_membership()
        await self.rpc.close()
        await self.worker.close()
        tracing.flush()


class DecodeReplica(_Replica):
    role = "decode"

    async def __init__(self, config: AppConfig) -> None:
        engine = self._setup(config)
        self.worker = DecodeWorker(engine, self._transport(), DecodeConfig(), self.worker_id)
        await self.worker.start()
        self._pairing = asyncio.Lock()
        self._paired: set[str] = set()
        self._start_membership()

    async def generate(self, request_id: str, prompt: list[int], params: dict[str, Any],
                       prefill: dict[str, Any] | None, prefill_address: str | None = None,
                       cache_salt: str | None = None, route_to: str | None = None,
                       trace: dict[str, str] | None = None
                       ) -> AsyncIterator[list[dict[str, Any]]]:
        """Stream the request's outputs after the first token, one list per batch of engine
        steps (whatever accumulated while the previous batch was in flight); the last
        list ends with this worker's report."""
        first = None if prefill is None else PrefillResult.from_dict(prefill)
        with tracing.attached(trace):  # the gateway's request span parents the decode span
            if first is not None and first.kv is not None and prefill_address:
                await self._pair(first.kv.worker_id, prefill_address)
            stream = await self.worker.submit(request_id, prompt, params_from_dict(params),
                                              first, cache_salt)
        queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        pump = asyncio.create_task(_pump(stream, queue))
        try:
            done = False
            while not done:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                done = batch[-1] is None
                outputs = [encode_output(o) for o in batch if o is not None]
                if done:
                    pump.result()  # re-raises a failure of the stream
                    yield [*outputs, {"report": self.report(),
                                      "kv_source": str(stream.kv_source)}]
                elif outputs:
                    yield outputs
        finally:
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pump
            await stream.aclose()

    async def _pair(self, prefill_id: str, address: str) -> None:
        async with self._pairing:
            if prefill_id in self._paired:
                return
            host, _, port = address.rpartition(":")
            with tracing.tracer().start_as_current_span("kv_transfer.pair"):
                await self.worker.pair(RemotePrefill(host, int(port)))
            self._paired.add(prefill_id)

    async def __del__(self) -> None:
        await self._close_membership()
        await self.worker.close()
        tracing.flush()


async def _pump(stream: AsyncIterator[RequestOutput],
                queue: asyncio.Queue[RequestOutput | None]) -> None:
    try:
        async for out in stream:
            queue.put_nowait(out)
    finally:
        queue.put_nowait(None)


def encode_output(out: RequestOutput) -> dict[str, Any]:
    return {"t": out.new_token_ids, "f": None if out.finish_reason is None else
            str(out.finish_reason), "n": out.num_output_tokens,
            "lp": [logprobs_to_dict(lp) for lp in out.new_logprobs]}

