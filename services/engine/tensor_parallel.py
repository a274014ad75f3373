"""Tensor parallelism: one engine over ``tensor_parallel_size`` processes, one per rank.

The engine's own process is rank 0: it keeps the scheduler, the block manager and the sampler,
and starts the other ranks, the *followers* (``python -m tandem.services.engine.tensor_parallel``).
Every rank loads the weights and keeps its ``Shard`` of them (model.py) and a KV cache of its
own KV heads only, with the same block ids as rank 0's. Each step, rank 0 sends each follower
the step's integers (token ids, positions, query and sequence lengths, block tables) as one
int64 message on the follower's stdin; every rank then runs the layers, and the partial sums of
o and down are added up by ``all_reduce`` over a torch.distributed process group (gloo on a
CPU, NCCL on CUDA; built on its own ``TCPStore`` on 127.0.0.1, not as the default group, so
several engines can live in one process). Only rank 0 runs the head and samples.

KV blocks cross ranks in the canonical layout (all KV heads, as one rank holds them): rank 0
``scatter``s canonical blocks (a KV import's staging blocks) into every rank's cache, each rank
its heads' slice, the followers over the process group; and ``gather``s, the mirror, every
rank's heads of blocks into canonical blocks (a pinned prefill's staging blocks, which a KV
transfer serves).

Deadlines and failures: a follower has ``START_TIMEOUT_S`` to load and say it is ready; every
collective, and every message to a follower, times out after ``tensor_parallel_timeout_s``; a
follower exits when its stdin closes (rank 0 is gone) or a collective fails. When a follower
dies, rank 0's next collective fails at once (its connection closes); one that hangs, at the
timeout. The group is then broken, its followers are stopped, and this and every later call
raise ``TensorParallelError``, which stops the engine (as a device error does). On CUDA the
host does not wait for an all-reduce (the stream does, ``wait_all_reduce``): NCCL's watchdog
times it out and aborts the communicator, and rank 0's next call raises (``_process_group``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist

from tandem.services.engine.attention import build_step_metadata, get_attention_backend
from tandem.services.engine.kv_cache import KVCache, KVCacheSpec, allocate_kv_cache, kv_parts
from tandem.services.engine.model import LlamaModel, Shard
from tandem.services.engine.model_loader import load_model

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a follower loads the weights and reports ready within this
STOP_TIMEOUT_S = 10.0  # a stopped follower exits within this, else it is killed

# Message kinds (the first int64 of a message).
_STOP, _STEP, _SCATTER, _GATHER = range(4)
_LENGTH = struct.Struct("<Q")  # a message's byte count, before it


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed: the engine cannot step any more."""


@dataclass(frozen=True)
class FollowerSettings:
    """What a follower builds its rank from (JSON on its command line)."""

    model: str | None  # what the follower loads: rank 0's model ...
    model_id: str  # ... which must be this one
    dtype: str
    device: str  # rank 0's device; a CUDA follower takes the device ``rank`` places after it
    block_size: int
    num_blocks: int
    kv_cache_dtype: str
    attention_backend: str
    num_threads: int | None
    max_positions: int
    world_size: int
    store_port: int
    timeout_s: float  # each collective, and each message to a follower


def rank_device(device: str, rank: int) -> str:
    on = torch.device(device)
    return f"cuda:{(on.index or 0) + rank}" if on.type == "cuda" else device


