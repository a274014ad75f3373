"""Worker registry: who serves, in which role, with which hash settings, under how much load.

Workers re-register with every heartbeat; a record lives ``ttl_s`` past its last heartbeat.
``RedisRegistry`` (tandem.router.redis_registry) is the cluster implementation;
``InProcessRegistry`` serves single-process runs and simulations behind the same interface.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandem.router.errors import RegistrationRefused, RegistryUnavailable, SettingsMismatch
from tandem.services.protocol.block_hash import HashSettings
from tandem.services.protocol.messages import WorkerInfo, WorkerLoad

if TYPE_CHECKING:
    from tandem.router.forwarder import WorkerEventForwarder

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
Clock = Callable[[], float]


IDLE = WorkerLoad()


@dataclass(frozen=True)
class WorkerRecord:
    info: WorkerInfo
    load: WorkerLoad
    heartbeat_seq: int  # bumps with every heartbeat; restarts at 1 after Redis loses it
    updated_at: float  # registry clock at the last heartbeat (wall time by default)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


def settings_mismatch(info: WorkerInfo, settings: HashSettings) -> str | None:
    """Why a worker with ``info`` cannot serve a cluster using ``settings``, or None."""
    problems = []
    if info.block_size != settings.block_size:
        problems.append(f"block size {info.block_size} != {settings.block_size}")
    if info.model_id != settings.model_id:
        problems.append(f"model {info.model_id!r} != {settings.model_id!r}")
    if info.hash_scheme != settings.scheme:
        problems.append(f"hash scheme {info.hash_scheme!r} != {settings.scheme!r}")
    return "; ".join(problems) or None


def validate_info(info: WorkerInfo, settings: HashSettings | None) -> None:
    """Raise RegistrationRefused (and log why) unless ``info`` may join a ``settings`` cluster."""
    reason: str | None = None
    if info.role not in ROLES:
        reason = f"role {info.role!r} is not one of {ROLES}"
    elif info.capacity_blocks < 0 or info.block_size < 1:
        reason = "block size and capacity must be positive"
    elif settings is not None:
        reason = settings_mismatch(info, settings)
    if reason is not None:
        log.error("refusing worker %s: %s", info.worker_id, reason)
        raise RegistrationRefused(info.worker_id, reason)


class WorkerRegistry(Protocol):
    def register(self, info: WorkerInfo, load: WorkerLoad = IDLE) -> None:
        """Add or refresh a worker (this is also the heartbeat).

        Raises RegistrationRefused on mismatched settings, RegistryUnavailable when unreachable.
        """
        ...

    def deregister(self, worker_id: str) -> None: ...

    def workers(self) -> list[WorkerRecord]:
        """Every worker whose heartbeat has not lapsed. Raises RegistryUnavailable."""
        ...

    def cluster_settings(self) -> HashSettings | None:
        """The hash settings routers published for this cluster, if any."""
        ...

    def publish_settings(self, settings: HashSettings) -> None:
        """Record the cluster's hash settings; raises SettingsMismatch if others are recorded."""
        ...


class InProcessRegistry:
    """Registry in this process's memory; heartbeats lapse by an injectable clock."""

    def __init__(
        self, settings: HashSettings | None = None, ttl_s: float = 5.0, clock: Clock = time.time
    ) -> None:
        self._settings = settings
        self.ttl_s = ttl_s
        self._clock = clock
        self._records: dict[str, WorkerRecord] = {}
        self._lock = threading.Lock()

    def register(self, info: WorkerInfo, load: WorkerLoad = IDLE) -> None:
        validate_info(info, self._settings)
        with self._lock:
            previous = self._live(info.worker_id)
            seq = previous.heartbeat_seq + 1 if previous is not None else 1
            self._records[info.worker_id] = WorkerRecord(info, load, seq, self._clock())

    def deregister(self, worker_id: str) -> None:
        with self._lock:
            self._records.pop(worker_id, None)

    def workers(self) -> list[WorkerRecord]:
        with self._lock:
            now = self._clock()
            lapsed = [w for w, r in self._records.items() if now - r.updated_at >= self.ttl_s]
            for worker_id in lapsed:
                del self._records[worker_id]
            return list(self._records.values())

    def cluster_settings(self) -> HashSettings | None:
        return self._settings

    def publish_settings(self, settings: HashSettings) -> None:
        if self._settings is not None and self._settings != settings:
            raise SettingsMismatch(f"cluster uses {self._settings}, not {settings}")
        self._settings = settings

    def _live(self, worker_id: str) -> WorkerRecord | None:
        record = self._records.get(worker_id)
        if record is not None and self._clock() - record.updated_at >= self.ttl_s:
            return None
        return record


class WorkerMembership:
    """Worker side: keeps one worker registered and its KV events in sync.

    Call ``heartbeat(load)`` every second or so (well inside the registry TTL). It re-sends the
    whole record, so a Redis restart only costs one heartbeat, and resyncs the event forwarder.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        info: WorkerInfo,
        forwarder: WorkerEventForwarder | None = None,
    ) -> None:
        self.registry = registry
        self.info = info
        self.forwarder = forwarder
        self._reachable = True

    def join(self, load: WorkerLoad = IDLE) -> None:
        """First registration: raises RegistrationRefused or RegistryUnavailable."""
        self.registry.register(self.info, load)

    def heartbeat(self, load: WorkerLoad) -> bool:
        """True if the worker is registered afterwards. RegistrationRefused still raises."""
        try:
            self.registry.register(self.info, load)
        except RegistryUnavailable as exc:
            if self._reachable:
                log.warning("worker %s: heartbeat failed: %s", self.info.worker_id, exc)
            self._reachable = False
            return False
        self._reachable = True
        if self.forwarder is not None:
            self.forwarder.resync()
        return True

    def leave(self) -> None:
        with contextlib.suppress(RegistryUnavailable):  # the record lapses on its own
            self.registry.deregister(self.info.worker_id)
