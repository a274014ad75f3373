"""The round_robin routing policy against the prefix policy, with the in-process bus and
registry (the single-process gateway's) and real worker event forwarders."""

from __future__ import annotations

import pytest

from tandem.router import InProcessEventBus, InProcessRegistry, Router, RouterConfig, WorkerLoad

from .cluster import SETTINGS, FakeClock, WorkerHarness, start_worker, tokens


class Setup:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.registry = InProcessRegistry(SETTINGS, ttl_s=30.0, clock=self.clock)
        self.bus = InProcessEventBus()

    def router(self, policy: str, **options: object) -> Router:
        config = RouterConfig(SETTINGS, policy=policy, **options)  # type: ignore[arg-type]
        return Router(config, self.registry, self.bus, clock=self.clock)

    def worker(self, worker_id: str, role: str = "prefill",
               load: WorkerLoad | None = None) -> WorkerHarness:
        return start_worker(self.registry, self.bus, worker_id, role, load)


def test_round_robin_cycles_prefill_workers_ignoring_cache_and_load() -> None:
    s = Setup()
    p0 = s.worker("p0", load=WorkerLoad(pending_prefill_blocks=500))  # busy
    s.worker("p1")
    p2 = s.worker("p2")
    s.worker("d0", "decode")
    prompt = tokens(1, 16 * 40)
    p2.cache(prompt)  # every block of the prompt on p2
    p0.cache(prompt[:16 * 20])
    prefix_router, rr_router = s.router("prefix"), s.router("round_robin")
    for router in (prefix_router, rr_router):
        router.sync()

    # The prefix policy would send every repeat to p2 (the setup does attract).
    assert {prefix_router.route(prompt).prefill_worker for _ in range(3)} == {"p2"}

    decisions = [rr_router.route(prompt) for _ in range(7)]
    assert [d.prefill_worker for d in decisions] == ["p0", "p1", "p2", "p0", "p1", "p2", "p0"]
    assert {d.reason for d in decisions} == {"round_robin"}
    assert {d.cached_blocks for d in decisions} == {0}
    assert {d.decode_worker for d in decisions} == {"d0"}
    assert all(d.prefill_scores == {} for d in decisions)
    assert rr_router.status().decisions == 7


def test_round_robin_never_skips_prefill_for_a_prompt_cached_on_decode() -> None:
    s = Setup()
    s.worker("p0")
    d0 = s.worker("d0", "decode")
    prompt = tokens(2, 16 * 8)
    d0.cache(prompt)
    prefix_router, rr_router = s.router("prefix"), s.router("round_robin")
    for router in (prefix_router, rr_router):
        router.sync()
    assert prefix_router.route(prompt).detail == "cached_on_decode"
    decision = rr_router.route(prompt)
    assert (decision.prefill_worker, decision.decode_worker) == ("p0", "d0")


def test_a_next_turn_mostly_cached_on_decode_is_prefilled_there_within_the_bound() -> None:
    """A session's next turn: the last prompt and reply cached on its decode worker, a new
    message after them. Up to max_local_prefill_tokens uncached it skips the prefill worker;
    beyond (or with the default 0) it is prefilled on P; nothing cached on D is never local."""
    s = Setup()
    s.worker("p0")
    d0, d1 = s.worker("d0", "decode"), s.worker("d1", "decode")
    earlier = tokens(3, 16 * 8)  # the last turn, as the decode worker holds it
    d0.cache(earlier)
    turn = earlier + tokens(4, 16 * 4 + 5)  # 4 new full blocks and a partial one
    d1.cache(tokens(5, 16 * 8))  # another conversation entirely
    routers = {bound: s.router("prefix", max_local_prefill_tokens=bound)
               for bound in (0, 63, 64, 1000)}
    for router in routers.values():
        router.sync()
    local = {bound: router.route(turn) for bound, router in routers.items()}
    assert {b: d.prefill_worker for b, d in local.items()} == {
        0: "p0", 63: "p0", 64: None, 1000: None}
    for bound in (64, 1000):
        assert (local[bound].decode_worker, local[bound].detail) == ("d0", "cached_on_decode")
        assert local[bound].cached_blocks == 8
    fresh = tokens(6, 16 * 3)  # cached nowhere: to P, however large the bound
    assert routers[1000].route(fresh).prefill_worker == "p0"


def test_round_robin_picks_the_less_loaded_decode_worker() -> None:
    s = Setup()
    s.worker("p0")
    s.worker("p1")
    s.worker("d-busy", "decode", WorkerLoad(kv_usage=0.9, running_sequences=20))
    s.worker("d-idle", "decode")
    router = s.router("round_robin")
    router.sync()
    decisions = [router.route(tokens(10 + i, 64)) for i in range(6)]
    for decision in decisions:
        router.release(decision.request_id)
    # Each assignment adds in-flight load to d-idle, but 6 short prompts stay far below d-busy.
    assert {d.decode_worker for d in decisions} == {"d-idle"}
    assert decisions[0].decode_scores["d-busy"] > decisions[0].decode_scores["d-idle"]


def test_round_robin_goes_on_over_the_workers_left_after_one_leaves() -> None:
    s = Setup()
    workers = [s.worker(f"p{i}") for i in range(3)]
    s.worker("d0", "decode")
    router = s.router("round_robin")
    router.sync()
    first = [router.route(tokens(20 + i, 32)).prefill_worker for i in range(3)]
    workers[1].membership.leave()
    router.sync()
    after = [router.route(tokens(30 + i, 32)).prefill_worker for i in range(4)]
    assert first == ["p0", "p1", "p2"]
    assert "p1" not in after
    assert after.count("p0") == after.count("p2") == 2


def test_round_robin_without_prefill_workers_sends_the_prompt_to_decode() -> None:
    s = Setup()
    s.worker("d0", "decode")
    router = s.router("round_robin")
    router.sync()
    decision = router.route(tokens(3, 48))
    assert (decision.prefill_worker, decision.decode_worker) == (None, "d0")
    assert (decision.reason, decision.detail) == ("skip_prefill", "no_prefill_workers")


def test_unknown_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="prefix, round_robin.*'random'"):
        RouterConfig(SETTINGS, policy="random")


def test_prefix_blocks_count_what_prefix_routing_could_reach_under_either_policy() -> None:
    s = Setup()
    p0 = s.worker("p0")
    s.worker("p1")
    s.worker("d0", "decode")
    prompt = tokens(3, 16 * 10)  # 10 full blocks
    p0.cache(prompt[:16 * 6])  # 6 leading blocks on p0 only
    prefix_router, rr_router = s.router("prefix"), s.router("round_robin")
    for router in (prefix_router, rr_router):
        router.sync()

    rr = [rr_router.route(prompt).prefill_worker for _ in range(2)]
    assert rr == ["p0", "p1"]
    # Both prompts could have found 6 blocks (on p0); only the one sent to p0 did.
    assert rr_router.status().prefix_blocks == {"prompt": 20, "any": 12, "chosen": 6}

    assert prefix_router.route(prompt).prefill_worker == "p0"
    assert prefix_router.status().prefix_blocks == {"prompt": 10, "any": 6, "chosen": 6}


def test_prefix_blocks_skip_prompts_that_no_prefill_worker_computes() -> None:
    s = Setup()
    s.worker("p0")
    s.worker("d0", "decode")
    router = s.router("round_robin", short_prompt_tokens=32)
    router.sync()
    assert router.route(tokens(4, 20)).prefill_worker is None  # short: decode computes it
    assert router.status().prefix_blocks == {}
