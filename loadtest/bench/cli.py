"""``tandem bench``: load-test any OpenAI-compatible server (or Tandem's gRPC API).

    tandem bench --base-url http://127.0.0.1:8000 --workload random --num-requests 200 \\
        --request-rate 2,4,8 --input-len 256 --output-len 64 --slo-ttft-ms 500 \\
        --slo-tpot-ms 50 --out results/
    tandem bench compare --target tandem=http://127.0.0.1:8000 --target peer=http://... \\
        --workload mix --concurrency 4 --rounds 2 --out results/

Wiring into another argparse CLI: ``add_parser(subparsers)``, then call ``args.func(args)``.
Drivers that start their own servers (``loadtest/experiments.py``) reuse the argument groups
(``add_workload_arguments`` ...), ``plan_for``, ``execute`` and ``write_outputs``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from tandem.loadtest.bench.arrivals import Load, parse_concurrency, parse_rate
from tandem.loadtest.bench.clients import Client, ClientOptions, Target, TargetError
from tandem.loadtest.bench.compare import comparison
from tandem.loadtest.bench.connect import make_client
from tandem.loadtest.bench.metrics import SLO
from tandem.loadtest.bench.plots import write_plots
from tandem.loadtest.bench.prompts import PromptMaker
from tandem.loadtest.bench.report import render_report, write_report
from tandem.loadtest.bench.results import Cell, pool, results_document, write_results
from tandem.loadtest.bench.server_metrics import CacheProbe, metrics_url
from tandem.loadtest.bench.session import run_session
from tandem.loadtest.bench.workloads import WORKLOADS, LengthRange, WorkloadSpec
from tandem.services.engine.tokenizer_loader import load_tokenizer

PROG = "tandem bench"
T = TypeVar("T")


def _list_of(parse: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type for comma-separated values (a sweep)."""

    def parse_list(text: str) -> list[T]:
        try:
            return [parse(part.strip()) for part in text.split(",")]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_list


def _checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    def run(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return run


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise ValueError(f"must be > 0, got {text}")
        return value

    return _checked(parse)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", nargs="?", choices=("run", "compare"), default="run",
                        help="run: one target (default); compare: several targets in turn")
    where = parser.add_argument_group("target")
    where.add_argument("--base-url", help="the server: http(s)://HOST:PORT[/v1], or "
                       "grpc://HOST:PORT with --protocol grpc")
    where.add_argument("--target", action="append", default=[], metavar="LABEL=URL",
                       help="compare mode: a labelled target (repeat; the first is the baseline)")
    where.add_argument("--label", help="run mode: the target's name in the report")
    where.add_argument("--protocol", choices=("http", "grpc"), default=None,
                       help="default: grpc for grpc:// URLs, else http")
    where.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                       help="OpenAI API to call (default: chat for the chat workload, "
                            "else completions)")
    where.add_argument("--model", help="model name to send (default: the server's first "
                       "model from /v1/models)")
    where.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="bearer token (default: $OPENAI_API_KEY)")
    where.add_argument("--tokenizer", help="the target model's tokenizer: a .gguf file or a "
                       "Hugging Face directory (default: the built-in model's)")
    where.add_argument("--server-metrics", action="store_true",
                       help="Tandem targets over HTTP: read the engines' prefix-cache counters "
                            "from /metrics before and after every run")
    add_workload_arguments(parser)
    add_load_arguments(parser)
    add_output_arguments(parser)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    work.add_argument("--num-requests", type=_positive(int), default=100)
    work.add_argument("--input-len", type=_checked(LengthRange.parse),
                      default=LengthRange(256, 256), metavar="N|LOW:HIGH",
                      help="prompt tokens (chat: per user message)")
    work.add_argument("--output-len", type=_checked(LengthRange.parse),
                      default=LengthRange(64, 64), metavar="N|LOW:HIGH",
                      help="output tokens (max_tokens, with ignore_eos)")
    work.add_argument("--prefix-len", type=_positive(int), default=512,
                      help="prefix: tokens of each tenant's shared system prompt")
    work.add_argument("--num-tenants", type=_positive(int), default=8)
    work.add_argument("--zipf-s", type=float, default=1.0,
                      help="prefix: tenant k is chosen with weight 1/(k+1)^s")
    work.add_argument("--num-turns", type=_positive(int), default=4, help="chat: turns per "
                      "conversation")
    work.add_argument("--long-fraction", type=float, default=0.1,
                      help="mix: fraction of long requests")
    work.add_argument("--long-input-len", type=_checked(LengthRange.parse),
                      default=LengthRange(2048, 2048), metavar="N|LOW:HIGH")
    work.add_argument("--long-output-len", type=_checked(LengthRange.parse), default=None,
                      metavar="N|LOW:HIGH", help="mix: default --output-len")
    work.add_argument("--seed", type=int, default=0)


