"""A real, served Kubernetes API emulator (kmock's ``KubernetesEmulator`` over HTTP) on a
thread of its own, for the synchronous ``kubernetes`` client the planner uses; and a
kubeconfig that points at it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import kmock
import yaml

RAYSERVICES = "ray.io/v1/rayservices"


@dataclass
class Served:
    emulator: kmock.KubernetesEmulator
    url: str

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "planner", "user": {"token": "planner-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "planner"}}],
        }))
        return path


@contextmanager
def served_emulator() -> Iterator[Served]:
    """The emulator serving ``ray.io/v1`` RayServices until the block ends."""
    ready = threading.Event()
    started: list[Served] = []
    control: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    failure: list[BaseException] = []

    async def serve() -> None:
        stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources[RAYSERVICES] = {"kind": "RayService", "namespaced": True}
            started.append(Served(emulator, str(server.url).rstrip("/")))
            control.append((asyncio.get_running_loop(), stop))
            ready.set()
            await stop.wait()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:  # surfaced to the test below
            failure.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="kmock", daemon=True)
    thread.start()
    ready.wait(60)
    if not started:
        raise RuntimeError(f"kmock did not start: {failure or 'no answer in 60 s'}")
    try:
        yield started[0]
    finally:
        loop, stop = control[0]
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
