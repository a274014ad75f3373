"""Build Tandem's Ray Serve application from one ``AppConfig``.

    gateway (OpenAI HTTP and gRPC, each on its own port, served by the replica; router inside)
      ├── prefill workers  (config.prefill_replicas replicas, one engine each)
      └── decode workers   (config.decode_replicas replicas, one engine each)

Replica choice for the workers goes through ``TandemRequestRouter``, which sends each call to
the replica the gateway's prefix-/load-aware router picked. ``config.colocated`` deploys the
gateway alone, with one engine doing both phases.

``app_builder`` is the same application for a Serve config file (KubeRay's ``serveConfigV2``):
``import_path: tandem.services.app:app_builder`` with the ``AppConfig`` settings as
``args``. Serve's HTTP proxy is not used (``proxy_location: Disabled``): the gateway replica
owns its sockets.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from tandem.services.serving.config import AppConfig, ConfigError
from tandem.services.serving.gateway import GatewayIngress
from tandem.services.serving.workers import DecodeReplica, PrefillReplica

__all__ = ["AppConfig", "ConfigError", "app_builder", "build_app"]

# Serve's own bound on calls a worker replica runs at once: the gateway's admission bound plus
# room for probes and status polls, so Serve never queues what the gateway admitted.
PROBE_ROOM = 32


# Serve calls each replica's ``check_health`` this often; a replica whose engine stopped, or
# that does not answer within the timeout (a hung or SIGSTOPped process), is replaced.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0


# How much of a role's placement resource (``AppConfig.prefill_resource``, ...) a replica takes:
# enough to need a node that declares it, little enough that any number fit there.
PLACEMENT_SHARE = 0.001


def actor_options(resource: str | None, share: float = PLACEMENT_SHARE) -> dict[str, Any]:
    """A replica's Ray options: no CPU from Ray's bookkeeping (the engine's threads take what
    they use), and on a node that declares ``resource`` if one is named, taking ``share`` of
    it."""
    options: dict[str, Any] = {"num_cpus": 0}
    if resource is not None:
        options["resources"] = {resource: share}
    return options


def build_app(config: AppConfig) -> Application:
    max_ongoing = config.in_flight_limit() + PROBE_ROOM
    # A gateway replica takes its node's whole gateway resource: it listens on the node's
    # port and grpc_port, so two never share a node.
    gateway = serve.deployment(GatewayIngress, name="gateway",
                               num_replicas=config.gateway_replicas,
                               ray_actor_options=actor_options(config.gateway_resource, 1.0),
                               health_check_period_s=HEALTH_CHECK_PERIOD_S,
                               health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S)
    if config.colocated:
        return gateway.bind(config)
    router = RequestRouterConfig(
        request_router_class="tandem.services.serving.request_router:TandemRequestRouter")
    def worker(cls: type, role: str, replicas: int, resource: str | None):  # type: ignore[no-untyped-def]
        return serve.deployment(cls, name=role, num_replicas=replicas,
                                ray_actor_options=actor_options(resource),
                                # a prefill replica also answers D's lease calls
                                max_ongoing_requests=2 * max_ongoing,
                                request_router_config=router,
                                # a stopped worker finishes its calls this long; then its
                                # streams migrate (services/serving/backend.py)
                                graceful_shutdown_timeout_s=config.drain_timeout_s,
                                health_check_period_s=HEALTH_CHECK_PERIOD_S,
                                health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S)

    prefill = worker(PrefillReplica, "prefill", config.prefill_replicas,
                     config.prefill_resource).bind(config)
    # Decode replicas call the prefill replicas themselves (pair, release, reject).
    decode = worker(DecodeReplica, "decode", config.decode_replicas,
                    config.decode_resource).bind(config, prefill)
    return gateway.bind(config, prefill, decode)


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder: ``args`` are ``AppConfig`` settings, loaded as `tandem up`
    loads its YAML file."""
    return build_app(AppConfig.from_dict(args, "serveConfigV2"))
