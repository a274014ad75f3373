"""Helpers for disaggregation tests: worker pairs in this process or in child processes."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

from tandem.loadtest.rpc_workers.process import WorkerProcess, WorkerSpec, spawn_workers
from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.handoff.decode import DecodeConfig, DecodeResult, DecodeWorker
from tandem.services.handoff.prefill import Clock, PrefillConfig, PrefillWorker
from tandem.services.kv_transfer.factory import make_transport
from tandem.services.protocol.handoff import ClusterKey, PrefillResult
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.conftest import MAX_NEW_TOKENS
from tests.hf_reference import Comparison, Reference, compare

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
TRANSPORTS = ("nixl", "tcp")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Prefill(Protocol):
    async def prefill(self, request: GenerationRequest, reader: str | None = None
                      ) -> PrefillResult: ...

    async def status(self) -> dict[str, Any]: ...


class Decode(Protocol):
    async def generate(self, request: GenerationRequest) -> DecodeResult: ...

    async def status(self) -> dict[str, Any]: ...


async def run_request(prefill: Prefill, decode: Decode, request_id: str, prompt: list[int],
                      params: SamplingParams = GREEDY, reader: str = "d0") -> DecodeResult:
    """What the gateway does: first token from P (its lease offered to the decode worker
    ``reader``), the rest from D."""
    first = await prefill.prefill(GenerationRequest(request_id, prompt, params), reader=reader)
    assert not first.finished, "the test prompts never end at their first token"
    return await decode.generate(GenerationRequest(request_id, prompt, params, prefill=first))


async def free_blocks(worker: Prefill | Decode) -> int:
    return int((await worker.status())["engine"]["num_free_blocks"])


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Poll ``check`` until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.05)


def compare_prefix(got: list[int], ref: Reference, label: str) -> Comparison:
    """Compare a short output with the first tokens of a reference."""
    n = len(got)
    return compare(got, Reference(ref.tokens[:n], ref.gaps[:n]), label)


def local_engine(model: LoadedModel, **overrides: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"num_kv_blocks": 160, **overrides}), model)


@asynccontextmanager
async def local_pair(model: LoadedModel, transport: str, *,
                     prefill: PrefillConfig | None = None, decode: DecodeConfig | None = None,
                     prefill_engine: dict[str, Any] | None = None,
                     decode_engine: dict[str, Any] | None = None,
                     clock: Clock = time.monotonic, pair: bool = True
                     ) -> AsyncIterator[tuple[PrefillWorker, DecodeWorker]]:
    """A prefill and a decode worker as plain objects in this process, on a real transport."""
    p = PrefillWorker(local_engine(model, **(prefill_engine or {})),
                      make_transport(transport, "p0"),
                      prefill or PrefillConfig(checksums=True), "p0", clock)
    d = DecodeWorker(local_engine(model, **(decode_engine or {})),
                     make_transport(transport, "d0"),
                     decode or DecodeConfig(verify_checksums=True), "d0")
    await p.start()
    await d.start()
    try:
        if pair:
            await d.pair(p)
        yield p, d
    finally:
        await d.close()
        await p.close()


# -- child processes ----------------------------------------------------------------------

WORKER_ENGINE = {"num_kv_blocks": 512, "num_threads": 1}


def worker_spec(worker_id: str, transport: str, role_config: dict[str, Any],
                secret_file: Path | None = None) -> WorkerSpec:
    return WorkerSpec(worker_id=worker_id, engine=dict(WORKER_ENGINE), role=role_config,
                      transport=transport,
                      cluster_secret_file=None if secret_file is None else str(secret_file))


def write_secret(directory: Path) -> tuple[Path, ClusterKey]:
    """A new cluster secret in a private file, and its key."""
    path = directory / "cluster-secret"
    path.touch(mode=0o600)
    path.write_text(secrets.token_urlsafe(36))
    return path, ClusterKey.from_file(path)


def spawn(log_dir: Path, *workers: tuple[str, WorkerSpec]) -> list[WorkerProcess]:
    """Start worker processes together; each logs to ``log_dir/<worker id>.log``."""
    return spawn_workers([(role, spec, log_dir / f"{spec.worker_id}.log")
                          for role, spec in workers])
