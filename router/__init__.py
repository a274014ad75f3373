"""Tandem's router: prefix-aware, load-aware choice of prefill and decode workers.

Imports no torch and no Ray. See docs/router.md.
"""

from tandem.router.bus import EventBus, EventSubscription
from tandem.router.config import RouterConfig
from tandem.router.decision import RoutingDecision
from tandem.router.errors import (
    BusReset,
    BusUnavailable,
    NoHealthyWorkers,
    RegistrationRefused,
    RegistryUnavailable,
    RouterError,
    SettingsMismatch,
)
from tandem.router.fallback_registry import FallbackRegistry
from tandem.router.forwarder import WorkerEventForwarder, attach_worker
from tandem.router.index import PrefixIndex
from tandem.router.redis_bus import RedisStreamEventBus
from tandem.router.redis_conn import connect
from tandem.router.redis_registry import RedisRegistry
from tandem.router.registry import (
    InProcessRegistry,
    WorkerInfo,
    WorkerLoad,
    WorkerMembership,
    WorkerRecord,
    WorkerRegistry,
)
from tandem.router.router import Router, RouterStatus
from tandem.router.wire import InProcessEventBus
from tandem.services.protocol.block_hash import PromptHasher

__all__ = [
    "BusReset",
    "BusUnavailable",
    "EventBus",
    "EventSubscription",
    "FallbackRegistry",
    "InProcessEventBus",
    "InProcessRegistry",
    "NoHealthyWorkers",
    "PrefixIndex",
    "PromptHasher",
    "RedisRegistry",
    "RedisStreamEventBus",
    "RegistrationRefused",
    "RegistryUnavailable",
    "Router",
    "RouterConfig",
    "RouterError",
    "RouterStatus",
    "RoutingDecision",
    "SettingsMismatch",
    "WorkerEventForwarder",
    "WorkerInfo",
    "WorkerLoad",
    "WorkerMembership",
    "WorkerRecord",
    "WorkerRegistry",
    "attach_worker",
    "connect",
]
