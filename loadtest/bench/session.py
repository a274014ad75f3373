"""A benchmark session: every target at every load, for a number of rounds, alternating.

Targets take turns (their order rotates each round) so that slow drift on a noisy machine
spreads over all of them. Every step draws a fresh workload, seeded by (seed, load, round):
targets at the same step see identical requests and arrival times, and no step finds its
prompts already in a server's prefix cache from an earlier step.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.loadtest.bench.arrivals import Load
from tandem.loadtest.bench.clients import Client
from tandem.loadtest.bench.prompts import PromptMaker
from tandem.loadtest.bench.runner import RunResult, run_workload
from tandem.loadtest.bench.server_metrics import CacheProbe, RoleCounters, difference
from tandem.loadtest.bench.workloads import BenchRequest, WorkloadSpec, build_workload


@dataclass(frozen=True)
class Step:
    load_index: int
    round: int
    target_index: int


def schedule(num_targets: int, num_loads: int, rounds: int) -> list[Step]:
    steps = []
    for load_index in range(num_loads):
        for round_ in range(rounds):
            for k in range(num_targets):
                steps.append(Step(load_index, round_, (k + round_) % num_targets))
    return steps


def step_seed(seed: int, load_index: int, round_: int) -> int:
    return int(np.random.SeedSequence([seed, load_index, round_]).generate_state(1)[0])


async def run_session(clients: Sequence[tuple[str, Client]], loads: Sequence[Load],
                      spec: WorkloadSpec, maker: PromptMaker, *, seed: int, rounds: int = 1,
                      deadline_s: float = 600.0, progress: bool = True,
                      cache_probe: CacheProbe | None = None) -> list[RunResult]:
    """Every target at every load and round, in ``schedule`` order.

    With ``cache_probe``, a target's prefix-cache counters are read before each of its runs and
    once after the last: a run's counters are the difference between the read before it and
    the next read of the same target, which comes after the other targets' runs, so late
    updates of a disaggregated gateway's counters are still credited to the right run."""
    results = []
    built: tuple[tuple[int, int], list[BenchRequest]] | None = None
    steps = schedule(len(clients), len(loads), rounds)
    unsettled: dict[str, tuple[RunResult, RoleCounters]] = {}  # label -> (last run, before)

    async def settle(label: str) -> RoleCounters:
        assert cache_probe is not None
        now = await cache_probe.settled(label)
        if label in unsettled:
            run, before = unsettled.pop(label)
            run.server_cache = difference(now, before)
        return now

    for number, step in enumerate(steps, 1):
        key = (step.load_index, step.round)
        s = step_seed(seed, *key)
        if built is None or built[0] != key:  # a step's targets are consecutive
            built = (key, build_workload(spec, maker, s).requests)
        label, client = clients[step.target_index]
        before = None if cache_probe is None else await settle(label)
        result = await run_workload(
            client, built[1], loads[step.load_index], label=label, round_=step.round,
            deadline_s=deadline_s, arrival_seed=s, progress=progress)
        if before is not None:
            unsettled[label] = (result, before)
        results.append(result)
        ok = sum(1 for r in result.records if r.ok)
        print(f"[run {number}/{len(steps)}] {label} @ {result.load.label}, round {step.round}: "
              f"{ok}/{len(built[1])} ok in {result.duration_s:.1f} s", file=sys.stderr,
              flush=True)
    for label in list(unsettled):
        await settle(label)
    return results
