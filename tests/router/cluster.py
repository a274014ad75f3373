"""Test helpers: workers made of the real event forwarder and registry membership.

The test itself plays the engine: it hands the forwarder the events a block manager would emit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.router import (
    EventBus,
    WorkerEventForwarder,
    WorkerInfo,
    WorkerLoad,
    WorkerMembership,
    WorkerRegistry,
    attach_worker,
)
from tandem.services.protocol.block_hash import HashSettings, hash_token_blocks
from tandem.services.protocol.kv_events import BlockRemoved, BlockStored

SETTINGS = HashSettings(block_size=16, model_id="smollm2-135m")


def make_info(worker_id: str, role: str = "prefill", settings: HashSettings = SETTINGS,
              capacity_blocks: int = 4096) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        address=f"{worker_id}.test:7000",
        block_size=settings.block_size,
        model_id=settings.model_id,
        capacity_blocks=capacity_blocks,
        hash_scheme=settings.scheme,
    )


@dataclass
class WorkerHarness:
    info: WorkerInfo
    forwarder: WorkerEventForwarder
    membership: WorkerMembership
    settings: HashSettings = SETTINGS

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def cache(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Emit BlockStored for the prompt's full blocks, as a block manager would."""
        hashes = hash_token_blocks(token_ids, self.settings.block_size,
                                   self.settings.extra_keys(cache_salt))
        self.forwarder.publish([BlockStored(tuple(hashes), None, self.settings.block_size)])
        return hashes

    def evict(self, hashes: Sequence[bytes]) -> None:
        self.forwarder.publish([BlockRemoved(tuple(hashes))])

    def heartbeat(self, load: WorkerLoad | None = None) -> bool:
        return self.membership.heartbeat(load or WorkerLoad())


def start_worker(registry: WorkerRegistry, bus: EventBus, worker_id: str, role: str = "prefill",
                 load: WorkerLoad | None = None) -> WorkerHarness:
    info = make_info(worker_id, role)
    forwarder = attach_worker(bus, worker_id)
    membership = WorkerMembership(registry, info, forwarder)
    membership.join(load or WorkerLoad())
    return WorkerHarness(info, forwarder, membership)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
