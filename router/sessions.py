"""Session affinity: a client's named session (OpenAI's ``prompt_cache_key``, vLLM's
``session_id``), scoped by its tenant, stays on the decode worker that served its last turn.

That worker holds the session's whole context in its KV cache (the last prompt and the reply
it generated), which the next turn's prompt starts with. The router keeps the session there
while the worker is live and its decode load is within ``slack`` of the least-loaded worker's;
otherwise the session moves to the router's usual choice (and stays there). Sessions idle for
``ttl_s`` are forgotten, and at most ``max_sessions`` are kept (the least recently used go).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping

SessionKey = tuple[str, str]  # (tenant, the client's session name)

KEPT, MOVED, NEW = "kept", "moved", "new"  # what became of a session's decode worker


class Sessions:
    def __init__(self, ttl_s: float, max_sessions: int, slack: float) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.slack = slack
        self._workers: OrderedDict[SessionKey, tuple[str, float]] = OrderedDict()
        self.routes: Counter[str] = Counter()  # decisions per outcome

    def choose(self, key: SessionKey, scores: Mapping[str, float], usual: str, now: float
               ) -> str:
        """The decode worker for the session's next request: its last one if that is among
        the live ``scores`` (decode load) and within ``slack`` of the lowest, else ``usual``;
        remembered for the next turn."""
        last = self._workers.pop(key, None)
        worker = last[0] if last is not None and now - last[1] <= self.ttl_s else None
        if worker is not None and worker in scores and (
                scores[worker] <= min(scores.values()) + self.slack):
            outcome = KEPT
        else:
            outcome, worker = (NEW if worker is None else MOVED), usual
        self.routes[outcome] += 1
        self._workers[key] = (worker, now)
        # Least recently used first: drop the idle and any beyond the bound.
        while len(self._workers) > self.max_sessions or (
                now - next(iter(self._workers.values()))[1] > self.ttl_s):
            self._workers.popitem(last=False)
        return worker

    def __len__(self) -> int:
        return len(self._workers)
