"""``tandem doctor --url``: read a cluster's /metrics over a window, answer the six questions,
rank the levers. Exit 0 with a report, 1 when no request ended in the window, 2 when the
gateway cannot be read."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tandem.services.cli import _add_client_args
from tandem.services.doctor.diagnosis import NoTraffic, diagnose
from tandem.services.doctor.evidence import EMPTY, Evidence, Scrape
from tandem.services.doctor.report import Report, write
from tandem.services.serving.status import EXIT_UNREACHABLE, GatewayReader, StatusError

EXIT_REPORT, EXIT_NO_TRAFFIC = 0, 1


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "doctor", help="answer the six serving questions from a cluster's live metrics, rank "
                       "the levers",
        description="Read the gateway's /metrics over a window; say where the time goes, how "
                    "much prefix is shared, the batch size, context lengths, KV pressure and "
                    "speculation, and rank the levers (flags, config values) by their expected "
                    "effect, with the evidence. See docs/operations.md, Doctor.")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP URL")
    _add_client_args(parser, "for --metrics-require-key")
    parser.add_argument("--window", type=float, default=30.0, metavar="S",
                        help="measure over the next S seconds of traffic (30); 0: everything "
                             "since the gateway started, from one read")
    parser.add_argument("--requests", type=int, default=0, metavar="N",
                        help="end the window once N requests have ended in it (at the latest "
                             "after --window seconds)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S",
                        help="read the gauges (batch, queue, KV) every S seconds of the window "
                             "(1)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write DIR/report.md and its PNG plots")
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S",
                        help="per request, in seconds (5)")
    parser.set_defaults(func=run)
    return parser


def collect(reader: GatewayReader, window_s: float, interval_s: float, requests: int = 0
            ) -> Evidence:
    """Reads every ``interval_s`` for ``window_s`` or until ``requests`` requests ended;
    raises ``StatusError`` when the gateway cannot be read."""
    first = _read(reader)
    if window_s <= 0:
        return Evidence(EMPTY, first, 0.0, (first,))
    until = f" or until {requests} requests end" if requests else ""
    print(f"tandem doctor: measuring {reader.url} for {window_s:g} s{until}", file=sys.stderr,
          flush=True)
    reads = [first]
    started = time.monotonic()
    end = started + window_s
    while (now := time.monotonic()) < end:
        time.sleep(min(interval_s, end - now))
        reads.append(_read(reader))
        ended = Evidence(first, reads[-1], 0.0).delta("tandem_request_success_total")
        if requests and ended >= requests:
            break
    return Evidence(first, reads[-1], time.monotonic() - started, tuple(reads))


def _read(reader: GatewayReader) -> Scrape:
    text = reader.metrics()
    try:
        return Scrape.parse(text)
    except ValueError as exc:  # the parser's: not what a Tandem gateway writes
        raise StatusError(f"{reader.url}/metrics is not Prometheus text ({exc})") from exc


def run(args: argparse.Namespace) -> int:
    try:
        reader = GatewayReader(args.url, args.api_key or None, args.cacert, args.timeout)
        evidence = collect(reader, args.window, args.interval, args.requests)
        diagnosis = diagnose(evidence)
    except StatusError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
    except NoTraffic as exc:
        print(f"tandem doctor: {exc}", file=sys.stderr, flush=True)
        return EXIT_NO_TRAFFIC
    report = Report.of(reader.url, diagnosis)
    if args.out is not None:
        path = write(args.out, report, diagnosis, evidence)
        print(f"tandem doctor: wrote {path}", file=sys.stderr, flush=True)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.markdown(),
          flush=True)
    return EXIT_REPORT
