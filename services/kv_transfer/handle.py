"""The ticket a prefill worker hands out for a prompt's pinned KV blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVHandle:
    """Which blocks to pull from which prefill worker, under which lease."""

    worker_id: str  # the prefill worker holding the blocks
    lease_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks in order; the last may be partly filled
    num_tokens: int  # prompt tokens whose KV the blocks hold
    checksums: tuple[int, ...] | None = None  # CRC32 per block (debug mode)

    def to_dict(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "lease_id": self.lease_id,
                "block_ids": list(self.block_ids), "num_tokens": self.num_tokens,
                "checksums": None if self.checksums is None else list(self.checksums)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVHandle:
        worker_id, lease_id = data.get("worker_id"), data.get("lease_id")
        block_ids, num_tokens = data.get("block_ids"), data.get("num_tokens")
        checksums = data.get("checksums")
        if not (isinstance(worker_id, str) and isinstance(lease_id, str)
                and _ints(block_ids) and type(num_tokens) is int and num_tokens > 0
                and (checksums is None or (_ints(checksums)
                                           and len(checksums) == len(block_ids)))):
            raise ValueError(f"malformed KV handle: {data!r}")
        return cls(worker_id, lease_id, tuple(block_ids), num_tokens,
                   None if checksums is None else tuple(checksums))


def _ints(values: object) -> bool:
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)
