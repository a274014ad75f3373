"""Leases on pinned KV blocks: released by the decode worker, rejected, or expired."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(frozen=True)
class Lease:
    lease_id: str  # 128 random bits: the reader holding it may read block_ids (no more)
    request_id: str
    expires_at: float  # on the table's clock
    block_ids: frozenset[int] = frozenset()
    reader: str | None = None  # the decode worker it was offered to; None: any

    def for_reader(self, reader: str | None) -> bool:
        return self.reader is None or self.reader == reader


class LeaseTable:
    def __init__(self, ttl_s: float, clock: Clock = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, request_id: str, block_ids: Iterable[int] = (),
              reader: str | None = None) -> Lease:
        lease = Lease(secrets.token_hex(16), request_id, self.clock() + self.ttl_s,
                      frozenset(block_ids), reader)
        self._leases[lease.lease_id] = lease
        return lease

    def covers(self, lease_id: str, block_ids: Sequence[int], reader: str) -> bool:
        """Whether a live lease ``lease_id`` offered to ``reader`` holds every one of
        ``block_ids`` (the KV transport's ``reads_allowed``: one dict lookup)."""
        lease = self._leases.get(lease_id)
        return (lease is not None and lease.expires_at > self.clock()
                and lease.for_reader(reader) and lease.block_ids.issuperset(block_ids))

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def take(self, lease_id: str) -> Lease | None:
        """End a lease (release or reject); None if it already ended or never existed."""
        return self._leases.pop(lease_id, None)

    def take_expired(self) -> list[Lease]:
        now = self.clock()
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.lease_id]
        return expired
