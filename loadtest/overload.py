"""Overload: goodput, latency, rejections and the gateway's memory when `tandem up` is offered
less and more than it can serve.

    python -m tandem.loadtest.overload [--factors 0.8,2] [--duration 30] [--rounds 2] [--out DIR]

1. Starts `tandem up` (default settings: 1 prefill + 1 decode worker on the built-in model;
   ``--config FILE`` for others) on free loopback ports and finds its gateway replica process.
2. The saturating rate R_sat: after a warm-up, ``tandem bench``'s closed loop keeps C =
   max_num_seqs requests in flight (a full decode batch, under the admission bound) for
   ``--sat-batches`` x C requests; R_sat = completed requests / duration.
3. Poisson arrivals at factor x R_sat for ``--duration`` seconds, each factor once per round,
   the factors interleaved (A B A B ...): the same small workload (``--input-len`` prompt tokens,
   ``--output-len`` output tokens), fresh prompts every run. During each run the gateway
   process's RSS is sampled; /metrics is read before and after (its rejection counter, the
   admission bound).
4. Writes report.md and overload.json to ``--out`` and prints the summary table: per factor, the
   median over rounds of the goodput of admitted requests (TTFT and TPOT within the SLO), TTFT
   p50/p99 of admitted requests, the share of 429s and the gateway's peak RSS; mid-stream
   errors of admitted requests and other failures are totals over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import re
import shlex
import statistics
import sys
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tandem.loadtest.bench.arrivals import Load
from tandem.loadtest.bench.cli import prompt_maker
from tandem.loadtest.bench.clients import Client, ClientOptions, Target, TargetError
from tandem.loadtest.bench.connect import make_client
from tandem.loadtest.bench.metrics import SLO, Summary, summarize
from tandem.loadtest.bench.results import summary_json, write_results
from tandem.loadtest.bench.runner import RunResult, run_workload
from tandem.loadtest.bench.server_metrics import metrics_url
from tandem.loadtest.bench.session import step_seed
from tandem.loadtest.bench.workloads import LengthRange, WorkloadSpec, build_workload
from tandem.loadtest.tandem_up import LaunchError, TandemUp, cpus_argument
from tandem.services.protocol.bench_records import RequestRecord

PROG = "python -m tandem.loadtest.overload"
MIB = 2**20
# Ray titles a Serve replica's process ``ray::ServeReplica:<app>:<deployment>``.
GATEWAY_TITLE = re.compile(r"ServeReplica:[^:\s]+:gateway\b")
WARMUP_REQUESTS = 4
WARMUP_STEP, SATURATION_STEP = 1000, 1001  # workload seeds apart from the runs' (factor, round)


@dataclass(frozen=True)
class RunFigures:
    """One run at one offered rate."""

    factor: float  # of R_sat
    round: int
    rate: float  # offered requests/s
    sent: int
    completed: int
    rejected: int  # 429
    failed: int  # not completed, rejections left out
    mid_stream_errors: int  # failed after the 200
    duration_s: float
    request_throughput: float  # completed / duration
    good: int  # completed within the SLO
    goodput: float  # good / duration
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    peak_admitted: int  # admitted requests open at once (send to end), client-side
    server_rejected: float  # the run's increase of the gateway's rejection counter
    gateway_rss_before_mib: float
    gateway_rss_peak_mib: float

    @property
    def rejected_share(self) -> float:
        return self.rejected / self.sent if self.sent else 0.0

    @property
    def good_share(self) -> float:
        return self.good / self.sent if self.sent else 0.0


@dataclass(frozen=True)
class FactorRow:
    """Every round at one factor: medians over rounds, totals for what must not happen."""

    factor: float
    rate: float
    rounds: int
    goodput: float
    goodput_over_r_sat: float
    good_share: float  # of the requests sent
    request_throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    rejected_share: float
    mid_stream_errors: int  # total
    other_failures: int  # total: failed before any 200 (not 429), or cut off
    peak_admitted: int  # the largest
    gateway_rss_peak_mib: float
    gateway_rss_max_mib: float  # the largest over rounds


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def factor_rows(runs: list[RunFigures], r_sat: float) -> list[FactorRow]:
    """One row per factor, in first-seen order."""
    factors = list(dict.fromkeys(run.factor for run in runs))
    rows = []
    for factor in factors:
        group = [run for run in runs if run.factor == factor]
        goodput = statistics.median(run.goodput for run in group)
        rows.append(FactorRow(
            factor=factor, rate=statistics.median(run.rate for run in group), rounds=len(group),
            goodput=goodput, goodput_over_r_sat=goodput / r_sat if r_sat > 0 else 0.0,
            good_share=statistics.median(run.good_share for run in group),
            request_throughput=statistics.median(run.request_throughput for run in group),
            ttft_p50_ms=_median([run.ttft_p50_ms for run in group]),
            ttft_p99_ms=_median([run.ttft_p99_ms for run in group]),
            rejected_share=statistics.median(run.rejected_share for run in group),
            mid_stream_errors=sum(run.mid_stream_errors for run in group),
            other_failures=sum(run.failed - run.mid_stream_errors for run in group),
            peak_admitted=max(run.peak_admitted for run in group),
            gateway_rss_peak_mib=statistics.median(run.gateway_rss_peak_mib for run in group),
            gateway_rss_max_mib=max(run.gateway_rss_peak_mib for run in group)))
    return rows


def peak_admitted(records: list[RequestRecord]) -> int:
    """The most admitted requests open at once (from send to end, as the client saw them)."""
    events = sorted((t, step) for r in records if r.admitted and r.end_s is not None
                    for t, step in ((r.start_s, 1), (r.end_s, -1)))  # an end sorts first
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def gateway_process(root_pid: int) -> psutil.Process:
    """The gateway replica among the descendants of `tandem up`."""
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            if GATEWAY_TITLE.search(" ".join(proc.cmdline())):
                return proc
        except psutil.Error:
            continue
    raise LaunchError(f"no gateway replica process (ray::ServeReplica:*:gateway) under pid "
                      f"{root_pid}")


class RssSampler:
    """Samples one process's resident memory in a thread: the first sample and the peak."""

    def __init__(self, process: psutil.Process, interval_s: float) -> None:
        self.process, self.interval_s = process, interval_s
        self.first_mib = self.peak_mib = self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> float:
        return float(self.process.memory_info().rss) / MIB

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.peak_mib = max(self.peak_mib, self._sample())
            except psutil.Error:
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def gateway_counters(url: str) -> tuple[float, float | None]:
    """(requests rejected so far, the admission bound) from the gateway's /metrics."""
    text = httpx.get(url, timeout=10.0).raise_for_status().text
    rejected, limit = 0.0, None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "tandem_request_failures_total"
                    and sample.labels.get("reason") == "rejected"):
                rejected += sample.value
            elif sample.name == "tandem_requests_in_flight_limit":
                limit = sample.value
    return rejected, limit


