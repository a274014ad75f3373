"""How the gateway turns options into a request: the server-chosen seed of a sampled request."""

from __future__ import annotations

from tandem.services.gateway.core import SamplingOptions, build_request


def test_a_sampled_request_gets_a_seed_and_a_greedy_one_none() -> None:
    sampled = [build_request(f"r{i}", [1, 2, 3], SamplingOptions(max_tokens=4), 64)
               for i in range(2)]
    seeds = [r.params.seed for r in sampled]
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]
    chosen = build_request("c", [1, 2, 3], SamplingOptions(max_tokens=4, seed=7), 64)
    assert chosen.params.seed == 7  # the client's stays
    greedy = build_request("g", [1, 2, 3], SamplingOptions(max_tokens=4, temperature=0.0), 64)
    assert greedy.params.seed is None
