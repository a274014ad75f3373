"""What every proposer offers the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.services.engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[int]  # at most the k asked for; may be empty


class Proposer(Protocol):
    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        """Draft up to k tokens after each sequence's last token; keyed by request id."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop whatever is kept for it."""
        ...

    def num_free_blocks(self) -> int | None:
        """Free blocks of the proposer's own KV cache (None: it has none); for leak checks."""
        ...