def add_load_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    load = parser.add_argument_group("load (one of; a comma-separated list sweeps)")
    loads = load.add_mutually_exclusive_group(required=required)
    loads.add_argument("--concurrency", type=_list_of(parse_concurrency), metavar="C[,C...]",
                       help="requests kept in flight")
    loads.add_argument("--request-rate", type=_list_of(parse_rate), metavar="R[,R...]",
                       help="requests per second (Poisson or gamma arrivals; 'inf': all at once)")
    load.add_argument("--burstiness", type=_positive(float), default=1.0,
                      help="gamma shape of inter-arrival gaps: 1 Poisson, < 1 burstier")
    load.add_argument("--rounds", type=_positive(int), default=1,
                      help="passes per target and load (alternating between targets)")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    limits = parser.add_argument_group("limits and outputs")
    limits.add_argument("--timeout", type=_positive(float), default=600.0,
                        help="deadline in seconds for each run (target x load x round)")
    limits.add_argument("--request-timeout", type=_positive(float), default=300.0)
    limits.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly the requested output length")
    limits.add_argument("--temperature", type=float, default=0.0)
    limits.add_argument("--slo-ttft-ms", type=_positive(float), default=None)
    limits.add_argument("--slo-tpot-ms", type=_positive(float), default=None)
    limits.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for results.json, report.md and the plots")
    limits.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to a CLI's subcommands; its handler is ``args.func``."""
    parser = subparsers.add_parser(
        "bench", help="load-test an OpenAI-compatible server or Tandem's gRPC API",
        description="Load-test a server with a workload; write results.json, report.md and "
                    "PNG plots. See docs/loadtest.md.")
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


@dataclass
class Plan:
    targets: list[Target]
    spec: WorkloadSpec
    loads: list[Load]
    slo: SLO
    options: ClientOptions
    seed: int = 0
    rounds: int = 1
    deadline_s: float = 600.0
    progress: bool = True
    tokenizer: str | None = None  # path; None: the built-in model's
    server_metrics: bool = False
    # Two scrapes this far apart must agree (Tandem's gateway polls its workers every 0.5 s).
    settle_s: float = 1.0


