"""Tandem's router: prefix-aware, load-aware choice of prefill and decode workers.

Imports no torch and no Ray. See docs/router.md.
"""

from router.bus import EventBus, EventSubscription
from router.config import RouterConfig
from router.decision import RoutingDecision
from router.errors import (
    BusReset,
    BusUnavailable,
    NoHealthyWorkers,
    RegistrationRefused,
    RegistryUnavailable,
    RouterError,
    SettingsMismatch,
)
from router.fallback_registry import FallbackRegistry
from router.forwarder import WorkerEventForwarder, attach_worker
from router.hashing import PromptHasher
from router.index import PrefixIndex
from router.inprocess_bus import InProcessEventBus
from router.redis_bus import RedisStreamEventBus
from router.redis_conn import connect
from router.redis_registry import RedisRegistry
from router.registry import (
    InProcessRegistry,
    WorkerInfo,
    WorkerLoad,
    WorkerMembership,
    WorkerRecord,
    WorkerRegistry,
)
from router.router import Router, RouterStatus

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
