from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodeMetrics:
    """Counters for export."""

    imports: int = 0  # requests that arrived with a KV handle
    transfers: int = 0  # successful block reads
    bytes_moved: int = 0
    transfer_seconds: float = 0.0
    blocks_pulled: int = 0
    blocks_reused: int = 0  # leading blocks already in this worker's prefix cache
    transfer_failures: int = 0  # read errors, timeouts, checksum mismatches, lost leases
    checksum_failures: int = 0
    recomputes: int = 0
    rejects: Counter[str] = field(default_factory=Counter)  # by reason

    def snapshot(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rejects"] = dict(self.rejects)
        return data