def figures_of(run: RunResult, summary: Summary, factor: float, rss: RssSampler,
               server_rejected: float) -> RunFigures:
    ttft, tpot = summary.ttft, summary.tpot
    return RunFigures(
        factor=factor, round=run.round, rate=run.load.value, sent=len(run.records),
        completed=summary.completed, rejected=summary.rejected, failed=summary.failed,
        mid_stream_errors=summary.mid_stream_errors, duration_s=run.duration_s,
        request_throughput=summary.request_throughput, good=summary.good_requests,
        goodput=summary.goodput,
        ttft_p50_ms=None if ttft is None else ttft.p50,
        ttft_p99_ms=None if ttft is None else ttft.p99,
        tpot_p50_ms=None if tpot is None else tpot.p50,
        peak_admitted=peak_admitted(run.records), server_rejected=server_rejected,
        gateway_rss_before_mib=rss.first_mib, gateway_rss_peak_mib=rss.peak_mib)


@dataclass
class Measurement:
    r_sat: float
    saturation: Summary
    in_flight_limit: float | None
    runs: list[RunFigures]
    results: list[tuple[RunResult, Summary]]


class Bench:
    """One client against the started server, and the workload every run draws from."""

    def __init__(self, args: argparse.Namespace, url: str, gateway: psutil.Process,
                 tokenizer: str | None) -> None:
        self.args, self.gateway = args, gateway
        self.metrics = metrics_url(url)
        self.maker = prompt_maker(tokenizer)
        tok = self.maker.tokenizer
        options = ClientOptions(request_timeout_s=args.request_timeout, count_tokens=lambda t:
                                len(tok.encode(t, add_special_tokens=False)))
        self.client: Client = make_client(Target("tandem", "http", f"{url}/v1"), options)
        self.spec = WorkloadSpec(name="random", endpoint="completions", num_requests=1,
                                 input_len=LengthRange(args.input_len, args.input_len),
                                 output_len=LengthRange(args.output_len, args.output_len))
        self.slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)

    async def run(self, load: Load, num_requests: int, seed: int, label: str,
                  round_: int = 0) -> RunResult:
        requests = build_workload(replace(self.spec, num_requests=num_requests), self.maker,
                                  seed).requests
        return await run_workload(self.client, requests, load, label=label, round_=round_,
                                  deadline_s=self.args.timeout, arrival_seed=seed,
                                  progress=False)

    async def measure(self) -> Measurement:
        try:
            return await self._measure()
        finally:
            await self.client.aclose()

    async def _measure(self) -> Measurement:
        args = self.args
        await self.client.preflight()
        await self.run(Load("concurrency", WARMUP_REQUESTS), WARMUP_REQUESTS,
                       step_seed(args.seed, WARMUP_STEP, 0), "warm-up")
        concurrency = args.sat_concurrency
        sat = await self.run(Load("concurrency", concurrency), args.sat_batches * concurrency,
                             step_seed(args.seed, SATURATION_STEP, 0), "saturation")
        saturation = summarize(sat.records, sat.duration_s, self.slo)
        if saturation.completed == 0 or saturation.rejected:
            raise TargetError(f"the saturation run completed {saturation.completed} and had "
                              f"{saturation.rejected} rejected: lower --sat-concurrency")
        r_sat = saturation.request_throughput
        _, limit = gateway_counters(self.metrics)
        print(f"R_sat = {r_sat:.2f} req/s (concurrency {concurrency}, {saturation.completed} "
              f"requests in {sat.duration_s:.1f} s); admission bound {limit}", flush=True)
        runs, results = [], []
        for round_ in range(args.rounds):
            for index, factor in enumerate(args.factors):
                rate = factor * r_sat
                rejected_before, _ = gateway_counters(self.metrics)
                with RssSampler(self.gateway, args.rss_interval) as rss:
                    run = await self.run(Load("rate", rate), max(1, round(rate * args.duration)),
                                         step_seed(args.seed, index, round_),
                                         f"{factor:g}x R_sat", round_)
                rejected_after, _ = gateway_counters(self.metrics)
                summary = summarize(run.records, run.duration_s, self.slo)
                figures = figures_of(run, summary, factor, rss, rejected_after - rejected_before)
                runs.append(figures)
                results.append((run, summary))
                print(f"[round {round_}] {factor:g}x R_sat ({rate:.2f} req/s): "
                      f"{figures.sent} sent, {figures.completed} completed, "
                      f"{figures.rejected} rejected, goodput {figures.goodput:.2f} req/s, "
                      f"gateway RSS peak {figures.gateway_rss_peak_mib:.0f} MiB "
                      f"in {run.duration_s:.1f} s", flush=True)
        return Measurement(r_sat, saturation, limit, runs, results)


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render_table(rows: list[FactorRow]) -> str:
    lines = ["| load | offered req/s | rounds | goodput req/s | goodput / R_sat | within SLO "
             "| completed req/s | TTFT p50 ms | TTFT p99 ms | 429 share | mid-stream errors | "
             "other failures | peak admitted in flight | gateway peak RSS MiB (max) |",
             "|---|" + "---|" * 13]
    lines += [f"| {r.factor:g} x R_sat | {r.rate:.2f} | {r.rounds} | {r.goodput:.2f} | "
              f"{r.goodput_over_r_sat:.2f} | {100 * r.good_share:.0f}% | "
              f"{r.request_throughput:.2f} | {_f(r.ttft_p50_ms)} | "
              f"{_f(r.ttft_p99_ms)} | {100 * r.rejected_share:.1f}% | {r.mid_stream_errors} | "
              f"{r.other_failures} | {r.peak_admitted} | {r.gateway_rss_peak_mib:.0f} "
              f"({r.gateway_rss_max_mib:.0f}) |" for r in rows]
    return "\n".join(lines) + "\n"


