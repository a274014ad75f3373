from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillConfig:
    lease_ttl_s: float = 30.0  # pinned blocks are freed this long after the first token
    reap_interval_s: float | None = None  # how often expiry is checked; None: ttl/4, <= 1 s
    checksums: bool = False  # debug: send a CRC32 per block for the decode worker to verify

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.reap_interval_s is not None and self.reap_interval_s <= 0:
            raise ValueError(f"reap_interval_s must be > 0, got {self.reap_interval_s}")

    @property
    def reap_every_s(self) -> float:
        return self.reap_interval_s or min(1.0, self.lease_ttl_s / 4)
