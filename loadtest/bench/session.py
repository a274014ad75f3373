"""A benchmark session: every target at every load, for a number of rounds, alternating.

Targets take turns (their order rotates each round) so that slow drift on a noisy machine
spreads over all of them. Every step draws a fresh workload, seeded by (seed, load, round):
targets at the same step see identical requests and arrival times, and no step finds its
prompts already in a server's prefix cache from an earlier step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.bench.arrivals import Load
from loadtest.bench.clients import Client
from loadtest.bench.prompts import PromptMaker
from loadtest.bench.runner import RunResult, run_workload
from loadtest.bench.workloads import BenchRequest, WorkloadSpec, build_workload


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
                      deadline_s: float = 600.0, progress: bool = True) -> list[RunResult]:
    results = []
    built: tuple[tuple[int, int], list[BenchRequest]] | None = None
    for step in schedule(len(clients), len(loads), rounds):
        key = (step.load_index, step.round)
        s = step_seed(seed, *key)
        if built is None or built[0] != key:  # a step's targets are consecutive
            built = (key, build_workload(spec, maker, s).requests)
        label, client = clients[step.target_index]
        results.append(await run_workload(
            client, built[1], loads[step.load_index], label=label, round_=step.round,
            deadline_s=deadline_s, arrival_seed=s, progress=progress))
    return results
