"""Tandem configurations side by side on one workload:
``python -m tandem.loadtest.experiments NAME``.

    python -m tandem.loadtest.experiments disagg-vs-colocated --out bench-results/disagg
    python -m tandem.loadtest.experiments prefix-vs-roundrobin --out bench-results/prefix

Each experiment starts every configuration with ``tandem up --config FILE`` (a subprocess on
free loopback ports, the YAML written to ``OUT/configs/``), runs the same deterministic
workload against them in turn (``tandem bench``'s session: every round draws fresh requests
and rotates the order, so drift on a noisy machine spreads over all of them), reads the
engines' prefix-cache counters from ``/metrics`` before and after every run, stops every
server, and writes ``tandem bench``'s results.json, report.md and plots, with a headline table
of the figures the experiment is about (each against the first configuration) on top.

- ``disagg-vs-colocated``: 1 prefill + 1 decode worker, one torch thread each, against one
  colocated engine with 2 threads, with chunked prefill (the same token budget as the disagg
  workers) and without (a budget above the longest prompt plus a full decode batch); the
  long/short mix; ITL, TTFT and goodput of the short requests.
- ``prefix-vs-roundrobin``: 2 prefill + 1 decode worker under ``routing_policy`` round_robin
  and prefix; the multi-tenant shared-prefix workload; prefix-cache hit rate and TTFT.
- ``tandem-vs-vllm``: vLLM's CPU backend (``--vllm``: its own venv), and llama.cpp's
  ``llama-server`` with ``--llama-server``, against ``tandem up`` in the shapes ``--tandem``
  names (``default``: plain ``tandem up`` with no settings but the model, as users get it;
  1P+1D; colocated), each peer at its best documented CPU setting (vLLM bfloat16 with its
  threads bound to every CPU, llama.cpp with every thread), on the same
  weights (``tandem.loadtest.export_hf``; llama.cpp: the GGUF itself) and prompts; output
  tok/s, TTFT and ITL at concurrency 1, 8 and 32.
- ``tandem-vs-vllm-prefix``: the same servers on the multi-tenant shared-prefix workload
  (every tenant's system prompt cached by all of them after its first request); TTFT and the
  prefix-cache hit rate the responses report.

``python -m tandem.loadtest.peer_compare`` runs the last two and checks issue 16's targets.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from tandem.loadtest.bench import cli as bench
from tandem.loadtest.bench.clients import Target, TargetError
from tandem.loadtest.bench.compare import Metric, ratio
from tandem.loadtest.bench.metrics import Summary
from tandem.loadtest.bench.results import Cell
from tandem.loadtest.bench.server_metrics import RoleCounters
from tandem.loadtest.export_hf import export
from tandem.loadtest.peers import LlamaCppServer, VllmServer, vllm_preload
from tandem.loadtest.tandem_up import LaunchError, TandemUp, cpus_argument
from tandem.services.engine.model_loader import load_model
from tandem.services.engine.tokenizer_loader import builtin_model_path

PROG = "python -m tandem.loadtest.experiments"


@dataclass(frozen=True)
class Configuration:
    label: str
    settings: dict[str, Any]  # AppConfig fields: the YAML `tandem up --config` reads
    # "vllm" or "llama.cpp": a peer server (loadtest/peers.py) instead of tandem up
    peer: str | None = None


@dataclass(frozen=True)
class Headline:
    """One figure of the headline table.

    ``key``: a ``compare.METRICS``-style summary key ("itl.p99", "goodput",
    "request_throughput"), ``client_hit_rate`` (cached tokens in the responses' usage / input
    tokens) or ``server_hit_rate.ROLE`` (the engines' counters, per worker role)."""

    title: str
    key: str
    kind: str = "all"  # "all", or one kind of request of a mixed workload ("short", "long")
    higher_is_better: bool = False
    unit: str = "ms"  # ms | req/s | tok/s | %

    def value(self, cell: Cell) -> float | None:
        if self.key.startswith("server_hit_rate."):
            return _server_hit_rate(cell.server_cache, self.key.partition(".")[2])
        summary: Summary | None = (cell.summary if self.kind == "all"
                                   else cell.by_kind.get(self.kind))
        if summary is None:
            return None
        if self.key == "client_hit_rate":
            return summary.prefix_cache_hit_rate
        return Metric(self.key, self.title, self.higher_is_better).value(summary)

    def format(self, value: float | None) -> str:
        if value is None:
            return "-"
        if self.unit == "%":
            return f"{100 * value:.1f}%"
        return f"{value:,.2f}" if self.unit == "req/s" else f"{value:,.0f}"


def _server_hit_rate(counters: RoleCounters | None, role: str) -> float | None:
    if counters is None or role not in counters:
        return None
    return counters[role].hit_rate


@dataclass(frozen=True)
class Experiment:
    name: str
    summary: str  # one line: what is compared
    workload: str
    configurations: Callable[[argparse.Namespace], list[Configuration]]  # first: the baseline
    headline: tuple[Headline, ...]
    defaults: dict[str, Any] = field(default_factory=dict)  # bench flags' defaults


def _common(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {"dtype": args.dtype, "block_size": args.block_size,
                                "max_num_seqs": args.max_num_seqs,
                                "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.model is not None:
        settings["model"] = str(Path(args.model).resolve())
    if args.num_kv_blocks is not None:
        settings["num_kv_blocks"] = args.num_kv_blocks
    return settings


def unchunked_budget(args: argparse.Namespace) -> int:
    """A token budget no prompt of the workload is cut by, even beside a full decode batch."""
    longest = max(args.input_len.high, args.long_input_len.high)
    return max(longest, args.max_num_batched_tokens) + args.max_num_seqs


def disagg_vs_colocated(args: argparse.Namespace) -> list[Configuration]:
    common = _common(args)
    colocated = {**common, "colocated": True, "threads_per_worker": 2}
    return [
        Configuration("colocated", colocated),
        Configuration("colocated-unchunked",
                      {**colocated, "max_num_batched_tokens": unchunked_budget(args)}),
        Configuration("disagg-1p1d", {**common, "prefill_replicas": 1, "decode_replicas": 1,
                                      "threads_per_worker": 1,
                                      "kv_transport": args.kv_transport}),
    ]


# `--tandem` shapes of the peer experiments: AppConfig settings beyond the common ones.
TANDEM_SHAPES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    # plain `tandem up` as users get it: none of the bench's settings (the model only)
    "default": lambda args: {},
    "1p1d": lambda args: {"prefill_replicas": 1, "decode_replicas": 1,
                          "threads_per_worker": 1, "kv_transport": args.kv_transport},
    "colocated": lambda args: {"colocated": True, "threads_per_worker": 2},
}


def tandem_shapes(text: str) -> list[str]:
    """``--tandem``: shapes, each optionally ``:int4`` (``weight_format: int4``, bfloat16)."""
    shapes = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in shapes
               if s.removesuffix(":int4") not in TANDEM_SHAPES]
    if unknown or not shapes:
        raise argparse.ArgumentTypeError(f"--tandem takes shapes among "
                                         f"{', '.join(TANDEM_SHAPES)}, each optionally "
                                         f"with :int4, got {text!r}")
    return shapes


def _tandem(shape: str, common: dict[str, Any], args: argparse.Namespace) -> Configuration:
    base = shape.removesuffix(":int4")
    if base == "default":  # plain `tandem up`: the model, nothing else
        settings = {k: v for k, v in common.items() if k == "model"}
    else:
        settings = {**common, **TANDEM_SHAPES[base](args)}
    if shape != base:
        settings["weight_format"] = "int4"
        settings.setdefault("dtype", "bfloat16")
    return Configuration(f"tandem-{base}" + ("-int4" if shape != base else ""), settings)


def tandem_vs_vllm(args: argparse.Namespace) -> list[Configuration]:
    common = _common(args)
    # Each peer at its best documented setting for a CPU: vLLM's CPU backend in bfloat16
    # (--vllm-dtype) with its OpenMP threads bound to every CPU; llama.cpp with every thread.
    vllm = {"dtype": args.vllm_dtype, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "VLLM_CPU_OMP_THREADS_BIND": "auto (every CPU)",
            "LD_PRELOAD": " ".join(Path(p).name for p in vllm_preload(Path(args.vllm)))
                          or "none found (tcmalloc, libiomp5)"}
    peers = [Configuration("vllm-cpu", vllm, peer="vllm")]
    if args.llama_server is not None:
        peers.append(Configuration("llama.cpp", {"max_num_seqs": args.max_num_seqs,
                                                 "threads": args.llama_threads},
                                   peer="llama.cpp"))
    return peers + [_tandem(shape, common, args) for shape in args.tandem]


def prefix_vs_roundrobin(args: argparse.Namespace) -> list[Configuration]:
    workers = {**_common(args), "prefill_replicas": 2, "decode_replicas": 1,
               "threads_per_worker": 1, "kv_transport": args.kv_transport}
    return [Configuration("round-robin", {**workers, "routing_policy": "round_robin"}),
            Configuration("prefix-aware", {**workers, "routing_policy": "prefix"})]


EXPERIMENTS = {e.name: e for e in (
    Experiment(
        "disagg-vs-colocated",
        "1 prefill + 1 decode worker (1 thread each) against one colocated engine (2 threads), "
        "with and without chunked prefill, on the long/short mix",
        "mix", disagg_vs_colocated,
        (Headline("short ITL p50", "itl.p50", "short"),
         Headline("short ITL p99", "itl.p99", "short"),
         Headline("short TTFT p50", "ttft.p50", "short"),
         Headline("short TTFT p99", "ttft.p99", "short"),
         Headline("short TPOT p99", "tpot.p99", "short"),
         Headline("short goodput", "goodput", "short", True, "req/s"),
         Headline("goodput (all)", "goodput", "all", True, "req/s"),
         Headline("long TTFT p50", "ttft.p50", "long"),
         Headline("req/s (all)", "request_throughput", "all", True, "req/s")),
        {"num_requests": 12, "input_len": "64", "output_len": "24", "long_fraction": 0.25,
         "long_input_len": "768", "long_output_len": "4", "request_rate": "0.25",
         "rounds": 2, "max_num_batched_tokens": 256, "slo_ttft_ms": 2000.0,
         "slo_tpot_ms": 150.0}),
    Experiment(
        "prefix-vs-roundrobin",
        "routing_policy prefix against round_robin with 2 prefill workers (and 1 decode "
        "worker), on the multi-tenant shared-prefix workload",
        "prefix", prefix_vs_roundrobin,
        (Headline("prefill hit rate (/metrics)", "server_hit_rate.prefill", "all", True, "%"),
         Headline("hit rate (usage)", "client_hit_rate", "all", True, "%"),
         Headline("TTFT p50", "ttft.p50"),
         Headline("TTFT p99", "ttft.p99"),
         Headline("E2E p99", "e2e.p99"),
         Headline("goodput", "goodput", "all", True, "req/s"),
         Headline("req/s", "request_throughput", "all", True, "req/s")),
        {"num_requests": 24, "num_tenants": 8, "prefix_len": 384, "input_len": "32",
         "output_len": "8", "zipf_s": 1.0, "request_rate": "0.4", "rounds": 2,
         "num_kv_blocks": 160, "slo_ttft_ms": 2000.0, "slo_tpot_ms": 150.0}),
    Experiment(
        "tandem-vs-vllm",
        "vLLM's CPU backend (its own venv: --vllm), and llama.cpp's llama-server with "
        "--llama-server, against `tandem up` in the --tandem shapes (1 prefill + 1 decode "
        "worker and colocated), on the same weights (exported by our loader; llama.cpp: the "
        "GGUF) and prompts",
        "random", tandem_vs_vllm,
        (Headline("output tok/s", "output_throughput", "all", True, "tok/s"),
         Headline("TTFT p50", "ttft.p50"),
         Headline("TTFT p99", "ttft.p99"),
         Headline("ITL p50", "itl.p50"),
         Headline("ITL p99", "itl.p99"),
         Headline("req/s", "request_throughput", "all", True, "req/s")),
        {"num_requests": 32, "input_len": "200", "output_len": "64", "concurrency": "1,8,32",
         "rounds": 2}),
    Experiment(
        "tandem-vs-vllm-prefix",
        "vLLM's CPU backend (and llama.cpp's with --llama-server) against `tandem up` (the "
        "--tandem shapes) on the multi-tenant shared-prefix workload: what prefix caching "
        "buys each",
        "prefix", tandem_vs_vllm,
        (Headline("TTFT p50", "ttft.p50"),
         Headline("TTFT p99", "ttft.p99"),
         Headline("hit rate (usage)", "client_hit_rate", "all", True, "%"),
         Headline("output tok/s", "output_throughput", "all", True, "tok/s"),
         Headline("ITL p50", "itl.p50"),
         Headline("E2E p99", "e2e.p99")),
        {"num_requests": 24, "num_tenants": 4, "prefix_len": 512, "input_len": "32",
         "output_len": "16", "zipf_s": 1.0, "concurrency": "1,8", "rounds": 2}),
)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Compare Tandem configurations on one workload: start each "
        "with `tandem up`, alternate runs, write results.json, report.md and plots. See "
        "docs/loadtest.md.")
    sub = parser.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for experiment in EXPERIMENTS.values():
        p = sub.add_parser(experiment.name, help=experiment.summary,
                           description=experiment.summary)
        servers = p.add_argument_group("servers (`tandem up`)")
        servers.add_argument("--model", help="a .gguf file or a Hugging Face directory, also "
                             "the bench's tokenizer (default: the built-in model)")
        servers.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
        servers.add_argument("--block-size", type=int, default=16)
        servers.add_argument("--max-num-seqs", type=int, default=32)
        servers.add_argument("--max-num-batched-tokens", type=int, default=512,
                             help="token budget per step (chunk size) of every engine, except "
                                  "colocated-unchunked's (longest prompt + --max-num-seqs); "
                                  "disagg-vs-colocated: 256, a third of the long prompts")
        servers.add_argument("--num-kv-blocks", type=int, default=None,
                             help="KV blocks per engine (default: AppConfig's, from "
                                  "kv_cache_memory_gb)")
        servers.add_argument("--kv-transport", choices=("nixl", "tcp", "auto"), default="auto")
        servers.add_argument("--cpus", type=cpus_argument, default=None, metavar="LIST",
                             help="pin every server (and all it starts) to these CPUs with "
                                  "taskset, e.g. 0,1; the bench client stays unpinned")
        if experiment.configurations is tandem_vs_vllm:
            servers.add_argument("--vllm", type=Path, required=True,
                                 help="the Python of a venv with vllm-cpu (docs/loadtest.md)")
            servers.add_argument("--llama-server", type=Path, default=None,
                                 help="llama.cpp's llama-server binary: a peer too, on the "
                                      "GGUF file itself (docs/loadtest.md)")
            servers.add_argument("--vllm-dtype", choices=("bfloat16", "float32", "auto"),
                                 default="bfloat16",
                                 help="vLLM's --dtype (default bfloat16, its CPU backend's "
                                      "documented setting)")
            servers.add_argument("--llama-threads", type=int,
                                 default=len(os.sched_getaffinity(0)),
                                 help="llama-server's threads (default: every CPU, its "
                                      "documented setting; the bench client shares them)")
            servers.add_argument("--tandem", type=tandem_shapes,
                                 default=["default", "1p1d", "colocated"],
                                 help="Tandem's shapes, comma-separated, among "
                                      f"{', '.join(TANDEM_SHAPES)} (default: plain `tandem "
                                      "up`, none of the bench's settings), each optionally "
                                      "with :int4 (int4 weights, bfloat16) (default: "
                                      "default,1p1d,colocated)")
        servers.add_argument("--ready-timeout", type=float, default=600.0,
                             help="seconds to wait for each `tandem up` ready line")
        servers.add_argument("--metrics-settle", type=float, default=1.0, metavar="S",
                             help="before and after each run, /metrics is read until two reads "
                                  "S seconds apart agree (keep S above the gateway's 0.5 s "
                                  "worker poll)")
        bench.add_workload_arguments(p)
        bench.add_load_arguments(p, required=False)
        bench.add_output_arguments(p)
        # String defaults go through the flag's type, as argparse does for its own.
        p.set_defaults(**experiment.defaults, workload=experiment.workload, endpoint=None,
                       out=Path("bench-results") / experiment.name)
    return parser



@dataclass
class Prepared:
    experiment: Experiment
    configurations: list[Configuration]
    plan: bench.Plan


def prepare(args: argparse.Namespace) -> Prepared:
    """Check everything that can be checked before any server starts (raises ValueError)."""
    from tandem.services.serving.config import AppConfig  # validates every setting, names the field

    experiment = EXPERIMENTS[args.experiment]
    if args.workload != experiment.workload:
        raise ValueError(f"{experiment.name} runs the {experiment.workload} workload, "
                         f"not {args.workload}")
    if args.request_rate is None and args.concurrency is None:
        raise ValueError("give --request-rate or --concurrency")
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.ready_timeout <= 0 or args.metrics_settle <= 0:
        raise ValueError("--ready-timeout and --metrics-settle must be > 0")
    configurations = experiment.configurations(args)
    for conf in configurations:
        if conf.peer is None:
            AppConfig.from_dict(conf.settings, f"configuration {conf.label}")
        elif conf.peer == "vllm" and not Path(args.vllm).is_file():
            raise ValueError(f"--vllm {args.vllm}: no such file")
        elif conf.peer == "llama.cpp":
            if not Path(args.llama_server).is_file():
                raise ValueError(f"--llama-server {args.llama_server}: no such file")
            if not str(args.model or ".gguf").endswith(".gguf"):
                raise ValueError("--llama-server serves a .gguf --model only")
    bench.prompt_maker(args.model)  # the tokenizer loads (and is cached for the run)
    placeholders = [Target(c.label, "http", "http://127.0.0.1:1/v1") for c in configurations]
    plan = replace(bench.plan_for(args, placeholders, tokenizer=args.model, server_metrics=True),
                   settle_s=args.metrics_settle)
    return Prepared(experiment, configurations, plan)


def headline_rows(headline: Sequence[Headline], cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """Per cell: every headline value, and its ratio to the baseline (the first
    configuration) at the same load."""
    if not cells:
        return []
    baseline = cells[0].label
    base_at = {c.load: c for c in cells if c.label == baseline}
    rows = []
    for cell in cells:
        base = base_at.get(cell.load)
        values = {h.title: h.value(cell) for h in headline}
        ratios = {h.title: None if base is None or cell.label == baseline
                  else ratio(values[h.title], h.value(base)) for h in headline}
        rows.append({"label": cell.label, "load": cell.load.label, "baseline": baseline,
                     "values": values, "ratios": ratios})
    return rows


def render_headline(prepared: Prepared, rows: list[dict[str, Any]], command: str) -> str:
    experiment = prepared.experiment
    headline = experiment.headline
    lines = [f"# Experiment: {experiment.name}", "", experiment.summary + ".", "",
             "```sh", command, "```", "", "## Configurations (`tandem up --config`)", "",
             "| label | AppConfig settings |", "|---|---|"]
    lines += [f"| {c.label} | {_settings_text(c.settings)} |" for c in prepared.configurations]
    baseline = prepared.configurations[0].label
    lines += ["", f"## Headline (ratio: against {baseline} at the same load)", "",
              f"SLO for goodput: {prepared.plan.slo.describe()}.", "",
              "| configuration | load | " + " | ".join(h.title for h in headline) + " |",
              "|---|---|" + "---|" * len(headline)]
    for row in rows:
        cells = []
        for h in headline:
            text = h.format(row["values"][h.title])
            r = row["ratios"][h.title]
            cells.append(text if r is None else f"{text} (x{r:.2f})")
        lines.append(f"| {row['label']} | {row['load']} | " + " | ".join(cells) + " |")
    lines += ["", "Latencies in ms. The full `tandem bench` report follows.", "", ""]
    return "\n".join(lines)


def _settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


Launcher = Callable[[Configuration, Path, argparse.Namespace], Any]


def launch_tandem_up(conf: Configuration, out: Path, args: argparse.Namespace) -> Any:
    """`tandem up` with the configuration's settings, or the peer server it names."""
    log = out / "logs" / f"{conf.label}.log"
    if conf.peer == "vllm":
        model_dir = out / "hf-model"
        if not (model_dir / "config.json").exists():  # the same weights, as vLLM reads them
            export(load_model(args.model, "float32", progress=False), model_dir, "float32")
        return VllmServer(Path(args.vllm), model_dir, log, served_model_name=conf.label,
                          dtype=conf.settings["dtype"], threads="auto",
                          max_num_seqs=conf.settings["max_num_seqs"],
                          max_num_batched_tokens=conf.settings["max_num_batched_tokens"],
                          cpus=args.cpus, ready_timeout_s=args.ready_timeout).start()
    if conf.peer == "llama.cpp":  # its own weights: the GGUF as llama.cpp users run it
        gguf = Path(args.model) if args.model is not None else builtin_model_path()
        return LlamaCppServer(Path(args.llama_server), gguf, log, served_model_name=conf.label,
                              threads=args.llama_threads,
                              parallel=conf.settings["max_num_seqs"], cpus=args.cpus,
                              ready_timeout_s=args.ready_timeout).start()
    return TandemUp(out / "configs" / f"{conf.label}.yaml", log, cpus=args.cpus,
                    ready_timeout_s=args.ready_timeout).start()


def run(prepared: Prepared, args: argparse.Namespace, command: str,
        launch: Launcher = launch_tandem_up) -> int:
    """Start every configuration, run the session, stop them all, write the outputs.
    ``launch`` returns a started server with ``http_url`` and ``stop()``."""
    out: Path = args.out
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    for conf in prepared.configurations:
        (out / "configs" / f"{conf.label}.yaml").write_text(
            yaml.safe_dump(conf.settings, sort_keys=False))
    servers: list[Any] = []
    try:
        targets = []
        for conf in prepared.configurations:
            print(f"starting {conf.label}: {_settings_text(conf.settings)}", flush=True)
            server = launch(conf, out, args)
            servers.append(server)
            print(f"  ready at {server.http_url}", flush=True)
            targets.append(Target(conf.label, "http", f"{server.http_url}/v1"))
        plan = replace(prepared.plan, targets=targets)
        outcome = asyncio.run(bench.execute(plan))
    finally:
        for server in reversed(servers):
            server.stop()
    rows = headline_rows(prepared.experiment.headline, outcome.cells)
    extra = {"experiment": {
        "name": prepared.experiment.name, "command": command,
        "configurations": {c.label: c.settings for c in prepared.configurations},
        "baseline": prepared.configurations[0].label, "headline": rows}}
    bench.write_outputs(out, bench.settings_of(plan), plan.slo, outcome, extra=extra,
                        preface=render_headline(prepared, rows, command))
    for row in rows:
        figures = ", ".join(f"{h.title} {h.format(row['values'][h.title])}"
                            for h in prepared.experiment.headline)
        print(f"{row['label']} @ {row['load']}: {figures}")
    print(f"results in {out}/ (results.json, report.md, plots, configs/, logs/)")
    return 0 if any(c.summary.completed for c in outcome.cells) else 1


def main(argv: list[str] | None = None, launch: Launcher = launch_tandem_up) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        prepared = prepare(args)
        return run(prepared, args, f"{PROG} {shlex.join(argv)}", launch)
    except (ValueError, TargetError, LaunchError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
