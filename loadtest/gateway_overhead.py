"""Gateway overhead: TTFT and ITL through `tandem up` over HTTP versus the engine called directly.

    python -m tandem.loadtest.gateway_overhead [--prefill 1 --decode 1] [--requests 32] \
        [--max-tokens 32]

Starts `tandem up` on free loopback ports, reports its time to ready and the idle RSS of every
process it started, streams greedy completions at concurrency 1 and 16, stops it, then runs the
same prompts on one in-process engine (AsyncEngine, 1 thread). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tandem.loadtest.ports import free_port
from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.protocol.request import GenerationRequest, SamplingParams

READY = re.compile(r"^Tandem ready: HTTP (http://\S+)/v1")


@dataclass
class Timings:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def row(self, label: str) -> str:
        def pct(xs: list[float], q: float) -> float:
            return 1000 * statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else 1000 * xs[0]
        return (f"| {label} | {1000 * statistics.median(self.ttft):.1f} | {pct(self.ttft, 90):.1f}"
                f" | {1000 * statistics.median(self.itl):.1f} | {pct(self.itl, 90):.1f} |")


def prompts(n: int) -> list[str]:
    return [f"Request {i}: explain in a few sentences why the sky looks blue." for i in range(n)]


async def http_run(url: str, texts: list[str], concurrency: int, max_tokens: int) -> Timings:
    timings, gate = Timings(), asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, text: str) -> None:
        async with gate:
            start, last = time.perf_counter(), None
            body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if not json.loads(line[6:]).get("choices"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        timings.ttft.append(now - start)
                    else:
                        timings.itl.append(now - last)
                    last = now

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, t) for t in texts))
    return timings


async def engine_run(engine: AsyncEngine, token_prompts: list[list[int]], concurrency: int,
                     max_tokens: int) -> Timings:
    timings, gate = Timings(), asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> None:
        async with gate:
            start, last = time.perf_counter(), None
            async for out in engine.generate(GenerationRequest(
                f"r{concurrency}-{i}", prompt, params)):
                now = time.perf_counter()
                for k in range(len(out.new_token_ids)):
                    if last is None:
                        timings.ttft.append(now - start)
                    else:
                        timings.itl.append((now - last) / (len(out.new_token_ids) - k))
                    last = now

    await asyncio.gather(*(one(i, p) for i, p in enumerate(token_prompts)))
    return timings


def idle_rss_by_role(tree: list[psutil.Process]) -> dict[str, float]:
    """MiB of resident memory per kind of process: each Serve replica by its deployment (Ray
    titles them ``ray::ServeReplica:<app>:<deployment>``), the rest as Ray's own."""
    totals: dict[str, float] = {}
    for proc in tree:
        try:
            title = " ".join(proc.cmdline()) or proc.name()
            rss = proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
        match = re.search(r"ServeReplica:[^:\s]+:(\w+)", title)
        role = match.group(1) if match else ("tandem up" if proc is tree[0] else "ray")
        totals[role] = totals.get(role, 0.0) + rss
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    texts = prompts(args.requests)
    tandem = Path(sys.executable).with_name("tandem")
    start = time.monotonic()
    up = subprocess.Popen([str(tandem), "up", "--port", str(free_port()), "--grpc-port",
                           str(free_port()), "--prefill", str(args.prefill), "--decode",
                           str(args.decode)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert up.stdout is not None
    match = READY.match(up.stdout.readline())
    if match is None:
        up.kill()
        raise SystemExit("tandem up did not print its ready line")
    ready_s, url = time.monotonic() - start, match.group(1)
    time.sleep(5)  # let start-up settle before sampling idle memory
    tree = [psutil.Process(up.pid), *psutil.Process(up.pid).children(recursive=True)]
    by_role = idle_rss_by_role(tree)
    idle_mib = sum(by_role.values())
    rows = [f"tandem up: ready in {ready_s:.1f} s; idle RSS of {len(tree)} processes "
            f"{idle_mib:.0f} MiB (" + ", ".join(f"{role} {mib:.0f}"
                                                for role, mib in by_role.items()) + ")", "",
            "| path | TTFT p50 (ms) | TTFT p90 | ITL p50 (ms) | ITL p90 |", "|---|---|---|---|---|"]
    try:
        asyncio.run(http_run(url, texts[:2], 1, 4))  # warm-up
        for c in (1, 16):
            rows.append(asyncio.run(http_run(url, texts, c, args.max_tokens)).row(
                f"HTTP via gateway, {args.prefill}P+{args.decode}D, c={c}"))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    engine = AsyncEngine(LLMEngine(EngineConfig(num_threads=1, kv_cache_memory_gb=0.25)))
    token_prompts = [engine.llm.tokenizer.encode(t) for t in texts]
    asyncio.run(engine_run(engine, token_prompts[:2], 1, 4))
    for c in (1, 16):
        rows.append(asyncio.run(engine_run(engine, token_prompts, c, args.max_tokens)).row(
            f"engine direct (1 engine), c={c}"))
    engine.shutdown()
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
