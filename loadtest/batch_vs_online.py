"""`tandem batch` (in-process engine) against the online cluster (`tandem up --colocated`) at
saturation, on the same requests: output tokens/s of each, and their ratio.

    python -m tandem.loadtest.batch_vs_online [--requests 96] [--output-len 32] [--rounds 2]

Each round runs `tandem batch --restart` as a subprocess (the tokens/s of its summary line: the
requests' time, without loading the model), then starts `tandem up --colocated` and sends the
same requests in their input order, as many at once as the cluster admits (its default
max_in_flight: one decode batch), through the same HTTP client code (services/batch/runner.py),
timed the same way; then stops the cluster, so that the next batch round runs alone. Rounds
alternate and the medians are printed. Every request generates exactly ``--output-len`` tokens
(greedy, ``ignore_eos``); chats share a few long system prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from tandem.loadtest.tandem_up import TandemUp
from tandem.services.batch import batch_file, runner

TANDEM = Path(sys.executable).with_name("tandem")
SUMMARY = re.compile(r"(\d+) requests \((\d+) failed\).* ([\d.]+) output tokens/s")
SYSTEMS = [f"You are a patient teacher of {topic}. Answer every question in a few plain "
           f"sentences, give one example, and do not use lists or headings."
           for topic in ("history", "chemistry", "geography", "music")]
ENGINE_BATCH = 32  # max_num_seqs, in tandem batch and in the cluster alike


def batch_lines(count: int, output_len: int) -> list[dict[str, Any]]:
    lines = []
    for i in range(count):
        body: dict[str, Any] = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        if i % 4 == 3:
            url = "/v1/completions"
            body["prompt"] = f"Once upon a time, in a village by the river, lived child {i}."
        else:
            url = "/v1/chat/completions"
            body["messages"] = [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
                                {"role": "user", "content": f"Tell me about topic number {i}."}]
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body})
    return lines


def batch_round(source: Path, output: Path, threads: int) -> float:
    done = subprocess.run([str(TANDEM), "batch", "--input", str(source), "--output",
                           str(output), "--restart", "--no-progress", "--threads", str(threads)],
                          capture_output=True, text=True, check=False)
    match = SUMMARY.search(done.stderr)
    if done.returncode != 0 or match is None or match.group(2) != "0":
        raise RuntimeError(f"tandem batch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return float(match.group(3))


def online_round(requests: list[batch_file.BatchRequest], workdir: Path, threads: int) -> float:
    config = workdir / "up.yaml"
    config.write_text(f"colocated: true\nthreads_per_worker: {threads}\n"
                      f"max_num_seqs: {ENGINE_BATCH}\n")
    cluster = TandemUp(config, workdir / "up.log").start()
    try:
        async def send_all() -> runner.Summary:
            async with httpx.AsyncClient(base_url=cluster.http_url, timeout=None) as client:
                return await runner.run(requests, client, lambda line: None, ENGINE_BATCH)

        summary = asyncio.run(send_all())
    finally:
        cluster.stop()
    if summary.failed:
        raise RuntimeError(f"the cluster failed {summary.failed} requests")
    return summary.output_tokens_per_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.loadtest.batch_vs_online",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batch-vs-online-") as tmp:
        workdir = Path(tmp)
        source = workdir / "in.jsonl"
        source.write_text("".join(f"{json.dumps(line)}\n"
                                  for line in batch_lines(args.requests, args.output_len)))
        requests = batch_file.read_requests(source)  # the input order: an online client's
        batch_rates, online_rates = [], []
        for round_ in range(1, args.rounds + 1):
            batch_rates.append(batch_round(source, workdir / "out.jsonl", args.threads))
            online_rates.append(online_round(requests, workdir, args.threads))
            print(f"round {round_}: tandem batch {batch_rates[-1]:.1f}, online "
                  f"{online_rates[-1]:.1f} output tokens/s", flush=True)
    batch, online = statistics.median(batch_rates), statistics.median(online_rates)
    print(f"{args.requests} requests x {args.output_len} tokens, {args.threads} thread(s), "
          f"medians of {args.rounds} alternating rounds: tandem batch {batch:.1f}, online "
          f"(tandem up --colocated, {ENGINE_BATCH} in flight) {online:.1f} output tokens/s: "
          f"{batch / online:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
