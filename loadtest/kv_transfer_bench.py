"""KV transfer benchmark: NIXL and the TCP transport against a raw loopback socket.

    python -m tandem.loadtest.kv_transfer_bench [--transports nixl tcp] [--prompt-lens 512 4096]
                                         [--repeats 5] [--threads 1]

For each transport a prefill and a decode worker run as separate processes, as in a cluster.
Per prompt length: the TTFT of a cold prefill (measured by the client: the prefill worker
returns the first token), then ``repeats`` pulls of the prompt's blocks (re-prefills hit the
prefill worker's prefix cache, so they are cheap; the decode worker keeps no prefix cache, so
every pull moves every block). Transfer time is the decode worker's own measurement around the
read. The baseline, in the same run: a child process writes the same number of bytes to a
loopback TCP socket after a 1-byte request, timed from request to last byte received.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.loadtest.rpc_workers.decode import RemoteDecode
from tandem.loadtest.rpc_workers.prefill import RemotePrefill
from tandem.loadtest.rpc_workers.process import WorkerSpec, spawn_workers
from tandem.services.protocol.handoff import ClusterKey
from tandem.services.protocol.request import GenerationRequest, SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
GIB = 2**30


@dataclass
class Row:
    transport: str
    prompt_tokens: int
    nbytes: int
    transfer_s: float  # median of warm pulls
    cold_transfer_s: float  # the first pull (includes connection set-up)
    raw_s: float  # median, raw loopback socket, same bytes
    ttft_s: float

    @property
    def gib_s(self) -> float:
        return self.nbytes / self.transfer_s / GIB

    @property
    def raw_gib_s(self) -> float:
        return self.nbytes / self.raw_s / GIB


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49_000) for _ in range(length)]


async def _metrics(d: RemoteDecode) -> dict[str, float]:
    return dict((await d.status())["metrics"])


async def bench_transport(transport: str, lens: list[int], repeats: int, threads: int,
                          log_dir: Path) -> list[tuple[int, int, float, float, float]]:
    """(prompt tokens, bytes, median transfer s, cold transfer s, TTFT s) per prompt length."""
    engine = {"num_kv_blocks": 2 * (max(lens) // 16 + 1), "num_threads": threads}
    secret = log_dir / "cluster-secret"  # as deployed: the workers authenticate each other
    secret.touch(mode=0o600)
    secret.write_text(secrets.token_urlsafe(36))
    key = ClusterKey.from_file(secret)
    p_id, d_id = f"bench-p-{transport}", f"bench-d-{transport}"
    p_spec = WorkerSpec(p_id, dict(engine), {}, transport, cluster_secret_file=str(secret))
    d_spec = WorkerSpec(d_id, {**engine, "enable_prefix_caching": False}, {}, transport,
                        cluster_secret_file=str(secret))
    p_proc, d_proc = spawn_workers([("prefill", p_spec, log_dir / f"p-{transport}.log"),
                                    ("decode", d_spec, log_dir / f"d-{transport}.log")])
    p = RemotePrefill("127.0.0.1", p_proc.port, key)
    d = RemoteDecode("127.0.0.1", d_proc.port, key)
    rows = []
    try:
        await d.pair_prefill("127.0.0.1", p_proc.port)
        for length in lens:
            prompt = make_prompt(length, seed=length)
            start = time.perf_counter()
            first = await p.prefill(GenerationRequest(
                f"cold-{length}", prompt, PARAMS), reader=d_id)
            ttft = time.perf_counter() - start
            samples, nbytes = [], 0
            for r in range(repeats + 1):
                if r:
                    first = await p.prefill(GenerationRequest(
                        f"warm-{length}-{r}", prompt, PARAMS), reader=d_id)
                before = await _metrics(d)
                result = await d.generate(GenerationRequest(
                    f"pull-{length}-{r}", prompt, PARAMS, prefill=first))
                after = await _metrics(d)
                if result.kv_source != "transfer":
                    raise RuntimeError(f"{transport}: pull fell back to {result.kv_source}")
                samples.append(after["transfer_seconds"] - before["transfer_seconds"])
                nbytes = int(after["bytes_moved"] - before["bytes_moved"])
            rows.append((length, nbytes, statistics.median(samples[1:]), samples[0], ttft))
    finally:
        await p.close()
        await d.close()
        d_proc.stop()
        p_proc.stop()
    return rows


def bench_raw_socket(nbytes: int, repeats: int) -> float:
    """Median seconds for a child process to send ``nbytes`` over loopback TCP on request."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-m", "tandem.loadtest.kv_transfer_bench",
                                  "--raw-sender", str(port), str(nbytes), str(repeats + 1)])
        conn, _ = server.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    samples = []
    with conn:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("raw sender went away")
                got += n
            samples.append(time.perf_counter() - start)
    child.wait(timeout=60)
    return statistics.median(samples[1:])


def raw_sender(port: int, nbytes: int, rounds: int) -> None:
    payload = memoryview(bytearray(nbytes))
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(rounds):
            if conn.recv(1) != b"g":
                return
            conn.sendall(payload)


def report(rows: list[Row]) -> str:
    lines = [
        "| transport | prompt tokens | MiB moved | transfer ms (median) | cold ms | GiB/s "
        "| raw socket GiB/s | ratio | TTFT s | transfer / TTFT |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.transport} | {r.prompt_tokens} | {r.nbytes / 2**20:.1f} "
            f"| {r.transfer_s * 1e3:.1f} | {r.cold_transfer_s * 1e3:.1f} | {r.gib_s:.2f} "
            f"| {r.raw_gib_s:.2f} | {r.gib_s / r.raw_gib_s:.2f} | {r.ttft_s:.2f} "
            f"| {r.transfer_s / r.ttft_s:.2%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", nargs="+", default=["nixl", "tcp"])
    parser.add_argument("--prompt-lens", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--raw-sender", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_sender:
        raw_sender(*args.raw_sender)
        return 0
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:
        for transport in args.transports:
            results = asyncio.run(bench_transport(transport, args.prompt_lens, args.repeats,
                                                  args.threads, Path(tmp)))
            for length, nbytes, transfer_s, cold_s, ttft_s in results:
                raw_s = bench_raw_socket(nbytes, args.repeats)
                rows.append(Row(transport, length, nbytes, transfer_s, cold_s, raw_s, ttft_s))
                print(f"{transport} {length} tokens: {nbytes / transfer_s / GIB:.2f} GiB/s, "
                      f"raw {nbytes / raw_s / GIB:.2f} GiB/s, TTFT {ttft_s:.2f}s", flush=True)
    print()
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