def _process_group(store: dist.Store, rank: int, world_size: int, device: str,
                   timeout_s: float) -> Any:
    """This rank's process group: gloo on a CPU, whose waits each take the timeout
    (``wait_all_reduce``); NCCL on CUDA, whose watchdog thread times out a collective after
    ``timeout_s`` (``_timeout``: the deadline of the stream-ordered all-reduces, which no host
    waits for). Rank 0's watchdog then aborts the communicator, which ends the hung kernel, so
    rank 0's stream and host go on, and leaves the process up (CleanUpOnly): rank 0's next call
    raises ``TensorParallelError`` (``group_problem``). A follower's watchdog takes its process
    down (torch's default), which rank 0 sees. The operator's own ``TORCH_NCCL_*`` settings
    win."""
    if torch.device(device).type == "cuda":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = datetime.timedelta(seconds=timeout_s)
        # Read when the group is built. 2: CleanUpOnly. The dump wait: how long the watchdog
        # gives a flight-recorder dump before it acts on a timeout (60 s in torch 2.11).
        settings = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
                    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000"} if rank == 0 else {}
        with _unless_set(settings):
            return dist.ProcessGroupNCCL(store, rank, world_size, nccl)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = datetime.timedelta(seconds=START_TIMEOUT_S)  # to connect (a rank may load)
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = dist.ProcessGroupGloo(store, rank, world_size, gloo)
    # Then each operation's: one that timed out gives up in gloo's thread too (else a follower
    # that failed would not exit until the connect timeout ran out as well).
    group._set_default_timeout(datetime.timedelta(seconds=timeout_s))
    return group


