"""``tandem plan``: size prefill and decode workers from SLOs, a profile and the live load;
show the arithmetic; patch the RayService (dry run unless ``--apply``).

Exit codes: 0 planned (and applied, or nothing to change); 1 no worker count meets the SLOs,
or no traffic to size from; 2 bad input (flags, profile, metrics files) or the gateway's
/metrics unreadable; 3 the Kubernetes API refused or could not be reached.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import urllib.error
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tandem.services.cli import _add_client_args
from tandem.services.planner import apply, observe
from tandem.services.planner.policy import decide
from tandem.services.planner.profile import load_profile, profile_from_bench, save_profile
from tandem.services.planner.sizing import SLO, Load, PlanError, plan

EXIT_OK, EXIT_NO_PLAN, EXIT_INPUT, EXIT_KUBERNETES = 0, 1, 2, 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "plan", help="size prefill and decode workers from SLOs and live metrics; apply to a "
                     "RayService",
        description="Prefill and decode worker counts that meet the TTFT and TPOT targets at "
                    "least cost, from a measured profile and the gateway's live load; with "
                    "--rayservice the patch that sets them (sent with --apply). Exit codes: 0 "
                    "planned, 1 no count meets the SLOs (or no traffic), 2 bad input or "
                    "/metrics unreadable, 3 Kubernetes API error.")
    parser.add_argument("--profile", type=Path, metavar="FILE",
                        help="one worker's capacity (JSON, from `tandem plan profile`)")
    parser.add_argument("--ttft-ms", type=float, help="mean time-to-first-token target")
    parser.add_argument("--tpot-ms", type=float, help="mean time-per-output-token target")
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the gateway's HTTP URL (its /metrics is read twice)")
    _add_client_args(parser, "for --metrics-require-key")
    parser.add_argument("--window", type=float, default=60.0, metavar="S",
                        help="seconds between the two /metrics reads (60)")
    parser.add_argument("--metrics", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="two saved /metrics texts, --window seconds apart, instead of "
                             "reading --url")
    parser.add_argument("--rayservice", metavar="NAME",
                        help="the RayService to size (without it: the plan only)")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--kubeconfig", metavar="FILE",
                        help="default: in-cluster (a pod's ServiceAccount), else ~/.kube/config")
    parser.add_argument("--context", help="a kubeconfig context")
    parser.add_argument("--apply", action="store_true",
                        help="send the patch (default: a dry run that prints it)")
    parser.add_argument("--cooldown", type=float, default=300.0, metavar="S",
                        help="no change within S seconds of the last applied one (300)")
    parser.add_argument("--margin", type=float, default=0.2,
                        help="scale down only if the plan at load × (1 + margin) is lower too "
                             "(0.2)")
    parser.add_argument("--loop", action="store_true",
                        help="plan (and apply) every --interval seconds until stopped")
    parser.add_argument("--interval", type=float, default=300.0, metavar="S",
                        help="with --loop: seconds from one round's start to the next (300)")
    parser.add_argument("--json", action="store_true", help="one JSON object per round")
    parser.set_defaults(func=run)
    steps = parser.add_subparsers(dest="plan_command")
    prof = steps.add_parser("profile", help="a profile from tandem bench results")
    prof.add_argument("results", nargs="+", type=Path, metavar="DIR",
                      help="`tandem bench --out` folders (or their results.json) of one "
                           "1 prefill + 1 decode cluster, at two concurrencies at least, one of "
                           "them 1")
    prof.add_argument("--max-num-seqs", type=int, default=None,
                      help="the decode engines' max_num_seqs (the cluster's; default "
                           "AppConfig's)")
    prof.add_argument("--out", type=Path, default=Path("profile.json"))
    prof.set_defaults(func=run_profile)
    return parser


def run_profile(args: argparse.Namespace) -> int:
    kwargs = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    profile = profile_from_bench(args.results, **kwargs)
    save_profile(profile, args.out)
    print(json.dumps(profile.to_json(), indent=2))
    print(f"profile written to {args.out}", file=sys.stderr)
    return EXIT_OK


def _load(args: argparse.Namespace) -> Load:
    if args.metrics:
        before, after = (path.read_text() for path in args.metrics)
        return observe.load_between(before, after, args.window)
    try:
        return observe.observe(args.url, args.window, args.api_key or None, args.cacert)
    except OSError as exc:  # urllib's errors, HTTP >= 400 included
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise ValueError(f"cannot read {args.url}/metrics: {reason}") from None
    except observe.NotPrometheus as exc:
        raise ValueError(f"{args.url}/metrics is {exc}") from None


def plan_round(args: argparse.Namespace, slo: SLO, api: Any, now: dt.datetime) -> dict[str, Any]:
    """One round: the load, the plan and, with --rayservice, the decision and its patch (sent
    with --apply). Raises PlanError, ValueError or apply.ApplyError."""
    profile = load_profile(args.profile)
    load = _load(args)
    report: dict[str, Any] = {"load": asdict(load)}
    if api is None:
        planned = plan(profile, load, slo)
        report |= {"plan": _plan_json(planned), "explanation": planned.steps}
        return report
    target = apply.Target(args.rayservice, args.namespace)
    obj = apply.read(api, target)
    decision = decide(profile, load, slo, apply.current_counts(obj), apply.bounds_of(obj),
                      args.margin, args.cooldown, apply.last_change(obj), now)
    patch = apply.build_patch(obj, decision.target, now) if decision.changes else None
    if patch is not None and args.apply:
        apply.send(api, target, patch)
    return report | {"plan": _plan_json(decision.planned), "current": decision.current,
                     "target": decision.target,
                     "explanation": [*decision.planned.steps, *decision.notes],
                     "patch": patch, "applied": bool(patch is not None and args.apply)}


def _plan_json(planned: Any) -> dict[str, Any]:
    return {"prefill": planned.prefill, "decode": planned.decode,
            "ttft_ms": planned.ttft_s * 1000, "tpot_ms": planned.tpot_s * 1000,
            "decode_batch": planned.decode_batch,
            "prefill_utilisation": planned.prefill_utilisation}


def _print(report: dict[str, Any], as_json: bool, dry_run: bool) -> None:
    if as_json:
        print(json.dumps(report), flush=True)
        return
    print("\n".join(report["explanation"]))
    if report.get("patch") is None:
        return
    if dry_run:
        print("dry run: the merge patch --apply would send:")
        print(json.dumps(report["patch"], indent=2))
    else:
        print("applied.")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    if args.profile is None or args.ttft_ms is None or args.tpot_ms is None:
        raise ValueError("tandem plan needs --profile, --ttft-ms and --tpot-ms")
    slo = SLO(args.ttft_ms / 1000.0, args.tpot_ms / 1000.0)
    while True:
        started = time.monotonic()
        code = _one_round(args, slo)
        if not args.loop:
            return code
        time.sleep(max(0.0, args.interval - (time.monotonic() - started)))


def _one_round(args: argparse.Namespace, slo: SLO) -> int:
    try:
        api = apply.api_client(args.kubeconfig, args.context) if args.rayservice else None
        report = plan_round(args, slo, api, dt.datetime.now(dt.UTC))
    except (PlanError, observe.NoTraffic) as exc:
        print(f"tandem plan: {exc}", file=sys.stderr, flush=True)
        return EXIT_NO_PLAN
    except apply.ApplyError as exc:
        print(f"tandem plan: {exc}", file=sys.stderr, flush=True)
        return EXIT_KUBERNETES
    except ValueError as exc:
        if not args.loop:
            raise  # tandem: error: ..., exit 2
        print(f"tandem plan: {exc}", file=sys.stderr, flush=True)
        return EXIT_INPUT
    _print(report, args.json, dry_run=not args.apply)
    return EXIT_OK
