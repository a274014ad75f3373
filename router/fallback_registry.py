"""A registry that prefers a primary (Redis) and falls back to a local one.

Redis holds soft state: a worker whose heartbeats cannot reach it (Redis down, read-only or out
of memory) lapses there, and a restarted Redis knows nobody until the workers heartbeat again.
The gateway knows its workers without Redis (it polls each of them through Ray Serve) and
registers them in a local ``InProcessRegistry``. ``FallbackRegistry`` gives the router both:
the primary's records, completed by the local records of the workers the primary does not list,
and only the local ones while the primary is unreachable. So the router never loses a worker
because of Redis, and Redis wins wherever it has a record (its heartbeats carry the load).
"""

from __future__ import annotations

import logging

from tandem.router.errors import RegistryUnavailable, SettingsMismatch
from tandem.router.registry import IDLE, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRegistry
from tandem.services.protocol.block_hash import HashSettings

log = logging.getLogger(__name__)


class FallbackRegistry:
    """``workers()`` never raises ``RegistryUnavailable``; writes go to the primary."""

    def __init__(self, primary: WorkerRegistry, local: WorkerRegistry) -> None:
        self.primary = primary
        self.local = local
        self.primary_available = True  # as of the last read
        self._settings: HashSettings | None = None
        self._settings_due = False  # publish them to the primary again (it was unreachable)

    def register(self, info: WorkerInfo, load: WorkerLoad = IDLE) -> None:
        self.primary.register(info, load)

    def deregister(self, worker_id: str) -> None:
        self.primary.deregister(worker_id)

    def workers(self) -> list[WorkerRecord]:
        local = self.local.workers()
        try:
            primary = self.primary.workers()
        except RegistryUnavailable as exc:
            if self.primary_available:
                log.warning("registry unavailable (%s); using the %d locally known workers",
                            exc, len(local))
            self.primary_available = False
            self._settings_due = self._settings is not None
            return local
        if not self.primary_available:
            log.info("registry available again")
            self.primary_available = True
        if self._settings_due:
            self._republish_settings()
        listed = {record.worker_id for record in primary}
        return primary + [record for record in local if record.worker_id not in listed]

    def cluster_settings(self) -> HashSettings | None:
        try:
            return self.primary.cluster_settings()
        except RegistryUnavailable:
            return self.local.cluster_settings()

    def publish_settings(self, settings: HashSettings) -> None:
        """Record the settings locally, then in the primary (which may raise
        ``RegistryUnavailable``; they are published there again after each outage)."""
        self.local.publish_settings(settings)
        self._settings = settings
        self.primary.publish_settings(settings)

    def _republish_settings(self) -> None:
        """The primary may have come back empty (a restarted Redis): publish the settings again
        (retried after each read until it accepts the write)."""
        assert self._settings is not None
        try:
            self.primary.publish_settings(self._settings)
        except RegistryUnavailable:
            return
        except SettingsMismatch as exc:
            log.error("%s; workers with those settings will be refused", exc)
        self._settings_due = False
