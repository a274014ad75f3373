"""The gateway replica: the OpenAI HTTP app and the gRPC front end, each on its own port, over
one backend (disaggregated or colocated). It serves both sockets itself (``FrontEnds``;
Serve's HTTP proxy is off): no extra process and hop per request, and uvicorn's flow control
reaches the gateway, which cuts clients that stop reading.

Disaggregated, it holds the tokenizer and the router and imports no torch: the model's
metadata is read without its weights (``load_model_metadata``). Colocated, it runs the engine
itself and so loads the model (imported only then)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path

from ray.serve.handle import DeploymentHandle

from tandem.router import (
    FallbackRegistry,
    InProcessEventBus,
    InProcessRegistry,
    RedisRegistry,
    RedisStreamEventBus,
    Router,
    RouterConfig,
    connect,
)
from tandem.services import tracing
from tandem.services.engine.tokenizer_loader import (
    load_model_metadata,
    read_chat_template,
    read_generation_config,
    sampling_defaults,
)
from tandem.services.gateway import (
    EngineBackend,
    Gateway,
    GatewayConfig,
)
from tandem.services.gateway.runner import FrontEnds
from tandem.services.gateway.tenants import Tenants, read_api_keys, read_tenant_weights
from tandem.services.protocol.block_hash import HashSettings
from tandem.services.protocol.handoff import read_secret
from tandem.services.serving import metrics
from tandem.services.serving.backend import BackendTimeouts, DisaggBackend
from tandem.services.serving.cluster_view import ClusterView, WorkerSnapshot
from tandem.services.serving.config import AppConfig

log = logging.getLogger(__name__)

WORKERS_READY_TIMEOUT_S = 300.0
MIN_REGISTRY_TTL_S = 5.0  # InProcessRegistry's own default


def registry_ttl_s(config: AppConfig) -> float:
    """How long a polled worker's record lives without another report: two polls at the
    idle pace (the slowest the gateway polls at), at least MIN_REGISTRY_TTL_S."""
    return max(MIN_REGISTRY_TTL_S, 2 * config.idle_poll_interval_s, 2 * config.poll_interval_s)


def tenants_of(config: AppConfig) -> Tenants:
    """The API keys, cache-salt secret and rate limits the config names (files read here, in
    the gateway's process: on Kubernetes, Secrets mounted into its pod); each gateway replica
    enforces its share of the limits."""
    keys = read_api_keys(config.api_keys_file) if config.api_keys_file else {}
    secret = read_secret(config.cluster_secret_file) if config.cluster_secret_file else b""
    weights = read_tenant_weights(config.api_keys_file) if config.api_keys_file else {}
    rates = [None if rate is None else config.gateway_share(rate) for rate in
             (config.tenant_requests_per_minute, config.tenant_tokens_per_minute)]
    tenants = Tenants(keys, secret, *rates, weights=weights,
                      keys_file=Path(config.api_keys_file) if config.api_keys_file else None)
    if keys:  # the tenants, never the keys
        log.info("API keys on: %d key(s) for tenants %s", len(keys),
                 ", ".join(tenants.tenant_names))
    return tenants


def request_defaults(config: AppConfig, model_defaults: Mapping[str, float | int]
                     ) -> Mapping[str, float | int]:
    """The sampling defaults of requests that leave them unset, as ``generation_config``
    says: the model's (auto), none (vllm) or a folder's generation_config.json."""
    if config.generation_config == "auto":
        return model_defaults
    if config.generation_config == "vllm":
        return {}
    return sampling_defaults(read_generation_config(Path(config.generation_config)))


class GatewayIngress:
    async def __init__(self, config: AppConfig, prefill: DeploymentHandle | None = None,
                   decode: DeploymentHandle | None = None) -> None:
        self.config = config
        tracing.configure("gateway")
        self.view: ClusterView | None = None
        self.router: Router | None = None
        meta = await asyncio.to_thread(load_model_metadata, config.model)
        defaults = request_defaults(config, meta.sampling_defaults)
        gateway_config = GatewayConfig(served_model_names=config.served_model_names(),
                                       seed=config.seed,
                                       max_body_bytes=config.max_body_bytes,
                                       request_timeout_s=config.request_timeout_s,
                                       max_in_flight=config.gateway_share(
                                           config.in_flight_limit()),
                                       tenant_max_in_flight=None if config.tenant_max_in_flight
                                       is None else config.gateway_share(
                                           config.tenant_max_in_flight),
                                       client_read_timeout_s=config.client_read_timeout_s,
                                       header_timeout_s=config.http_header_timeout_s,
                                       body_timeout_s=config.http_body_timeout_s,
                                       max_connections=config.max_connections,
                                       max_grpc_streams=config.max_grpc_streams,
                                       sampling_defaults=defaults,
                                       metrics_require_key=config.metrics_require_key,
                                       cors_allow_origins=config.cors_origins(),
                                       reasoning_parser=config.reasoning_parser,
                                       tool_call_parser=config.tool_call_parser,
                                       responses_redis_url=config.redis_url)
        tenants = tenants_of(config)
        tls = config.server_tls()
        if defaults:
            log.info("request defaults from %s: %s", "the model's generation_config.json"
                     if config.generation_config == "auto" else config.generation_config,
                     defaults)
        # The chat template the gateway renders: --chat-template's, else the model's.
        template = None if config.chat_template is None else read_chat_template(
            config.chat_template)
        if config.colocated:
            from tandem.services.engine.async_engine import AsyncEngine
            from tandem.services.engine.llm_engine import LLMEngine

            engine = await asyncio.to_thread(LLMEngine, config.engine_config())
            tokenizer = engine.tokenizer if template is None else (
                engine.tokenizer.with_chat_template(template))
            self.gateway = Gateway(EngineBackend(AsyncEngine(engine)), tokenizer,
                                   gateway_config, tenants)
            source = self._colocated_snapshot
            migrations = None
        else:
            assert prefill is not None and decode is not None
            backend = await self._disaggregated(config, meta.model_id, prefill, decode)
            tokenizer = meta.tokenizer if template is None else (
                meta.tokenizer.with_chat_template(template))
            self.gateway = Gateway(backend, tokenizer, gateway_config, tenants)
            view = self.view
            assert view is not None
            self.gateway.refresh_stats = lambda: view.refresh(config.poll_interval_s)
            view.busy = self.gateway.busy  # polls at the idle pace once no request is in flight
            if config.max_in_flight is None:  # one decode batch per healthy decode worker
                view.follow_decode_capacity(self.gateway.set_admission_limit,
                                            config.max_num_seqs, config.gateway_replicas)
            source = backend.snapshots
            migrations = backend.migrations
        metrics.register(self.gateway.metrics.registry, self.gateway.model_name, source,
                         self.router, migrations, config)
        self.fronts = FrontEnds(self.gateway, config.host, config.port, config.grpc_port,
                                log_level="warning", graceful_shutdown_s=1.0,
                                configure_logging=False,  # Ray owns the replica's logging
                                tls=tls)
        await self.fronts.start()

    async def _disaggregated(self, config: AppConfig, model_id: str, prefill: DeploymentHandle,
                             decode: DeploymentHandle) -> DisaggBackend:
        settings = HashSettings(config.block_size, model_id,
                                kv_cache_dtype=config.kv_cache_dtype)
        router_config = RouterConfig(settings, policy=config.routing_policy,
                                     max_local_prefill_tokens=config.max_local_prefill_tokens)
        # The workers this gateway polls through Serve: the whole registry in-process, and with
        # Redis the fallback for workers Redis has no record of (it is soft state: down,
        # read-only or full, it must not keep a worker from being routed to).
        # A record outlives two idle-paced polls: at the registry's default 5 s TTL, polls
        # every idle_poll_interval_s (5 s) let the workers lapse between them on an idle
        # cluster ("worker ... lapsed" every ~10 s). A worker whose poll fails is marked down
        # at once anyway (ClusterView._poll), so this only ends spurious lapses.
        registry = InProcessRegistry(settings, ttl_s=registry_ttl_s(config))
        bus: InProcessEventBus | None = None
        if config.redis_url:
            url = config.redis_url
            # In a thread: publishing the settings waits out Redis' timeouts when it is down.
            router = await asyncio.to_thread(
                Router, router_config, FallbackRegistry(RedisRegistry(connect(url)), registry),
                RedisStreamEventBus(connect(url)))
        else:
            bus = InProcessEventBus()
            router = Router(router_config, registry, bus)
        self.router = router
        self.view = ClusterView(router, {"prefill": prefill, "decode": decode}, registry, bus,
                                config.poll_interval_s, config.idle_poll_interval_s)
        await self.view.wait_for({"prefill": config.prefill_replicas,
                                  "decode": config.decode_replicas}, WORKERS_READY_TIMEOUT_S)
        if config.redis_url:
            await asyncio.to_thread(router.sync)  # knows the polled workers before it is ready
            router.start()
        self.view.start()
        max_len = min(w.max_model_len for w in self.view.workers.values())
        return DisaggBackend(router, self.view, prefill, decode, model_id, max_len,
                             BackendTimeouts(config.prefill_timeout_s,
                                             config.stream_idle_timeout_s,
                                             config.max_migrations))

    def _colocated_snapshot(self) -> list[WorkerSnapshot]:
        backend = self.gateway.backend
        return [WorkerSnapshot("colocated", "colocated", backend.stats,
                               healthy=self.gateway.health_problem() is None,
                               attention_backend=getattr(backend, "attention_backend", ""),
                               max_model_len=backend.max_model_len)]

    def check_health(self) -> None:
        """Ray Serve's health check: a colocated engine that stopped fails it (its workers'
        faults are theirs to report; the gateway's /health says 503 while none can serve)."""
        backend = self.gateway.backend
        if isinstance(backend, EngineBackend):
            backend.engine.check_health()

    async def __del__(self) -> None:
        # Also after a failed start: what was not built yet is not there to stop.
        fronts: FrontEnds | None = getattr(self, "fronts", None)
        if fronts is not None:
            with contextlib.suppress(Exception):
                await fronts.stop()
        gateway: Gateway | None = getattr(self, "gateway", None)
        backend = None if gateway is None else gateway.backend
        if isinstance(backend, DisaggBackend):  # its decode channels: the replicas drain
            await backend.close()
        if self.view is not None:
            await self.view.close()
        if self.router is not None:
            self.router.close()
        if isinstance(backend, EngineBackend):
            await asyncio.to_thread(backend.engine.shutdown)
        tracing.flush()
