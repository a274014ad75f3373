"""Leases on pinned KV blocks: released by the decode worker, rejected, or expired."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(frozen=True)
class Lease:
    lease_id: str
    request_id: str
    expires_at: float  # on the table's clock


class LeaseTable:
    def __init__(self, ttl_s: float, clock: Clock = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, request_id: str) -> Lease:
        lease = Lease(uuid.uuid4().hex, request_id, self.clock() + self.ttl_s)
        self._leases[lease.lease_id] = lease
        return lease

    def take(self, lease_id: str) -> Lease | None:
        """End a lease (release or reject); None if it already ended or never existed."""
        return self._leases.pop(lease_id, None)

    def take_expired(self) -> list[Lease]:
        now = self.clock()
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.lease_id]
        return expired
