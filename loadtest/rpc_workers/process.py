"""Running a worker in its own process, and starting one from a test or benchmark.

The child prints one ``TANDEM-READY {json}`` line (with its control port) once it serves;
the parent waits for that line in the child's log file, with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tandem.loadtest.rpc_workers.rpc import Handler, RpcServer
from tandem.services import tracing
from tandem.services.engine.config import EngineConfig
from tandem.services.engine.kv_cache import kv_storage
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.handoff.staging import TransferArea
from tandem.services.kv_transfer.factory import make_transport
from tandem.services.kv_transfer.transport import KVTransport, TransferFaults
from tandem.services.protocol.handoff import ClusterKey

READY = "TANDEM-READY"


@dataclass
class WorkerSpec:
    """Everything a worker process needs, as one JSON argument."""

    worker_id: str
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    role: dict[str, Any] = field(default_factory=dict)  # PrefillConfig / DecodeConfig fields
    transport: str = "auto"
    faults: dict[str, Any] = field(default_factory=dict)  # TransferFaults fields (debug)
    host: str = "127.0.0.1"
    port: int = 0  # control channel; 0 picks a free port
    # The cluster secret (services/protocol/handoff.py): the control channel and KV reads prove
    # it. None: both unauthenticated (tests of that only).
    cluster_secret_file: str | None = None

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("the worker spec must be a JSON object")
        return cls(**data)


class Worker(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...


W = TypeVar("W", bound=Worker)
Build = Callable[[LLMEngine, KVTransport, WorkerSpec, TransferArea], W]


def worker_main(argv: list[str] | None, usage: str,
                build: Build[W],
                handlers: Callable[[W], Mapping[str, Handler]]) -> int:
    """Entry point of a worker process (``python -m tandem.loadtest.rpc_workers.<role>
    '<WorkerSpec JSON>'``)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(usage, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(run_worker(WorkerSpec.from_json(args[0]), build, handlers))
    return 0


async def run_worker(spec: WorkerSpec, build: Build[W],
                     handlers: Callable[[W], Mapping[str, Handler]]) -> None:
    key = (ClusterKey.from_file(spec.cluster_secret_file) if spec.cluster_secret_file
           else None)
    engine = LLMEngine(EngineConfig(**spec.engine))
    area = TransferArea(engine)
    transport = make_transport(spec.transport, spec.worker_id, TransferFaults(**spec.faults),
                               spec.host, engine.config.device, key, kv_storage(area.cache))
    worker = build(engine, transport, spec, area)
    tracing.configure(str(getattr(worker, "role", "worker")))
    await worker.start()
    try:
        await serve_until_signalled(RpcServer(handlers(worker), spec.host, spec.port, key),
                                    {"worker_id": spec.worker_id, "transport": transport.kind})
    finally:
        await worker.close()
        tracing.flush()


async def serve_until_signalled(server: RpcServer, ready_info: dict[str, Any]) -> None:
    """Serve until SIGTERM or SIGINT; announce readiness with the bound port."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    print(f"{READY} {json.dumps({**ready_info, 'port': server.port})}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()


@dataclass
class WorkerProcess:
    role: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def kill(self) -> None:
        """SIGKILL: no goodbye to anyone."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def spawn_worker(role: str, spec: WorkerSpec, log_path: Path, ready_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> WorkerProcess:
    """Start ``python -m tandem.loadtest.rpc_workers.<role>`` and wait until it serves."""
    return spawn_workers([(role, spec, log_path)], ready_timeout_s, env)[0]


def spawn_workers(workers: Sequence[tuple[str, WorkerSpec, Path]],
                  ready_timeout_s: float = 180.0, env: dict[str, str] | None = None
                  ) -> list[WorkerProcess]:
    """Start several workers at once (they load their models in parallel); wait for all."""
    started = []
    for role, spec, log_path in workers:
        cmd = [sys.executable, "-m", f"tandem.loadtest.rpc_workers.{role}",
               json.dumps(asdict(spec))]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})})
        started.append((role, spec, log_path, process))
    deadline = time.monotonic() + ready_timeout_s
    ready: list[WorkerProcess] = []
    try:
        for role, spec, log_path, process in started:
            port = _wait_ready(process, log_path, deadline, f"{role} worker {spec.worker_id}")
            ready.append(WorkerProcess(role, process, port, log_path))
    except BaseException:
        for *_, process in started:
            process.kill()
        raise
    return ready


def _wait_ready(process: subprocess.Popen[bytes], log_path: Path, deadline: float,
                what: str) -> int:
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(READY + " "):
                return int(json.loads(line[len(READY) + 1:])["port"])
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{_tail(log_path)}")
        time.sleep(0.05)
    raise TimeoutError(f"{what} was not ready in time:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