@dataclass
class Outcome:
    cells: list[Cell]
    comparison: list[dict[str, Any]] | None
    targets: list[dict[str, Any]]  # label, protocol, address, model


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The workload from the ``add_workload_arguments`` flags (checked)."""
    endpoint = args.endpoint or ("chat" if args.workload == "chat" else "completions")
    spec = WorkloadSpec(
        name=args.workload, endpoint=endpoint, num_requests=args.num_requests,
        input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len,
        num_tenants=args.num_tenants, zipf_s=args.zipf_s, num_turns=args.num_turns,
        long_fraction=args.long_fraction, long_input_len=args.long_input_len,
        long_output_len=args.long_output_len)
    spec.check()
    return spec


def loads_of(args: argparse.Namespace) -> list[Load]:
    if args.concurrency is not None:
        return [Load("concurrency", c) for c in args.concurrency]
    return [Load("rate", r, args.burstiness) for r in args.request_rate]


def plan_for(args: argparse.Namespace, targets: list[Target], *, model: str | None = None,
             api_key: str | None = None, tokenizer: str | None = None,
             server_metrics: bool = False) -> Plan:
    """A plan from the workload, load and output flags, against ``targets``."""
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise ValueError(f"target labels must differ: {labels}")
    if server_metrics and any(t.protocol != "http" for t in targets):
        raise ValueError("--server-metrics reads /metrics over HTTP: give http:// targets")
    spec = workload_spec(args)
    options = ClientOptions(endpoint=spec.endpoint, model=model, api_key=api_key,
                            ignore_eos=args.ignore_eos, temperature=args.temperature,
                            request_timeout_s=args.request_timeout)
    return Plan(targets, spec, loads_of(args), SLO(args.slo_ttft_ms, args.slo_tpot_ms), options,
                seed=args.seed, rounds=args.rounds, deadline_s=args.timeout,
                progress=not args.no_progress, tokenizer=tokenizer,
                server_metrics=server_metrics)


def _plan(args: argparse.Namespace) -> Plan:
    if args.mode == "compare":
        if args.base_url or len(args.target) < 2:
            raise ValueError("compare needs two or more --target LABEL=URL (and no --base-url)")
        targets = [Target.parse(t, args.protocol) for t in args.target]
    else:
        if args.target or not args.base_url:
            raise ValueError("give the server with --base-url URL (several targets: "
                             f"`{PROG} compare --target A=URL --target B=URL`)")
        given = f"{args.label}={args.base_url}" if args.label else args.base_url
        targets = [Target.parse(given, args.protocol)]
    return plan_for(args, targets, model=args.model, api_key=args.api_key,
                    tokenizer=args.tokenizer, server_metrics=args.server_metrics)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when requests completed, 1 when none did, 2 on bad input."""
    try:
        plan = _plan(args)
        args.out.mkdir(parents=True, exist_ok=True)
        outcome = asyncio.run(execute(plan))
        write_outputs(args.out, settings_of(plan), plan.slo, outcome)
    except (ValueError, TargetError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print_summary(outcome.cells, args.out)
    return 0 if any(c.summary.completed for c in outcome.cells) else 1


@functools.lru_cache(maxsize=4)
def prompt_maker(tokenizer_path: str | None) -> PromptMaker:
    # Cached so that repeated in-process runs (tests, scripts) read the vocabulary once.
    return PromptMaker(load_tokenizer(tokenizer_path))


async def execute(plan: Plan) -> Outcome:
    """Check every target answers, then run the session and pool its runs."""
    maker = prompt_maker(plan.tokenizer)
    tokenizer = maker.tokenizer
    options = replace(plan.options, count_tokens=lambda text: len(
        tokenizer.encode(text, add_special_tokens=False)))
    clients: list[tuple[str, Client]] = []
    probe = (CacheProbe({t.label: metrics_url(t.address) for t in plan.targets}, plan.settle_s)
             if plan.server_metrics else None)
    try:
        for target in plan.targets:
            clients.append((target.label, make_client(target, options)))
        models = await asyncio.gather(*(client.preflight() for _, client in clients))
        runs = await run_session(clients, plan.loads, plan.spec, maker, seed=plan.seed,
                                 rounds=plan.rounds, deadline_s=plan.deadline_s,
                                 progress=plan.progress, cache_probe=probe)
    finally:
        await asyncio.gather(*(client.aclose() for _, client in clients))
        if probe is not None:
            await probe.aclose()
    cells = pool(runs, plan.slo)
    ratios = comparison(cells) if len(plan.targets) > 1 else None
    targets = [{"label": t.label, "protocol": t.protocol, "address": t.address, "model": m}
               for t, m in zip(plan.targets, models, strict=True)]
    return Outcome(cells, ratios, targets)


def write_outputs(out: Path, settings: dict[str, Any], slo: SLO, outcome: Outcome, *,
                  extra: dict[str, Any] | None = None, preface: str = "") -> None:
    """results.json (with ``extra`` keys added), report.md (after ``preface``) and the plots."""
    document = results_document({**settings, "targets": outcome.targets}, slo, outcome.cells,
                                outcome.comparison)
    write_results(out / "results.json", {**document, **(extra or {})})
    report = render_report(settings, outcome.targets, slo, outcome.cells, outcome.comparison)
    write_report(out / "report.md", preface + report)
    write_plots(out, outcome.cells)


def settings_of(plan: Plan) -> dict[str, Any]:
    spec = plan.spec
    workload: dict[str, Any] = {"workload": spec.name, "endpoint": spec.endpoint,
                                "num_requests": spec.num_requests,
                                "input_len": str(spec.input_len),
                                "output_len": str(spec.output_len)}
    if spec.name == "prefix":
        workload |= {"prefix_len": spec.prefix_len, "num_tenants": spec.num_tenants,
                     "zipf_s": spec.zipf_s}
    elif spec.name == "chat":
        workload |= {"num_turns": spec.num_turns}
    elif spec.name == "mix":
        workload |= {"long_fraction": spec.long_fraction,
                     "long_input_len": str(spec.long_input_len),
                     "long_output_len": str(spec.long_output_len or spec.output_len)}
    return {**workload, "loads": ", ".join(load.label for load in plan.loads),
            "rounds": plan.rounds, "seed": plan.seed, "ignore_eos": plan.options.ignore_eos,
            "temperature": plan.options.temperature, "tokenizer": plan.tokenizer or "built-in",
            "deadline_s": plan.deadline_s}


def print_summary(cells: list[Cell], out: Path) -> None:
    for cell in cells:
        s = cell.summary
        ttft = "-" if s.ttft is None else f"{s.ttft.p50:.1f}/{s.ttft.p99:.1f}"
        itl = "-" if s.itl is None else f"{s.itl.p50:.1f}/{s.itl.p99:.1f}"
        rejected = f"{s.rejected} rejected (429), " if s.rejected else ""
        print(f"{cell.label} @ {cell.load.label}: {s.completed}/{s.requests} ok, {rejected}"
              f"{s.request_throughput:.2f} req/s, goodput {s.goodput:.2f} req/s, "
              f"{s.output_throughput:.1f} out tok/s, TTFT p50/p99 {ttft} ms, "
              f"ITL p50/p99 {itl} ms")
    print(f"results in {out}/ (results.json, report.md, plots)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.loadtest.bench",
        description="Load-test a server with a workload; write results.json, report.md and "
                    "PNG plots. See docs/loadtest.md.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
