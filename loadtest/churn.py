"""Decode worker churn: streams under load while a decode worker is killed again and again.

Starts `tandem up` (1 prefill, 2 decode workers by default), sends ``--requests`` requests of a
random workload at a fixed concurrency, and while they run SIGKILLs one decode replica every
``--kill-every`` seconds (Serve replaces it). Reports failed and cut requests (the target:
none), migrations by reason, the time from a worker's death to a migrated stream's next token
(p50/p99 from the gateway's histogram), the decode workers' prefill work over the run (tokens
recomputed vs found in their prefix caches: a migration recomputes the prompt and the tokens
sent, unless cached), and whether every KV block is free at the end.

    python -m tandem.loadtest.churn --requests 64 --kill-every 30 --out results/churn
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tandem.loadtest.bench.arrivals import Load
from tandem.loadtest.bench.cli import prompt_maker
from tandem.loadtest.bench.clients import ClientOptions, Target
from tandem.loadtest.bench.connect import make_client
from tandem.loadtest.bench.runner import run_workload
from tandem.loadtest.bench.workloads import LengthRange, WorkloadSpec, build_workload
from tandem.loadtest.tandem_up import LaunchError, TandemUp

PROG = "python -m tandem.loadtest.churn"


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/metrics as {sample name: [(labels, value)]}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return samples


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str,
          **match: str) -> float:
    return sum(v for labels, v in samples.get(name, [])
               if all(labels.get(k) == want for k, want in match.items()))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' linear interpolation over cumulative (le, count) pairs."""
    buckets = sorted(buckets)
    count = buckets[-1][1] if buckets else 0.0
    if count == 0:
        return None
    rank, lower, below = q * count, 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = le, cumulative
    return lower


def decode_replicas(root: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(root).children(recursive=True)
            if "ServeReplica:tandem:decode" in " ".join(p.cmdline())]


async def churn(up: TandemUp, args: argparse.Namespace) -> dict[str, object]:
    assert up.process is not None
    maker = prompt_maker(None)
    client = make_client(Target("tandem", "http", f"{up.http_url}/v1"),
                         ClientOptions(request_timeout_s=args.request_timeout))
    spec = WorkloadSpec(name="random", endpoint="completions", num_requests=args.requests,
                        input_len=LengthRange(args.input_len, args.input_len),
                        output_len=LengthRange(args.output_len, args.output_len))
    requests = build_workload(spec, maker, args.seed).requests
    before = scrape(up.http_url)
    kills: list[float] = []
    rng = random.Random(args.seed)

    async def killer() -> None:
        while True:
            await asyncio.sleep(args.kill_every)
            replicas = decode_replicas(up.process.pid)  # type: ignore[union-attr]
            if replicas:
                rng.choice(replicas).send_signal(signal.SIGKILL)
                kills.append(time.monotonic())
                print(f"killed a decode replica ({len(kills)})", flush=True)

    await client.preflight()
    task = asyncio.create_task(killer())
    try:
        run = await run_workload(client, requests, Load("concurrency", args.concurrency),
                                 label="churn", deadline_s=args.deadline, progress=False)
    finally:
        task.cancel()
        await client.aclose()
    after = scrape(up.http_url)
    deadline = time.monotonic() + 300
    free = False
    while time.monotonic() < deadline and not free:  # Serve replaces the last one killed
        now = scrape(up.http_url)
        blocks = {labels["worker"]: v for labels, v in now.get("tandem_kv_cache_blocks", [])}
        frees = {labels["worker"]: v for labels, v in now.get("tandem_kv_cache_free_blocks", [])}
        free = len(blocks) == 3 and blocks == frees
        await asyncio.sleep(1)
    buckets = [(float(labels["le"]), value) for labels, value in
               after.get("tandem_migration_resume_seconds_bucket", [])]
    done = [r for r in run.records if r.ok]
    return {
        "duration_s": round(run.duration_s, 1), "kills": len(kills),
        "requests_sent": len(run.records), "completed": len(done),
        "failed": sum(1 for r in run.records if not r.ok and not r.rejected),
        "cut_off_by_the_deadline": run.deadline_hit,
        "mid_stream_errors": sum(1 for r in run.records if r.mid_stream_error),
        "rejected_429": sum(1 for r in run.records if r.rejected),
        "migrations": {reason: total(after, "tandem_request_migrations_total", reason=reason)
                       - total(before, "tandem_request_migrations_total", reason=reason)
                       for reason in ("replica_gone", "unhealthy", "timeout")},
        "resume_p50_s": histogram_quantile(0.5, buckets),
        "resume_p99_s": histogram_quantile(0.99, buckets),
        "decode_prefill_tokens_looked_up": _role_delta(before, after, "queries"),
        "decode_prefill_tokens_cached": _role_delta(before, after, "hits"),
        "all_blocks_free_at_end": free,
    }


def _role_delta(before: dict[str, list[tuple[dict[str, str], float]]],
                after: dict[str, list[tuple[dict[str, str], float]]], kind: str) -> float:
    """Decode workers' prefix-cache counter (queries or hits) over the run; workers replaced
    during the run count from zero."""
    name = f"tandem_prefix_cache_{kind}_total"
    roles = {labels["worker"]: labels["role"] for labels, _ in after.get("tandem_worker_info", [])}
    old = {labels["worker"]: v for labels, v in before.get(name, [])}
    return sum(v - old.get(labels["worker"], 0.0) for labels, v in after.get(name, [])
               if roles.get(labels["worker"]) == "decode")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64, help="requests to send (64)")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills (30)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--deadline", type=float, default=900.0,
                   help="the run's limit in seconds; what is in flight then is cut (900)")
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--decode", type=int, default=2, help="decode replicas (2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/churn"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    settings = {"prefill_replicas": 1, "decode_replicas": args.decode, "kv_transport": "tcp"}
    (out / "config.yaml").write_text(yaml.safe_dump(settings))
    up = TandemUp(out / "config.yaml", out / "tandem-up.log")
    try:
        up.start()
        print(f"ready at {up.http_url}", flush=True)
        figures = asyncio.run(churn(up, args))
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        up.stop()
    (out / "churn.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
