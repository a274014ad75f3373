"""Session affinity (router/sessions.py): a tenant's named session keeps its decode worker
while that worker is live and not loaded beyond the slack, with the in-process bus and
registry and real worker event forwarders."""

from __future__ import annotations

from tandem.router import InProcessEventBus, InProcessRegistry, Router, RouterConfig, WorkerLoad

from .cluster import SETTINGS, FakeClock, start_worker, tokens

DECODE = ("d0", "d1", "d2", "d3")


class Setup:
    def __init__(self, **options: object) -> None:
        self.clock = FakeClock()
        self.registry = InProcessRegistry(SETTINGS, ttl_s=30.0, clock=self.clock)
        self.bus = InProcessEventBus()
        self.workers = {w: start_worker(self.registry, self.bus, w, "decode") for w in DECODE}
        start_worker(self.registry, self.bus, "p0")
        config = RouterConfig(SETTINGS, **options)  # type: ignore[arg-type]
        self.router = Router(config, self.registry, self.bus, clock=self.clock)
        self.router.sync()

    def turn(self, session: tuple[str, str] | None, seed: int) -> str:
        decision = self.router.route(tokens(seed, 64), session=session)
        self.router.release(decision.request_id)
        assert decision.decode_worker is not None
        return decision.decode_worker


def test_a_session_keeps_its_decode_worker_where_load_alone_spreads() -> None:
    s = Setup()
    alone = {s.turn(None, seed) for seed in range(20)}
    assert len(alone) > 1  # equal loads: power of two choices spreads the requests
    first = s.turn(("acme", "chat-1"), 100)
    assert [s.turn(("acme", "chat-1"), 101 + i) for i in range(10)] == [first] * 10
    # The same name under another tenant is another session.
    s.turn(("globex", "chat-1"), 200)
    status = s.router.status()
    assert status.session_routes == {"new": 2, "kept": 10}
    assert status.sessions == 2


def test_a_session_moves_off_a_worker_loaded_beyond_the_slack_and_stays_moved() -> None:
    s = Setup(session_slack=0.25)
    session = ("acme", "agent")
    first = s.turn(session, 1)
    # Within the slack it stays...
    s.workers[first].heartbeat(WorkerLoad(kv_usage=0.2))
    s.router.sync()
    assert s.turn(session, 2) == first
    # ...beyond it the session goes where the load is lower, and stays there.
    s.workers[first].heartbeat(WorkerLoad(kv_usage=0.9, running_sequences=30))
    s.router.sync()
    moved = s.turn(session, 3)
    assert moved != first
    assert s.turn(session, 4) == moved
    assert s.router.status().session_routes == {"new": 1, "kept": 2, "moved": 1}


def test_a_session_whose_worker_is_gone_moves_on() -> None:
    s = Setup()
    session = ("acme", "agent")
    first = s.turn(session, 1)
    s.router.mark_down(first, "replica_gone")
    moved = s.turn(session, 2)
    assert moved != first and moved in DECODE
    assert s.router.status().session_routes == {"new": 1, "moved": 1}


def test_idle_sessions_are_forgotten_after_the_ttl_and_the_count_is_bounded() -> None:
    s = Setup(session_ttl_s=60.0, max_sessions=3)
    for i in range(5):
        s.turn(("acme", f"s{i}"), i)
    assert s.router.status().sessions == 3  # the two least recently used went
    s.clock.advance(61.0)
    for worker in s.workers.values():  # still live
        worker.heartbeat()
    s.router.sync()
    s.turn(("acme", "s4"), 9)  # idle past the TTL: a new session
    status = s.router.status()
    assert status.session_routes == {"new": 6}
    assert status.sessions == 1  # the idle ones are gone too
