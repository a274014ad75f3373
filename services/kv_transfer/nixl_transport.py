"""NIXL transport (UCX backend): READ the peer's registered blocks into ours.

On CPU machines UCX moves host memory between processes (cross-memory attach after a TCP
wire-up); on GPU nodes the same calls move GPU memory over RDMA/NVLink. The agent runs without
NIXL's progress thread (it busy-spins a core); a poll of the agent instead lets peers complete
their wire-up with us and read from us: every ``progress_interval_s`` while reads are expected
(``expect_reads``: a lease granted, a peer pairing), every ``idle_progress_interval_s`` after,
so an idle worker burns next to no CPU. Our own transfers are driven by the thread that posts
them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib
import logging
import os
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.services.kv_transfer.transport import (
    KVTransferError,
    KVTransferStuckError,
    KVTransport,
    TransferFaults,
)
from tandem.services.protocol.handoff import ClusterKey


def _import_nixl() -> Any:
    """NIXL's module under its wheel's name: nixl-cu13 (GPU images: torch's CUDA 13),
    nixl-cu12 (CPU machines and CI), or the plain ``nixl``."""
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("NIXL is not installed: pip install 'tandem[gpu]' (nixl-cu13, for torch's "
                      "CUDA 13 wheels), or 'tandem[cpu]' on a CPU machine (nixl-cu12)")


_nixl = _import_nixl()
nixl_agent, nixl_agent_config, nixl_thread_sync_t = (
    _nixl.nixl_agent, _nixl.nixl_agent_config, _nixl.nixl_thread_sync_t)

log = logging.getLogger(__name__)
logging.getLogger("nixl").setLevel(os.environ.get("NIXL_LOG_LEVEL", "WARNING").upper())


class NixlTransport(KVTransport):
    kind = "nixl"

    def __init__(self, name: str, faults: TransferFaults | None = None,
                 key: ClusterKey | None = None, progress_interval_s: float = 0.002,
                 poll_interval_s: float = 0.0005, idle_progress_interval_s: float = 0.25,
                 settle_timeout_s: float = 10.0) -> None:
        super().__init__(name, faults, key)
        # How long a failed or timed-out read may take to stop writing locally; then
        # KVTransferStuckError (the worker stops).
        self.settle_timeout_s = settle_timeout_s
        self.progress_interval_s = progress_interval_s
        self.idle_progress_interval_s = idle_progress_interval_s
        self._brisk_until = 0.0  # time.monotonic() until which reads are expected
        self._wake = asyncio.Event()
        self.poll_interval_s = poll_interval_s
        self.agent_name = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent: Any = None
        self._local = _Region(0, "DRAM", 0)
        self._local_bytes = 0
        self._remote: dict[str, tuple[str, _Region]] = {}  # peer id -> (agent name, cache)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nixl-xfer")
        self._progress_task: asyncio.Task[None] | None = None

    def register(self, kv_cache: torch.Tensor) -> None:
        """Register the whole KV cache with a new agent, once (``start`` does it when this was
        not called first; ``make_transport`` calls it to choose a transport). The real cache,
        tens of GB on a GPU, can fail where a small probe passed (registration, BAR or pinned
        memory limits): ``KVTransferError`` then names its size and NIXL's error."""
        where = _Region(kv_cache.data_ptr(), "VRAM" if kv_cache.is_cuda else "DRAM",
                        kv_cache.device.index or 0)
        if self._agent is not None:
            if (where, kv_cache.nbytes) != (self._local, self._local_bytes):
                raise RuntimeError(f"transport {self.name} registered another KV cache")
            return
        what = f"the KV cache of {_size(kv_cache.nbytes)} on {kv_cache.device}"
        try:
            config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                       backends=["UCX"],
                                       sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            agent = nixl_agent(self.agent_name, config)
        except Exception as exc:
            raise KVTransferError(f"NIXL cannot start an agent for {what}: {exc}") from None
        if "UCX" not in agent.backends:
            raise KVTransferError("NIXL loaded, but its UCX backend did not")
        if kv_cache.is_cuda and "VRAM_SEG" not in agent.get_backend_mem_types("UCX"):
            raise KVTransferError("NIXL's UCX backend cannot move GPU memory here (it has no "
                                  "VRAM support); use transport tcp or auto")
        try:
            agent.register_memory(kv_cache)
        except Exception as exc:
            raise KVTransferError(f"NIXL cannot register {what}: {exc}") from None
        self._agent, self._local, self._local_bytes = agent, where, kv_cache.nbytes

    async def _start(self, kv_cache: torch.Tensor) -> None:
        self.register(kv_cache)
        self._progress_task = asyncio.create_task(self._progress(), name="nixl-progress")

    async def _close(self) -> None:
        if self._progress_task is not None:
            self._progress_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._progress_task
        self._executor.shutdown(wait=True)

    def _metadata(self) -> dict[str, Any]:
        return {"agent": base64.b64encode(self._agent.get_agent_metadata()).decode(),
                "base_addr": self._local.base, "mem_type": self._local.mem_type,
                "device_id": self._local.device_id}

    def _add_peer(self, peer_id: str, metadata: Mapping[str, Any]) -> None:
        try:
            region = _Region(int(metadata["base_addr"]), str(metadata["mem_type"]),
                             int(metadata["device_id"]))
            if region.mem_type not in ("DRAM", "VRAM"):
                raise ValueError(f"memory type {region.mem_type!r}")
            name = self._agent.add_remote_agent(base64.b64decode(metadata["agent"]))
        except Exception as exc:
            raise KVTransferError(f"cannot load NIXL metadata of peer {peer_id!r}: {exc}") from None
        self._remote[peer_id] = (name.decode() if isinstance(name, bytes) else name, region)

    def _remove_peer(self, peer_id: str) -> None:
        name, _ = self._remote.pop(peer_id)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone on NIXL's side
            log.debug("removing NIXL agent %s: %s", name, exc)

    async def _read(self, peer_id: str, remote: list[int], local: list[int],
                    lease_id: str) -> None:
        # One-sided: NIXL reads the peer's registered memory without the peer's code seeing
        # the read, so the lease is not checked here; reading needs the peer's agent metadata,
        # which only pairing hands out (signed with the cluster key, on the control plane).
        agent = self._agent
        name, region = self._remote[peer_id]
        size = self._registered().shape[1]
        try:
            local_descs = agent.get_xfer_descs(_descs(self._local, local, size),
                                               self._local.mem_type)
            remote_descs = agent.get_xfer_descs(_descs(region, remote, size), region.mem_type)
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, name)
        except Exception as exc:
            raise KVTransferError(f"NIXL refused the read from {peer_id!r}: {exc}") from None
        loop = asyncio.get_running_loop()
        posted = loop.run_in_executor(self._executor, agent.transfer, handle)
        state = "ERR"
        try:
            state = await asyncio.shield(posted)
            while state == "PROC":
                await asyncio.sleep(self.poll_interval_s)
                state = agent.check_xfer_state(handle)
        except Exception as exc:
            raise KVTransferError(f"NIXL read from {peer_id!r} failed: {exc}") from None
        finally:
            await self._settle(posted, handle)
        if state != "DONE":
            raise KVTransferError(f"NIXL read from {peer_id!r} ended in state {state}")

    async def _settle(self, posted: asyncio.Future[str], handle: Any) -> None:
        """Wait until the transfer can no longer write locally, then free its handle; at most
        ``settle_timeout_s``, then ``KVTransferStuckError``."""
        deadline = time.monotonic() + self.settle_timeout_s
        stuck = KVTransferStuckError(f"a NIXL read could not be stopped within "
                                     f"{self.settle_timeout_s:g} s; it may still write into "
                                     f"this worker's KV cache")
        unstoppable = self.faults.unstoppable_reads > 0
        if unstoppable:
            self.faults.unstoppable_reads -= 1
        cancelled = False
        while not posted.done():
            if time.monotonic() >= deadline:
                raise stuck
            try:
                await asyncio.wait([posted], timeout=deadline - time.monotonic())
            except asyncio.CancelledError:
                cancelled = True
        try:
            if unstoppable:
                raise RuntimeError("injected: the read cannot be cancelled")
            self._agent.release_xfer_handle(handle)  # cancels a transfer still in progress
        except Exception:
            # NIXL could not cancel it: wait for the transfer to end before the caller reuses
            # the destination blocks.
            while unstoppable or self._state(handle) == "PROC":
                if time.monotonic() >= deadline:
                    raise stuck from None
                await asyncio.sleep(self.poll_interval_s)
            with contextlib.suppress(Exception):
                self._agent.release_xfer_handle(handle)
        if cancelled:
            raise asyncio.CancelledError

    def _state(self, handle: Any) -> str:
        try:
            return str(self._agent.check_xfer_state(handle))
        except Exception:
            return "ERR"

    def expect_reads(self, for_s: float) -> None:
        self._brisk_until = max(self._brisk_until, time.monotonic() + for_s)
        self._wake.set()

    async def _progress(self) -> None:
        while True:
            try:
                self._agent.get_new_notifs()  # progresses UCX: peers' wire-up needs it
            except Exception as exc:
                log.warning("NIXL progress: %s", exc)
            if time.monotonic() < self._brisk_until:
                await asyncio.sleep(self.progress_interval_s)
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.idle_progress_interval_s):
                    await self._wake.wait()


