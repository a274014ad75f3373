"""Round-robin choice: the baseline that prefix-aware routing is measured against."""

from __future__ import annotations

from collections.abc import Sequence


class RoundRobin:
    """Hands out workers in turn, blind to caches and load. The turn counts decisions, and
    indexes the worker list of the moment: a worker joining or leaving shifts the order but
    never stalls it."""

    def __init__(self) -> None:
        self._turn = 0

    def next(self, workers: Sequence[str]) -> str:
        if not workers:
            raise ValueError("round robin over no workers")
        chosen = workers[self._turn % len(workers)]
        self._turn += 1
        return chosen