@contextlib.contextmanager
def _unless_set(variables: dict[str, str]) -> Iterator[None]:
    """Environment ``variables`` that are not set already, for the ``with`` block only."""
    added = {k: v for k, v in variables.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def wait_all_reduce(work: Any, device: str, timeout: datetime.timedelta) -> None:
    """Wait for an all-reduce on ``device``'s process group (``_process_group``).

    On CUDA the wait is stream-ordered: ``wait()`` with no timeout makes the current stream wait
    for NCCL's and returns at once. With a timeout torch's NCCL backend would have the host poll
    the work, sleeping 1 ms between polls (its blocking-wait path): at least 1 ms each, for the
    2 all-reduces of every layer of every step. The deadline there is the NCCL watchdog's
    (``_process_group``). On gloo the host waits, at most ``timeout``.
    """
    if torch.device(device).type == "cuda":
        work.wait()
    else:
        work.wait(timeout)


def group_problem(group: Any) -> str | None:
    """What the group's NCCL watchdog found (a collective that timed out or failed: the group
    is unusable), None if nothing; gloo reports its failures in its waits."""
    if not isinstance(group, getattr(dist, "ProcessGroupNCCL", ())):
        return None
    error = group.get_error()  # an ErrorType: SUCCESS, TIMEOUT, COMM_ERROR, REMOTE_ERROR
    if error.name == "SUCCESS":
        return None
    return f"NCCL's watchdog reports {error.name}: a collective failed or hung"


def head_slices(cache: KVCache, block_ids: Sequence[int], heads: slice) -> list[torch.Tensor]:
    """Blocks ``block_ids`` of the cache, KV heads ``heads`` only, as new tensors (one per
    ``kv_parts``)."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_parts(cache)[0].device)
    return [part.index_select(0, index)[:, :, :, :, heads].contiguous()
            for part in kv_parts(cache)]


def put_head_slices(cache: KVCache, block_ids: Sequence[int], heads: slice,
                    slices: Sequence[torch.Tensor]) -> None:
    """The inverse of ``head_slices``: write them into blocks ``block_ids``, heads ``heads``."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_parts(cache)[0].device)
    for part, values in zip(kv_parts(cache), slices, strict=True):
        part[index, :, :, :, heads] = values


def slice_buffers(cache: KVCache, num_blocks: int, num_heads: int) -> list[torch.Tensor]:
    """Empty tensors shaped like ``head_slices`` of ``num_blocks`` blocks, ``num_heads`` heads."""
    return [torch.empty((num_blocks, *part.shape[1:4], num_heads, *part.shape[5:]),
                        dtype=part.dtype, device=part.device) for part in kv_parts(cache)]


def pack_step(input_ids: list[int], positions: list[int], query_lens: list[int],
              seq_lens: list[int], tables: list[list[int]], num_decodes: int) -> torch.Tensor:
    """One step's integers as one int64 tensor (``unpack_step`` reads it back)."""
    header = [_STEP, len(input_ids), len(query_lens), num_decodes]
    flat = [b for table in tables for b in table]
    return torch.tensor(header + input_ids + positions + query_lens + seq_lens + flat,
                        dtype=torch.int64)


def unpack_step(message: list[int], block_size: int
                ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]], int]:
    """``pack_step``'s lists (a table covers its sequence's keys, so its length is implied)."""
    _, num_tokens, num_seqs, num_decodes = message[:4]
    at = 4
    input_ids, at = message[at:at + num_tokens], at + num_tokens
    positions, at = message[at:at + num_tokens], at + num_tokens
    query_lens, at = message[at:at + num_seqs], at + num_seqs
    seq_lens, at = message[at:at + num_seqs], at + num_seqs
    tables = []
    for n in seq_lens:
        width = -(-n // block_size)
        tables.append(message[at:at + width])
        at += width
    return input_ids, positions, query_lens, seq_lens, tables, num_decodes


class TensorParallelGroup:
    """Rank 0's side: starts the followers, sends them each step, reduces with them."""

    def __init__(self, settings: FollowerSettings, shards: Sequence[Shard]) -> None:
        """``settings``: every follower's (``store_port`` is filled in here); ``shards``: the
        ranks' ``Shard``s, rank 0's first."""
        self.world_size = settings.world_size
        self.device = settings.device
        self.timeout_s = settings.timeout_s
        self._group_timeout = datetime.timedelta(seconds=self.timeout_s)
        self.kv_heads = [slice(s.kv_heads.start, s.kv_heads.stop) for s in shards]
        self._broken: str | None = None
        # The ranks' rendezvous, on loopback only: a TCPStore told to listen itself does so
        # on every interface, so it is handed a socket bound to 127.0.0.1 (the store owns it).
        listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        port = listener.getsockname()[1]
        self._store = dist.TCPStore("127.0.0.1", port, self.world_size, True,
                                    timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                                    wait_for_workers=False, master_listen_fd=listener.detach())
        settings = dataclasses.replace(settings, store_port=self._store.port)
        self.followers = [
            subprocess.Popen([sys.executable, "-m", __name__, str(rank),
                              json.dumps(dataclasses.asdict(settings))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            for rank in range(1, self.world_size)]
        for process in self.followers:  # written with a deadline (``_send``)
            assert process.stdin is not None
            os.set_blocking(process.stdin.fileno(), False)
        self._finalizer = weakref.finalize(self, _stop_all, list(self.followers))
        try:
            self._wait_ready()
            self._group = _process_group(self._store, 0, self.world_size, settings.device,
                                         self.timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = {p.stdout.fileno(): (rank, p) for rank, p in enumerate(self.followers, 1)
                   if p.stdout is not None}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TensorParallelError(
                    f"tensor-parallel ranks {sorted(r for r, _ in waiting.values())} were not "
                    f"ready within {START_TIMEOUT_S:g}s")
            readable, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in readable:
                rank, process = waiting.pop(fd)
                assert process.stdout is not None
                if process.stdout.readline() != b"ready\n":
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} (pid {process.pid}) failed to start "
                        f"(exit code {process.wait(STOP_TIMEOUT_S)}; its error is in this "
                        f"process's stderr)")

    # -- rank 0's operations ---------------------------------------------------------------

    def step(self, input_ids: list[int], positions: list[int], query_lens: list[int],
             seq_lens: list[int], tables: list[list[int]], num_decodes: int) -> None:
        """Have every follower run this step's layers alongside rank 0."""
        self._send(pack_step(input_ids, positions, query_lens, seq_lens, tables, num_decodes))

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` in place over the ranks."""
        self._wait(lambda: self._group.allreduce([x]), "all_reduce", all_reduce=True)

    def scatter(self, source: KVCache, source_ids: Sequence[int], cache: KVCache,
                block_ids: Sequence[int]) -> None:
        """Canonical blocks ``source_ids`` of ``source`` into blocks ``block_ids`` of every
        rank's cache: rank 0's heads into ``cache``, the others' to their followers."""
        self._send(torch.tensor([_SCATTER, *block_ids], dtype=torch.int64))
        for rank, heads in enumerate(self.kv_heads):
            slices = head_slices(source, source_ids, heads)
            if rank == 0:
                put_head_slices(cache, block_ids, slice(None), slices)
                continue
            for part in slices:
                self._wait(lambda p=part, r=rank: self._group.send([p], r, 0), "send")

    def gather(self, cache: KVCache, block_ids: Sequence[int], target: KVCache,
               target_ids: Sequence[int]) -> None:
        """The mirror of ``scatter``: blocks ``block_ids`` of every rank's cache into canonical
        blocks ``target_ids`` of ``target``: rank 0's heads from ``cache``, the others' from
        their followers."""
        self._send(torch.tensor([_GATHER, *block_ids], dtype=torch.int64))
        for rank, heads in enumerate(self.kv_heads):
            if rank == 0:
                slices = head_slices(cache, block_ids, slice(None))
            else:
                slices = slice_buffers(target, len(block_ids), heads.stop - heads.start)
                for part in slices:
                    self._wait(lambda p=part, r=rank: self._group.recv([p], r, 0), "recv")
            put_head_slices(target, target_ids, heads, slices)

    def broken(self, error: BaseException) -> TensorParallelError:
        """Stop the group after ``error`` on rank 0 mid-step (the followers cannot be trusted
        to be where rank 0 is): the error to raise."""
        if isinstance(error, TensorParallelError):
            return error
        return self._fail(f"rank 0 failed mid-step: {error!r}")

    def close(self) -> None:
        self._finalizer()

    # -- internals -------------------------------------------------------------------------

    def _send(self, message: torch.Tensor) -> None:
        """Write a message to every follower, each within the collective timeout (a follower
        that stopped reading, e.g. hung, must not hold rank 0 once its pipe is full)."""
        self.check()
        frame = memoryview(_LENGTH.pack(message.numel() * 8) + message.numpy().tobytes())
        for rank, process in enumerate(self.followers, 1):
            assert process.stdin is not None
            fd, sent = process.stdin.fileno(), 0
            deadline = time.monotonic() + self.timeout_s
            try:
                while sent < len(frame):
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([], [fd], [], left)[1]:
                        raise TimeoutError(f"its pipe stayed full for {self.timeout_s:g}s")
                    sent += os.write(fd, frame[sent:])
            except OSError as exc:  # BrokenPipeError, TimeoutError
                raise self._fail(f"cannot reach rank {rank}: {exc!r}") from None

    def _wait(self, start: Any, what: str, all_reduce: bool = False) -> None:
        """Start a collective and wait for it: an all-reduce as ``wait_all_reduce`` waits
        (stream-ordered on CUDA); a send or receive of KV blocks on the host, within the
        timeout (rare, and what comes next, a peer's read of staging blocks, is ordered by no
        stream)."""
        self.check()
        try:
            work = start()
            if all_reduce:
                wait_all_reduce(work, self.device, self._group_timeout)
            else:
                work.wait(self._group_timeout)
        except RuntimeError as exc:
            raise self._fail(f"{what} failed: {exc}") from None

    def check(self) -> None:
        """Raise once the group is broken: by an earlier failure, or as NCCL's watchdog found
        (a stream-ordered all-reduce that failed or ran past the timeout: ``_process_group``)."""
        if self._broken is None and (problem := group_problem(self._group)) is not None:
            raise self._fail(f"{problem} (tensor_parallel_timeout_s {self.timeout_s:g})")
        if self._broken is not None:
            raise TensorParallelError(self._broken)

    def _fail(self, problem: str) -> TensorParallelError:
        """Break the group: note why (with the followers' exit codes) and kill them (they are
        in no known state, and one may be hung)."""
        if self._broken is None:
            codes = ", ".join(f"rank {rank} pid {p.pid}: "
                              f"{'running' if p.poll() is None else f'exit code {p.returncode}'}"
                              for rank, p in enumerate(self.followers, 1))
            self._broken = f"tensor-parallel group broken: {problem} ({codes})"
            log.error("%s", self._broken)
            for process in self.followers:
                if process.poll() is None:
                    process.kill()
            self.close()
        return TensorParallelError(self._broken)


def _stop_all(followers: list[subprocess.Popen[bytes]]) -> None:
    """Ask every follower to stop (its stdin closes), then kill those still running."""
    for process in followers:
        assert process.stdin is not None
        with contextlib.suppress(OSError):  # gone, or not reading: the kill below stops it
            os.write(process.stdin.fileno(), _LENGTH.pack(8) + struct.pack("<q", _STOP))
        with contextlib.suppress(OSError):
            process.stdin.close()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in followers:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


# -- a follower ---------------------------------------------------------------------------------


def _read_message(stream: IO[bytes]) -> list[int] | None:
    """The next message from rank 0; None once rank 0 closed the stream (or died)."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return torch.frombuffer(bytearray(body), dtype=torch.int64).tolist()


def follow(rank: int, settings: FollowerSettings, ready: IO[bytes]) -> None:
    """Run rank ``rank`` until rank 0 says stop or goes away; say ``ready`` once loaded."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    device = rank_device(settings.device, rank)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    loaded = load_model(settings.model, settings.dtype, progress=False)
    if loaded.config.model_id != settings.model_id:
        raise TensorParallelError(f"rank {rank} loaded {loaded.config.model_id!r} from "
                                  f"{settings.model!r}; rank 0 runs {settings.model_id!r}")
    shard = Shard.of(loaded.config, rank, settings.world_size)
    local = shard.local_config(loaded.config)
    spec = KVCacheSpec.for_model(local, settings.block_size, settings.dtype, settings.num_blocks,
                                 0.0, settings.kv_cache_dtype)
    cache = allocate_kv_cache(spec, device)
    timeout = datetime.timedelta(seconds=settings.timeout_s)

    def all_reduce(x: torch.Tensor) -> None:
        wait_all_reduce(group.allreduce([x]), device, timeout)

    model = LlamaModel(loaded.config, loaded.weights,
                       get_attention_backend(settings.attention_backend, device, local.num_heads,
                                             local.num_kv_heads, local.head_dim,
                                             spec.torch_dtype,
                                             features=loaded.config.attention_features),
                       settings.max_positions, device, shard, all_reduce)
    del loaded
    ready.write(b"ready\n")  # loaded and built: the first step's collectives will not wait
    ready.flush()
    store = dist.TCPStore("127.0.0.1", settings.store_port, settings.world_size, False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    group = _process_group(store, rank, settings.world_size, device, settings.timeout_s)
    everything = slice(None)
    while (message := _read_message(sys.stdin.buffer)) is not None:
        if (problem := group_problem(group)) is not None:
            raise TensorParallelError(f"rank {rank}: {problem}")
        kind, body = message[0], message[1:]
        if kind == _STOP:
            return
        if kind == _STEP:
            input_ids, positions, query_lens, seq_lens, tables, num_decodes = unpack_step(
                message, settings.block_size)
            step = build_step_metadata(query_lens, seq_lens, tables, num_decodes,
                                       settings.block_size, device)
            model.hidden(torch.tensor(input_ids, device=device),
                         torch.tensor(positions, device=device), cache,
                         model.attention.prepare(step))
        elif kind == _SCATTER:
            slices = slice_buffers(cache, len(body), local.num_kv_heads)
            for part in slices:
                group.recv([part], 0, 0).wait(timeout)
            put_head_slices(cache, body, everything, slices)
        elif kind == _GATHER:
            for part in head_slices(cache, body, everything):
                group.send([part], 0, 0).wait(timeout)
        else:
            raise TensorParallelError(f"rank {rank}: unknown message kind {kind}")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format=f"rank {argv[0]}: %(message)s")
    rank = int(argv[0])
    # stdout is rank 0's pipe for the ready line alone: anything else printed goes to stderr.
    ready = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        follow(rank, FollowerSettings(**json.loads(argv[1])), ready)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
