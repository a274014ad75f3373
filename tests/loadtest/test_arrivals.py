"""Arrival processes and the session's alternating schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.loadtest.bench.arrivals import Load, arrival_offsets, parse_concurrency, parse_rate
from tandem.loadtest.bench.session import Step, schedule, step_seed


def gaps(load: Load, n: int = 40001, seed: int = 0) -> np.ndarray:
    return np.diff(arrival_offsets(n, load, np.random.default_rng(seed)))


def test_poisson_arrivals_have_the_rate_and_unit_cv() -> None:
    g = gaps(Load("rate", 50.0))
    assert g.mean() == pytest.approx(1 / 50, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)


def test_gamma_burstiness_keeps_the_rate_and_raises_the_cv() -> None:
    g = gaps(Load("rate", 50.0, burstiness=0.25))
    assert g.mean() == pytest.approx(1 / 50, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(2.0, rel=0.08)  # CV = 1/sqrt(shape)


def test_arrivals_are_deterministic_and_start_at_zero() -> None:
    a = arrival_offsets(10, Load("rate", 4.0), np.random.default_rng(3))
    assert a == arrival_offsets(10, Load("rate", 4.0), np.random.default_rng(3))
    assert a[0] == 0.0 and a == sorted(a)
    assert arrival_offsets(3, Load("rate", math.inf), np.random.default_rng(0)) == [0.0] * 3


@pytest.mark.parametrize("text", ["0", "-1", "nan", "fast"])
def test_bad_rates_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


def test_bad_loads_are_rejected() -> None:
    assert parse_rate("inf") == math.inf
    with pytest.raises(ValueError, match="request rate must be > 0"):
        Load("rate", 0.0)
    with pytest.raises(ValueError, match="concurrency"):
        Load("concurrency", 0)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        parse_concurrency("0")
    with pytest.raises(ValueError, match="burstiness"):
        Load("rate", 1.0, burstiness=0.0)


def test_targets_alternate_and_rotate_each_round() -> None:
    steps = schedule(num_targets=2, num_loads=2, rounds=2)
    assert steps == [Step(0, 0, 0), Step(0, 0, 1), Step(0, 1, 1), Step(0, 1, 0),
                     Step(1, 0, 0), Step(1, 0, 1), Step(1, 1, 1), Step(1, 1, 0)]
    seeds = {step_seed(0, s.load_index, s.round) for s in steps}
    assert len(seeds) == 4  # one workload per (load, round), shared by the targets
