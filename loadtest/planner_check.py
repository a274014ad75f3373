"""The planner's model against measurement: ``python -m tandem.loadtest.planner_check``.

Starts `tandem up` (1 prefill + 1 decode worker, the built-in model), profiles it with
`tandem bench` at a few concurrencies (``tandem plan profile``'s fit), predicts the mean TTFT
and TPOT of that 1P+1D shape at two Poisson arrival rates with the planner's own formulas
(``services/planner/sizing.py``), measures them with `tandem bench --request-rate`, and writes
a Markdown table (predicted vs measured, ratio) to ``--out/planner_check.md``, with the load
``tandem plan`` reads from the gateway's /metrics over each run beside the offered one. Nothing
is asserted: one machine's noise is the point of looking.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tandem.loadtest.bench.cli import main as bench
from tandem.loadtest.tandem_up import TandemUp, cpus_argument
from tandem.services.planner.observe import load_between
from tandem.services.planner.profile import profile_from_bench, save_profile
from tandem.services.planner.sizing import Load, Profile, decode_batch, prefill_ttft
from tandem.services.serving.up_stats import read_text


def predict(profile: Profile, load: Load) -> tuple[float, float]:
    """Mean TTFT and TPOT (s) with 1 prefill and 1 decode worker."""
    return (prefill_ttft(profile, load, 1).ttft_s,
            profile.itl(decode_batch(profile, load, 1)))


def measured(results: Path) -> dict[str, Any]:
    """One rate's run: mean TTFT and TPOT (s) and the requests completed."""
    (cell,) = json.loads((results / "results.json").read_text())["cells"]
    summary = cell["summary"]
    return {"ttft": summary["ttft"]["mean"] / 1000, "tpot": summary["tpot"]["mean"] / 1000,
            "completed": summary["completed"], "requests": summary["requests"]}


def observed_run(url: str, out: Path, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """Bench one rate; the gateway's /metrics read before and after it, as `tandem plan`
    reads them (the load it would size from)."""
    metrics = f"{url}/metrics"
    before, started = read_text(metrics, {}, None), time.monotonic()
    result = measured(_bench(url, out, ["--request-rate", f"{rate:g}"], args, args.requests))
    seen = load_between(before, read_text(metrics, {}, None), time.monotonic() - started)
    return result | {"seen": seen}


def _bench(url: str, out: Path, load: list[str], args: argparse.Namespace,
           requests: int) -> Path:
    argv = ["--base-url", url, "--input-len", args.input_len, "--output-len",
            str(args.output_len), "--num-requests", str(requests), "--seed", str(args.seed),
            "--no-progress", "--out", str(out), *load]
    if bench(argv) != 0:
        raise RuntimeError(f"tandem bench {' '.join(argv)} failed")
    return out


def table(profile: Profile, load: Load, rows: list[tuple[float, tuple[float, float],
                                                         dict[str, Any]]]) -> str:
    lines = ["| λ (req/s) | prefill ρ | TTFT predicted | TTFT measured | ratio | "
             "TPOT predicted | TPOT measured | ratio | completed | /metrics saw λ, L_in, L_out |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rate, (ttft, tpot), got in rows:
        rho = prefill_ttft(profile, load.scaled(rate / load.rate), 1).utilisation
        seen = got["seen"]
        lines.append(f"| {rate:g} | {rho:.2f} | {ttft * 1000:.0f} ms | {got['ttft'] * 1000:.0f} ms"
                     f" | {got['ttft'] / ttft:.2f} | {tpot * 1000:.1f} ms | "
                     f"{got['tpot'] * 1000:.1f} ms | {got['tpot'] / tpot:.2f} | "
                     f"{got['completed']}/{got['requests']} | {seen.rate:.2f}, "
                     f"{seen.prompt_tokens:.0f}, {seen.output_tokens:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.loadtest.planner_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/planner-check"))
    parser.add_argument("--input-len", default="32:160", help="prompt tokens, LOW:HIGH (a "
                        "spread lets the profile separate the fixed part of TTFT)")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", default="1,4", help="profile concurrencies (1 first)")
    parser.add_argument("--profile-requests", type=int, default=12)
    parser.add_argument("--requests", type=int, default=16, help="per arrival rate")
    parser.add_argument("--utilisation", default="0.25,0.5",
                        help="the two rates, as fractions of the 1P+1D capacity the profile "
                             "predicts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus", type=cpus_argument, default=None,
                        help="pin `tandem up` (taskset -c)")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.yaml"
    config.write_text(yaml.safe_dump({"prefill_replicas": 1, "decode_replicas": 1}))
    up = TandemUp(config, out / "tandem-up.log", cpus=args.cpus).start()
    try:
        profile_dir = _bench(up.http_url, out / "profile", ["--concurrency", args.concurrency],
                             args, args.profile_requests)
        profile = profile_from_bench([profile_dir])
        save_profile(profile, out / "profile.json")
        low, high = (int(x) for x in args.input_len.split(":"))
        load = Load(rate=1.0, prompt_tokens=(low + high) / 2, output_tokens=args.output_len)
        service = prefill_ttft(profile, load, 1).service_s
        capacity = min(1.0 / service, 1.0 / (args.output_len * max(profile.itl_per_seq_s, 1e-9)))
        rates = [round(float(f) * capacity, 2) for f in args.utilisation.split(",")]
        predictions = {r: predict(profile, load.scaled(r)) for r in rates}
        got = {r: observed_run(up.http_url, out / f"rate-{r:g}", r, args) for r in rates}
    finally:
        up.stop()
    rows = [(r, predictions[r], got[r]) for r in rates]
    command = "python -m tandem.loadtest.planner_check " + shlex.join(argv or sys.argv[1:])
    report = "\n".join([
        "# Planner check: predicted vs measured, 1 prefill + 1 decode, built-in model", "",
        f"`{command.strip()}`", "",
        f"Profile: prefill {profile.prefill_tokens_per_s:.0f} tokens/s + "
        f"{profile.prefill_overhead_s * 1000:.1f} ms; ITL(b) = {profile.itl_base_s * 1000:.1f} + "
        f"{profile.itl_per_seq_s * 1000:.2f}·b ms (from concurrency {args.concurrency}). "
        f"Load: L_in {load.prompt_tokens:.0f}, L_out {args.output_len}, Poisson arrivals, "
        f"{args.requests} requests per rate. Means (the planner's targets are means). The last "
        f"column: the load `tandem plan` reads from the gateway's /metrics over each run (its "
        f"window includes the bench's start, so λ reads low).", "",
        table(profile, load, rows), ""])
    (out / "planner_check.md").write_text(report)
    print(report)
    print(f"median TTFT ratio {statistics.median(g['ttft'] / p[0] for _, p, g in rows):.2f}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
