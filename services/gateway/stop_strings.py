"""Stop strings over streamed text: emit what cannot be the start of a stop, hold the rest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StopResult:
    text: str  # safe to emit now
    stopped: bool  # a stop string was found; ``text`` ends right before it


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""  # text not emitted yet: a possible start of a stop string
        self.stopped = False

    def feed(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        if not self._stops:
            return StopResult(text, False)
        pending = self._pending + text
        # Anything emitted earlier could not start a match, so every match lies in ``pending``.
        hits = [i for i in (pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return StopResult(pending[:min(hits)], True)
        hold = max(self._partial_match(pending, s) for s in self._stops)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return StopResult(pending[:len(pending) - hold], False)

    def flush(self) -> str:
        """The held-back text, once generation ended without a stop string."""
        text, self._pending = ("" if self.stopped else self._pending), ""
        return text

    @staticmethod
    def _partial_match(text: str, stop: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
        for k in range(min(len(text), len(stop) - 1), 0, -1):
            if text.endswith(stop[:k]):
                return k
        return 0
