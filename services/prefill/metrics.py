from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PrefillMetrics:
    """Counters for export; every lease ends released, rejected or expired."""

    prefills: int = 0
    leases_granted: int = 0
    leases_released: int = 0
    leases_rejected: int = 0
    leases_expired: int = 0
    # Prefills that ended without a lease: tensor parallelism, every staging block held
    # (the decode worker recomputes the prompt)
    unstaged: int = 0
    late_messages: int = 0  # release/reject for a lease that had already ended
    # Refused as unauthenticated or not meant for the sender: an unsigned pairing, a release by
    # a worker the lease was not offered to (the KV transport counts its own refusals).
    refusals: int = 0
    reject_reasons: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["reject_reasons"] = dict(self.reject_reasons)
        return data