def vram_problem(device: str | torch.device) -> str | None:
    """Why NIXL cannot move KV memory on ``device`` here (None: it can): a throwaway agent
    registers a small tensor there. Only a probe: the real cache can still fail to register
    (``NixlTransport.register``, which ``make_transport`` runs when it has the cache)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                               backends=["UCX"])
    try:
        agent = nixl_agent(f"vram-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}", config)
        if "VRAM_SEG" not in agent.get_backend_mem_types("UCX"):
            return "NIXL's UCX backend has no GPU memory support"
        probe = torch.zeros(4096, dtype=torch.uint8, device=device)
        agent.deregister_memory(agent.register_memory(probe))
    except Exception as exc:
        return f"NIXL cannot register GPU memory: {exc}"
    return None


def _size(nbytes: int) -> str:
    """A byte count as people read it, exact bytes after."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


@dataclass(frozen=True)
class _Region:
    """A registered KV cache: where it starts, in which memory."""

    base: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int


def _descs(region: _Region, block_ids: list[int], size: int) -> np.ndarray:
    """One (address, length, device) row per block."""
    rows = np.zeros((len(block_ids), 3), dtype=np.uint64)
    rows[:, 0] = region.base + np.asarray(block_ids, dtype=np.uint64) * np.uint64(size)
    rows[:, 1] = size
    rows[:, 2] = region.device_id
    return rows
