"""Hostile traffic beside well-behaved streaming clients: does any client or tenant hurt another?

    python -m tandem.loadtest.attacks [--duration 20] [--clients 2] [--out DIR]

Starts one `tandem up` (the built-in model, default shape; two API keys: tenant ``calm`` and
tenant ``flood``) on free loopback ports. For each scenario, ``--clients`` well-behaved streaming
chat clients (tenant calm) send requests one after another for ``--duration`` seconds while the
attack runs beside them, from a process of its own (as an attacker's traffic comes from
elsewhere: its client-side work must not delay the calm clients' event loop); each of their
requests gives its time to first token and its largest gap between two tokens, and the gateway's
own TTFT median (``tandem_time_to_first_token_seconds`` of tenant calm, over the scenario) is
reported beside it. Scenarios, in order:

- ``quiet``: the well-behaved clients alone (the reference);
- ``big_prompts``: 8 concurrent clients sending 1 MB prompts over and over;
- ``slow_connections``: 64 connections that send a request's headers a byte a second, and 64
  that announce a 1 MiB body and send none of it, each kept up to 75 s (past the gateway's
  header and body deadlines, 20 and 60 s) unless the server ends it first;
- ``tenant_flood``: tenant flood keeps 3x the admission slots' worth of long requests in flight.

After each scenario it checks the cluster is whole: every KV block free, the next request
served, and the gateway process' resident memory (``process_resident_memory_bytes``) against
its value after the quiet run. Prints a table (per scenario: requests of the calm clients, TTFT
p50 and the largest inter-token gap, both also as a ratio to quiet, what the attack got:
answers by status, connections cut; and the checks after) and writes attacks.json to
``--out``. All traffic is on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from tandem.loadtest import results as results_table
from tandem.loadtest.tandem_up import TandemUp
from tandem.services.serving.up_stats import metric_samples

SCENARIOS = ("quiet", "big_prompts", "slow_connections", "tenant_flood")
CALM_KEY, FLOOD_KEY = "calm-key-0123456789", "flood-key-0123456789"
PROMPT = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]


@dataclass
class Scenario:
    name: str
    calm_requests: int = 0
    ttft_p50_ms: float = 0.0
    server_ttft_p50_ms: float = 0.0  # the gateway's own measure, tenant calm
    max_gap_ms: float = 0.0
    attack: dict[str, int] = field(default_factory=dict)  # outcome -> count
    blocks_free_after: bool = False
    served_after: bool = False
    gateway_rss_mib_after: float = 0.0  # the gateway process' resident memory, after


async def calm_client(url: str, until: float, ttfts: list[float], gaps: list[float]) -> None:
    body = {"model": "", "messages": PROMPT, "max_tokens": 32, "temperature": 0,
            "stream": True}
    headers = {"Authorization": f"Bearer {CALM_KEY}"}
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < until:
            sent = time.monotonic()
            last = None
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                     headers=headers) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.monotonic()
                    if last is None:
                        ttfts.append(now - sent)
                    else:
                        gaps.append(now - last)
                    last = now


async def big_prompts(url: str, until: float, outcome: Counter[str]) -> None:
    text = "x" * (1 << 20)
    body = {"model": "", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {FLOOD_KEY}"}

    async def one() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            while time.monotonic() < until:
                response = await client.post(f"{url}/v1/chat/completions", json=body,
                                             headers=headers)
                outcome[str(response.status_code)] += 1

    await asyncio.gather(*(one() for _ in range(8)))


# How long a slow connection is kept up: past the gateway's body deadline (60 s), so each ends
# cut by the server or is counted still open.
SLOW_CONNECTION_S = 75.0


async def slow_connections(url: str, until: float, outcome: Counter[str]) -> None:
    host, port = url.removeprefix("http://").split(":")
    give_up = max(until, time.monotonic() + SLOW_CONNECTION_S)

    async def trickle(announce_body: bool) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                   b"Authorization: Bearer " + FLOOD_KEY.encode() + b"\r\n")
        # headers a byte a second (never finished), or whole headers announcing a body
        pending = [request + b"content-length: 1048576\r\n\r\n"] if announce_body else [
            bytes([b]) for b in request * 4]
        answer = None
        try:
            while answer is None and time.monotonic() < give_up:
                if pending:
                    writer.write(pending.pop(0))
                    await writer.drain()
                with contextlib.suppress(TimeoutError):
                    answer = await asyncio.wait_for(reader.read(64), 1.0)
        except ConnectionError:
            answer = b""
        finally:
            writer.close()
        outcome["still open at the end" if answer is None else
               "cut with 408" if answer.startswith(b"HTTP/1.1 408") else
               "closed" if not answer else "answered"] += 1

    await asyncio.gather(*(trickle(i % 2 == 1) for i in range(128)))


async def tenant_flood(url: str, until: float, outcome: Counter[str], slots: int) -> None:
    body = {"model": "", "messages": PROMPT, "max_tokens": 256, "temperature": 0,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {FLOOD_KEY}"}

    async def one() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            while time.monotonic() < until:
                response = await client.post(f"{url}/v1/chat/completions", json=body,
                                             headers=headers)
                outcome[str(response.status_code)] += 1
                if response.status_code == 429:
                    await asyncio.sleep(0.2)  # a client told to retry later

    await asyncio.gather(*(one() for _ in range(3 * slots)))


def metric(url: str, name: str) -> list[float]:
    text = httpx.get(f"{url}/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {CALM_KEY}"}).text
    return [s.value for s in metric_samples(text) if s.name == name]


def whole(url: str) -> tuple[bool, bool]:
    """(every KV block free, the next request served), waiting up to 60 s for the first."""
    deadline = time.monotonic() + 60
    free = False
    while time.monotonic() < deadline and not free:
        free = metric(url, "tandem_kv_cache_free_blocks") == metric(url, "tandem_kv_cache_blocks")
        if not free:
            time.sleep(0.5)
    response = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {CALM_KEY}"},
                          json={"model": "", "messages": PROMPT, "max_tokens": 2})
    return free, response.status_code == 200


def attack(name: str, url: str, until: float, slots: int, answer: multiprocessing.Queue) -> None:
    """One scenario's attack, in a process of its own; its outcome counts go to ``answer``."""
    outcome: Counter[str] = Counter()
    attacks = {"big_prompts": lambda: big_prompts(url, until, outcome),
               "slow_connections": lambda: slow_connections(url, until, outcome),
               "tenant_flood": lambda: tenant_flood(url, until, outcome, slots)}
    asyncio.run(attacks[name]())
    answer.put(dict(outcome))


