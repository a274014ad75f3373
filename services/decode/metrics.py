from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Upper bounds (s) of the KV transfer time histogram: shared memory on one host up to a slow
# network between nodes.
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                            5.0, 10.0)


@dataclass
class DecodeMetrics:
    """Counters for export."""

    imports: int = 0  # requests that arrived with a KV handle
    transfers: int = 0  # successful block reads
    bytes_moved: int = 0
    transfer_seconds: float = 0.0
    # Transfers per TRANSFER_SECONDS_BUCKETS bucket (not cumulative); the last one is +Inf.
    transfer_seconds_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1))
    blocks_pulled: int = 0
    blocks_reused: int = 0  # leading blocks already in this worker's prefix cache
    transfer_failures: int = 0  # read errors, timeouts, checksum mismatches, lost leases
    checksum_failures: int = 0
    recomputes: int = 0
    queued: int = 0  # imports with no room for the KV now, queued to prefill here instead
    rejects: Counter[str] = field(default_factory=Counter)  # by reason
    # Refused as unauthenticated or not meant for this worker: an unsigned pairing reply, a KV
    # handle that is unsigned or names another reader (the prompt is recomputed here).
    refusals: int = 0

    def observe_transfer(self, seconds: float) -> None:
        self.transfer_seconds += seconds
        self.transfer_seconds_buckets[bisect_left(TRANSFER_SECONDS_BUCKETS, seconds)] += 1

    def snapshot(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rejects"] = dict(self.rejects)
        return data
