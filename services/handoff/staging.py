"""Where a worker's KV transfers read and write: ``TransferArea``.

Blocks cross the wire in the canonical layout (every KV head, services/handoff/pairing.py).
A one-rank engine's cache is that layout, so transfers use its blocks directly. A
tensor-parallel engine's ranks each hold some of the KV heads, so its transfers go through
staging blocks in the canonical layout (a ``STAGING_FRACTION`` of its blocks, at least one
context): the prefill side gathers a pinned prompt's blocks into them from every rank before
offering the lease; the decode side has the transport write into them and scatters them to
every rank when it commits the import. The engine knows nothing of this: it pins, imports and
commits its own blocks.

Every method runs on the engine thread (``AsyncEngine.call``), between steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tandem.services.engine.device import wait_for_writes
from tandem.services.engine.kv_cache import KVCache, allocate_kv_cache
from tandem.services.engine.llm_engine import LLMEngine

STAGING_FRACTION = 4


class TransferArea:
    """The cache a worker's transport registers (``cache``) and the blocks each transfer uses."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._staged: dict[str, tuple[list[int], list[int]]] = {}  # request: staging, blocks
        self.num_staging = 0
        if engine.tp is None:
            self.cache: KVCache = engine.kv_cache
            self._free: list[int] = []
            return
        spec = engine.kv_spec
        self.num_staging = min(spec.num_blocks,
                               max(engine.block_manager.blocks_needed(engine.max_model_len),
                                   spec.num_blocks // STAGING_FRACTION))
        self.cache = allocate_kv_cache(dataclasses.replace(spec, num_blocks=self.num_staging),
                                       engine.config.device)
        self._free = list(range(self.num_staging - 1, -1, -1))

    @property
    def staged(self) -> bool:
        """Whether transfers go through staging blocks (a tensor-parallel engine)."""
        return self.engine.tp is not None

    @property
    def num_free(self) -> int:
        """Staging blocks free now (0 without staging)."""
        return len(self._free)

    def export(self, request_id: str, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        """The blocks a transfer reads for a pinned prompt (the engine waited for their
        writes): its own, or staging blocks gathered from every rank now; None when too few
        staging blocks are free."""
        if not self.staged:
            return tuple(block_ids)
        staged = self._take(request_id, block_ids)
        if staged is None:
            return None
        assert self.engine.tp is not None
        self.engine.tp.gather(self.engine.kv_cache, list(block_ids), self.cache, staged)
        wait_for_writes(self.engine.config.device)
        return tuple(staged)

    def reserve(self, request_id: str, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        """The blocks a transfer writes for an import's ``block_ids``: themselves, or staging
        blocks held until ``commit`` or ``free``; None when too few staging blocks are free."""
        if not self.staged:
            return tuple(block_ids)
        staged = self._take(request_id, block_ids)
        return None if staged is None else tuple(staged)

    def commit(self, request_id: str) -> None:
        """An import's staging blocks hold its KV: scatter them to every rank's cache."""
        staged, block_ids = self._release(request_id)
        if staged:
            assert self.engine.tp is not None
            self.engine.tp.scatter(self.cache, staged, self.engine.kv_cache, block_ids)

    def free(self, request_id: str) -> None:
        """Give back a request's staging blocks (nothing if it holds none)."""
        self._release(request_id)

    def _take(self, request_id: str, block_ids: Sequence[int]) -> list[int] | None:
        if len(block_ids) > len(self._free):
            return None
        staged = [self._free.pop() for _ in block_ids]
        self._staged[request_id] = (staged, list(block_ids))
        return staged

    def _release(self, request_id: str) -> tuple[list[int], list[int]]:
        staged, block_ids = self._staged.pop(request_id, ([], []))
        self._free.extend(reversed(staged))
        return staged, block_ids