def server_ttft(url: str) -> dict[float, float]:
    """The gateway's TTFT histogram for tenant calm: bucket bound -> count."""
    text = httpx.get(f"{url}/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {CALM_KEY}"}).text
    return {float(s.labels["le"]): s.value for s in metric_samples(text)
            if s.name == "tandem_time_to_first_token_seconds_bucket"
            and s.labels.get("tenant") == "calm"}


def median_from_buckets(before: dict[float, float], after: dict[float, float]) -> float:
    """The median of what a cumulative histogram counted between two reads, interpolated
    linearly inside its bucket (as Prometheus' histogram_quantile), in seconds."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    if not counts or counts[-1][1] <= 0:
        return 0.0
    half, lower, below = counts[-1][1] / 2, 0.0, 0.0
    for le, count in counts:
        if count >= half:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (half - below) / max(count - below, 1e-9)
        lower, below = le, count
    return lower


def run(url: str, name: str, duration_s: float, clients: int, slots: int) -> Scenario:
    ttfts: list[float] = []
    gaps: list[float] = []
    outcome: Counter[str] = Counter()
    histogram = server_ttft(url)
    until = time.monotonic() + duration_s
    context = multiprocessing.get_context("spawn")
    answer = context.Queue()
    attacker = (context.Process(target=attack, args=(name, url, until, slots, answer))
                if name != "quiet" else None)
    if attacker is not None:
        attacker.start()

    async def scenario() -> None:
        await asyncio.gather(*(calm_client(url, until, ttfts, gaps) for _ in range(clients)))

    try:
        asyncio.run(scenario())
        if attacker is not None:
            outcome.update(answer.get(timeout=SLOW_CONNECTION_S + 120))
    finally:
        if attacker is not None:
            attacker.join(timeout=10)
            if attacker.is_alive():
                attacker.kill()
    server = median_from_buckets(histogram, server_ttft(url))
    free, served = whole(url)
    rss = max(metric(url, "process_resident_memory_bytes"), default=0.0) / (1 << 20)
    return Scenario(name, len(ttfts), 1000 * statistics.median(ttfts) if ttfts else 0.0,
                    1000 * server, 1000 * max(gaps, default=0.0), dict(outcome), free, served,
                    rss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per scenario")
    parser.add_argument("--clients", type=int, default=2, help="well-behaved streaming clients")
    parser.add_argument("--out", type=Path, default=None, help="folder for attacks.json")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, among {', '.join(SCENARIOS)} (quiet always "
                             f"runs first: the reference)")
    results_table.add_argument(parser)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS) - {""}
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="tandem-attacks-") as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"calm:{CALM_KEY}\nflood:{FLOOD_KEY}\n")
        secret = Path(tmp) / "secret"
        secret.write_text("s" * 48)
        config = Path(tmp) / "tandem.yaml"
        config.write_text(f"api_keys_file: {keys}\ncluster_secret_file: {secret}\n"
                          "metrics_require_key: true\n")
        up = TandemUp(config, Path(tmp) / "up.log").start()
        try:
            slots = int(metric(up.http_url, "tandem_requests_in_flight_limit")[0])
            names = ["quiet", *(s for s in args.scenarios.split(",") if s and s != "quiet")]
            results = [run(up.http_url, name, args.duration, args.clients, slots)
                       for name in names]
        finally:
            up.stop()
    quiet = results[0]
    print("| scenario | calm requests | TTFT p50 ms (x quiet) | gateway's TTFT p50 ms (x quiet) "
          "| largest gap ms (x quiet) | attack got | KV free after | served after | "
          "gateway RSS MiB after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.name} | {r.calm_requests} | {r.ttft_p50_ms:.0f} "
              f"({r.ttft_p50_ms / max(quiet.ttft_p50_ms, 1e-9):.2f}) | "
              f"{r.server_ttft_p50_ms:.0f} "
              f"({r.server_ttft_p50_ms / max(quiet.server_ttft_p50_ms, 1e-9):.2f}) | "
              f"{r.max_gap_ms:.0f} "
              f"({r.max_gap_ms / max(quiet.max_gap_ms, 1e-9):.2f}) | "
              f"{', '.join(f'{k}: {v}' for k, v in sorted(r.attack.items())) or '-'} | "
              f"{r.blocks_free_after} | {r.served_after} | {r.gateway_rss_mib_after:.0f} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attacks.json").write_text(json.dumps([asdict(r) for r in results],
                                                          indent=1))
    if args.record:
        results_table.record([results_table.Result(
            f"hostile traffic, plain `tandem up`: {r.name}: calm clients' TTFT p50 / largest "
            f"inter-token gap (x quiet); what the attack got",
            f"{r.ttft_p50_ms:.0f} ms ({r.ttft_p50_ms / max(quiet.ttft_p50_ms, 1e-9):.2f}) / "
            f"{r.max_gap_ms:.0f} ms ({r.max_gap_ms / max(quiet.max_gap_ms, 1e-9):.2f}); "
            f"{', '.join(f'{k}: {v}' for k, v in sorted(r.attack.items())) or '-'}; after: "
            f"KV free {r.blocks_free_after}, served {r.served_after}",
            results_table.command("python -m tandem.loadtest.attacks", argv))
            for r in results], args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