def render_report(m: Measurement, rows: list[FactorRow], settings: dict[str, Any],
                  args: argparse.Namespace, command: str) -> str:
    sat = m.saturation
    per_run = ["| load | round | offered req/s | sent | completed | rejected (server) | "
               "failed | goodput req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
               "gateway RSS before / peak MiB | duration s |", "|---|" + "---|" * 12]
    per_run += [f"| {r.factor:g} x R_sat | {r.round} | {r.rate:.2f} | {r.sent} | {r.completed} | "
                f"{r.rejected} ({_f(r.server_rejected)}) | {r.failed} | {r.goodput:.2f} | "
                f"{_f(r.ttft_p50_ms)} | {_f(r.ttft_p99_ms)} | {_f(r.tpot_p50_ms)} | "
                f"{r.gateway_rss_before_mib:.0f} / {r.gateway_rss_peak_mib:.0f} | "
                f"{r.duration_s:.1f} |" for r in m.runs]
    lines = [
        "# Overload: admission control on `tandem up`", "", "```sh", command, "```", "",
        f"- **tandem up settings** (`--config`): {settings or 'defaults'}; admission bound "
        f"(`tandem_requests_in_flight_limit`): {_f(m.in_flight_limit)}",
        f"- **workload**: random prompts of {args.input_len} tokens, {args.output_len} output "
        f"tokens (ignore_eos), /v1/completions streaming",
        f"- **R_sat = {m.r_sat:.2f} req/s**: closed loop at concurrency {args.sat_concurrency}, "
        f"{sat.completed} requests in {sat.duration_s:.1f} s (TTFT p50 "
        f"{_f(sat.ttft.p50 if sat.ttft else None)} ms)",
        f"- **runs**: Poisson arrivals for {args.duration:g} s at each factor x R_sat, "
        f"{args.rounds} rounds, factors interleaved ({', '.join(f'{f:g}' for f in args.factors)}"
        " per round)",
        f"- **goodput SLO**: {SLO(args.slo_ttft_ms, args.slo_tpot_ms).describe()}; goodput = "
        "admitted requests completed within it / run duration",
        "", "## Summary (medians over rounds; errors and failures: totals)", "",
        render_table(rows),
        "Goodput and completed req/s divide by the run's duration, from the first send to "
        "the last response, tail included: in short runs they stay below the offered rate even "
        "when every request is good. Within SLO (admitted requests completed within the SLO / "
        "requests sent) has no such bias. "
        "429 share: rejected / sent. Mid-stream errors: admitted (HTTP 200) requests that then "
        "failed; must be 0. Other failures: neither completed nor rejected, and never admitted. "
        "Peak admitted in flight: client-side, from each admitted request's send to the end of "
        "its stream as the client read it, so it can exceed the bound by a few.", "",
        *_fill_note(m, args),
        "## Every run", "", *per_run, "",
        "Rejected (server): the run's increase of "
        "`tandem_request_failures_total{reason=\"rejected\"}`.", ""]
    return "\n".join(lines)


