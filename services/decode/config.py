from __future__ import annotations

from dataclasses import dataclass

ON_FAILURE = ("recompute", "fail")


@dataclass(frozen=True)
class DecodeConfig:
    # A failed or timed-out transfer: prefill the prompt here ("recompute") or fail the
    # request with KVTransferFailedError ("fail").
    on_transfer_failure: str = "recompute"
    transfer_timeout_s: float = 10.0
    control_timeout_s: float = 5.0  # release/reject calls to the prefill worker
    verify_checksums: bool = False  # debug: check pulled blocks against the sender's CRC32s

    def __post_init__(self) -> None:
        if self.on_transfer_failure not in ON_FAILURE:
            raise ValueError(f"on_transfer_failure must be one of {ON_FAILURE}, "
                             f"got {self.on_transfer_failure!r}")
        for name in ("transfer_timeout_s", "control_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
