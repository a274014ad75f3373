"""Smoke test of the benchmark: it runs on a small trace and its numbers are sane."""

from __future__ import annotations

from tandem.loadtest.router_sim import SimParams, make_trace, simulate


def test_simulation_runs_and_prefix_aware_beats_round_robin() -> None:
    params = SimParams(tenants=10, requests=400, cache_blocks=512, load=0.4)
    trace = make_trace(params, 4)
    results = {name: simulate(name, trace, 4, params)
               for name in ("prefix-aware", "round-robin", "oracle")}
    for result in results.values():
        assert 0.0 <= result.hit_rate <= 1.0
        assert result.imbalance >= 1.0
    assert results["prefix-aware"].hit_rate > results["round-robin"].hit_rate
    assert results["prefix-aware"].hit_rate >= 0.8 * results["oracle"].hit_rate