def _fill_note(m: Measurement, args: argparse.Namespace) -> list[str]:
    """When the admission bound can be reached: above R_sat, requests pile up at about
    (factor - 1) x R_sat per second."""
    over = [f for f in args.factors if f > 1]
    if m.in_flight_limit is None or not over or m.r_sat <= 0:
        return []
    times = ", ".join(f"{f:g} x: {m.in_flight_limit / ((f - 1) * m.r_sat):.0f} s" for f in over)
    return [f"Above R_sat, requests pile up at about (factor - 1) x R_sat per second, so the "
            f"bound of {m.in_flight_limit:.0f} is reached only after roughly ({times}) of "
            f"arrivals (each run: {args.duration:g} s); before that, only bursts get 429s.", ""]


def _factors(text: str) -> list[float]:
    try:
        factors = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"factors are numbers like 0.8,2: {text!r}") from None
    if not factors or any(not f > 0 for f in factors):
        raise argparse.ArgumentTypeError(f"factors must be > 0: {text!r}")
    return factors



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Goodput, TTFT, 429s and the gateway's "
                                "RSS below and above the saturating rate of `tandem up`. See "
                                "docs/loadtest.md.")
    p.add_argument("--config", type=Path, help="AppConfig YAML for `tandem up` (default: its "
                   "defaults, 1 prefill + 1 decode worker on the built-in model)")
    p.add_argument("--factors", type=_factors, default=[0.8, 2.0],
                   help="offered rates as multiples of R_sat, e.g. 0.8,2,10")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds of arrivals per run (requests = rate x duration)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=100, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="output tokens")
    p.add_argument("--sat-concurrency", type=int, default=None,
                   help="requests in flight for R_sat (default: max_num_seqs)")
    p.add_argument("--sat-batches", type=int, default=2,
                   help="R_sat's run sends this many x --sat-concurrency requests")
    p.add_argument("--slo-ttft-ms", type=float, default=2500.0)
    # 0.5 s, not 0.2 s: a full decode batch on a loaded 2-core box steps in about 0.4 s.
    p.add_argument("--slo-tpot-ms", type=float, default=500.0)
    p.add_argument("--rss-interval", type=float, default=0.25, help="seconds between samples")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each run (s)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus", type=cpus_argument, default=None, help="pin `tandem up` (taskset -c)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("bench-results/overload"))
    return p


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `tandem up` settings, checked, and the admission-free concurrency for R_sat."""
    from tandem.services.serving.config import AppConfig

    settings: dict[str, Any] = {}
    if args.config is not None:
        settings = yaml.safe_load(args.config.read_text()) or {}
    app = AppConfig.from_dict(settings, str(args.config or "defaults"))
    if args.sat_concurrency is None:
        args.sat_concurrency = min(app.max_num_seqs * (1 if app.colocated
                                                       else app.decode_replicas),
                                   app.in_flight_limit())
    for name in ("duration", "rounds", "input_len", "output_len", "sat_concurrency",
                 "sat_batches", "slo_ttft_ms", "slo_tpot_ms", "rss_interval", "timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    return settings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    command = f"{PROG} {shlex.join(argv)}"
    try:
        settings = _settings(args)
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
        up = TandemUp(out / "config.yaml", out / "tandem-up.log", cpus=args.cpus,
                      ready_timeout_s=args.ready_timeout)
        print(f"starting tandem up ({settings or 'defaults'})", flush=True)
        try:
            up.start()
            assert up.process is not None
            print(f"ready at {up.http_url} in {up.ready_s:.0f} s", flush=True)
            bench = Bench(args, up.http_url, gateway_process(up.process.pid),
                          settings.get("model"))
            measurement = asyncio.run(bench.measure())
        finally:
            up.stop()
    except (ValueError, TargetError, LaunchError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    rows = factor_rows(measurement.runs, measurement.r_sat)
    write_outputs(out, measurement, rows, settings, args, command)
    print(render_table(rows), end="")
    print(f"report in {out}/report.md, figures in {out}/overload.json")
    return 0


def write_outputs(out: Path, m: Measurement, rows: list[FactorRow], settings: dict[str, Any],
                  args: argparse.Namespace, command: str) -> None:
    document = {
        "tool": PROG, "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command, "settings": settings,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "r_sat": m.r_sat, "saturation": summary_json(m.saturation),
        "in_flight_limit": m.in_flight_limit, "summary": [asdict(row) for row in rows],
        "runs": [{**asdict(figures), "summary": summary_json(summary),
                  "records": [r.to_json() for r in run.records]}
                 for figures, (run, summary) in zip(m.runs, m.results, strict=True)],
    }
    write_results(out / "overload.json", document)
    (out / "report.md").write_text(render_report(m, rows, settings, args, command))


if __name__ == "__main__":
    raise SystemExit(main())
