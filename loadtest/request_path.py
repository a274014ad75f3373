"""Which of Tandem's modules run code while one streamed chat request is served, in every process
of a `tandem up` cluster (docs/architecture.md, "One streamed request").

Every Python process the cluster starts (the driver, Ray's workers: gateway, prefill and decode
replicas) loads a profiler through a ``sitecustomize`` put first on ``PYTHONPATH``; it notes, per
module of ours, in which 20 ms slots a function of it was called, and writes that to a folder
every half second. After a warm-up request the driver serves one streamed request (the request
window), then waits as long again and longer (the idle window, at least two idle status polls).
Every module that ran in the request window counts (docs/architecture.md lists them); those that
also ran in the idle window (the engine loop, status polls, the stats line) are marked. A process
every one of whose functions that ran in the request window ran in the idle window too did nothing
for the request (``tandem up``'s own, when its status line's poll falls in the window): its
modules are listed apart, as background, and not counted; so are the hooks Ray Serve calls on its
own timer (``SERVE_TIMERS``: a replica's health check every 10 s), which run whether or not a
request is served.

    python -m tandem.loadtest.request_path                # colocated and disaggregated
    python -m tandem.loadtest.request_path --shape disagg --json out.json
    python -m tandem.loadtest.request_path --functions    # and which functions of each ran

The profiler slows everything a few times; the figures are module counts, not timings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tandem.loadtest.tandem_up import TandemUp

SLOT_S = 0.02
IDLE_S = 12.0  # longer than two idle status polls (gateway.idle_poll_interval_s, 5 s)
SERVE_TIMERS = frozenset({"check_health", "record_routing_stats"})  # Serve calls them, not requests

# Loaded by every Python process started with this folder first on PYTHONPATH. Standard library
# only; it must not import Tandem (that would change what a process imports).
SITECUSTOMIZE = '''
import json, os, sys, threading, time
_roots = tuple(os.environ["TANDEM_TRACE_ROOTS"].split(os.pathsep))
_out = os.path.join(os.environ["TANDEM_TRACE_DIR"], "%d.json" % os.getpid())
_slot = float(os.environ["TANDEM_TRACE_SLOT_S"])
_codes = {}
_seen = {}
_lock = threading.Lock()

def _profile(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    path = _codes.get(code, 0)
    if path == 0:
        path = _codes[code] = code.co_filename if code.co_filename.startswith(_roots) else None
    if path is not None:
        key = (path, code.co_name)
        slots = _seen.get(key)
        if slots is None:
            slots = _seen[key] = set()
        slots.add(int(time.monotonic() / _slot))

def _dump():
    with _lock:
        data = {}
        for (path, name), slots in list(_seen.items()):
            data.setdefault(path, {})[name] = sorted(slots)
        tmp = _out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"argv": sys.argv, "seen": data}, f)
        os.replace(tmp, _out)

def _writer():
    while True:
        time.sleep(0.5)
        try:
            _dump()
        except Exception:
            pass

sys.setprofile(_profile)
threading.setprofile(_profile)
threading.Thread(target=_writer, name="tandem-trace", daemon=True).start()
'''


@dataclass
class PathReport:
    shape: str
    modules: list[str]  # every module that ran in the request window
    idle: list[str]  # those of them that ran in the idle window too
    processes: int  # processes of ours that ran code for the request
    background: list[str]  # modules that ran only for background work (Serve's timers included)
    functions: dict[str, list[str]]  # module -> its functions that ran in the request window

    def to_json(self) -> dict[str, object]:
        return {"shape": self.shape, "count": len(self.modules), "modules": self.modules,
                "idle": self.idle, "processes": self.processes, "background": self.background,
                "functions": self.functions}


def package_roots() -> dict[str, str]:
    """Folder of each installed package of ours → its import name."""
    roots = {}
    for name in ("tandem.services", "tandem.router"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations is not None
        for folder in spec.submodule_search_locations:
            roots[str(Path(folder).resolve()) + os.sep] = name
    return roots


def module_name(path: str, roots: dict[str, str]) -> str:
    for folder, package in roots.items():
        if path.startswith(folder):
            rel = path[len(folder):].removesuffix(".py").replace(os.sep, ".")
            return package + "." + rel.removesuffix(".__init__")
    raise ValueError(path)


def stream_chat(url: str, text: str, max_tokens: int) -> None:
    model = httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120.0) as client, client.stream(
            "POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            pass


def ran_in(slots: list[int], start: float, end: float) -> bool:
    lo, hi = int(start / SLOT_S), int(end / SLOT_S)
    return any(lo <= s <= hi for s in slots)


def measure(shape: str, work: Path, max_tokens: int, settle_s: float = 0.0) -> PathReport:
    roots = package_roots()
    trace_dir = work / f"trace-{shape}"
    trace_dir.mkdir()
    site = work / f"site-{shape}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    config = work / f"{shape}.yaml"
    config.write_text(f"colocated: {'true' if shape == 'colocated' else 'false'}\n"
                      + ("" if shape == "colocated" else "prefill_replicas: 1\n"
                         "decode_replicas: 1\n"))
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "TANDEM_TRACE_DIR": str(trace_dir), "TANDEM_TRACE_ROOTS": os.pathsep.join(roots),
           "TANDEM_TRACE_SLOT_S": str(SLOT_S)}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        up = TandemUp(config, work / f"{shape}.log").start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        time.sleep(settle_s)  # start-up's background work (the KV cache's huge pages) done
        stream_chat(up.http_url, "Warm up: say hello.", max_tokens)
        time.sleep(2.0)  # let the warm-up's tail (the last polls) pass
        start = time.monotonic()
        stream_chat(up.http_url, "Name three colours of the rainbow.", max_tokens)
        end = time.monotonic()
        time.sleep(1.0)  # the request's own tail (its last status poll) belongs to it
        idle_start = time.monotonic()
        time.sleep(max(IDLE_S, end - start))
        idle_end = time.monotonic()
        time.sleep(1.5)  # the profilers' last writes
    finally:
        up.stop()
    functions: dict[str, set[str]] = {}
    idle: set[str] = set()
    background: set[str] = set()
    processes = 0
    for path in trace_dir.glob("*.json"):
        seen: dict[str, dict[str, list[int]]] = json.loads(path.read_text())["seen"]
        ran: dict[str, set[str]] = {}  # this process: module -> functions run for the request
        ran_idle: dict[str, set[str]] = {}
        for file, names in seen.items():
            module = module_name(file, roots)
            for name, slots in names.items():
                if name in SERVE_TIMERS:
                    if ran_in(slots, start, end):
                        background.add(module)
                elif ran_in(slots, start, end):
                    ran.setdefault(module, set()).add(name)
                if ran_in(slots, idle_start, idle_end):
                    ran_idle.setdefault(module, set()).add(name)
        if not ran:
            continue
        if all(names <= ran_idle.get(module, set()) for module, names in ran.items()):
            background.update(ran)
            continue
        processes += 1
        for module, names in ran.items():
            functions.setdefault(module, set()).update(names)
            if module in ran_idle:
                idle.add(module)
    return PathReport(shape, sorted(functions), sorted(idle & functions.keys()), processes,
                      sorted(background - functions.keys()),
                      {module: sorted(names) for module, names in sorted(functions.items())})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("colocated", "disagg", "both"), default="both")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the reports here")
    parser.add_argument("--settle", type=float, default=0.0, metavar="S",
                        help="wait S seconds after the ready line first (an engine's KV cache "
                             "moves into huge pages in its first ~50 s)")
    parser.add_argument("--functions", action="store_true",
                        help="also list each module's functions that ran")
    args = parser.parse_args(argv)
    shapes = ("colocated", "disagg") if args.shape == "both" else (args.shape,)
    reports = []
    with tempfile.TemporaryDirectory(prefix="tandem-path-") as tmp:
        for shape in shapes:
            report = measure(shape, Path(tmp), args.max_tokens, args.settle)
            reports.append(report)
            print(f"{shape}: {len(report.modules)} modules in {report.processes} processes "
                  f"(* ran idle too)")
            for name in report.modules:
                print(f"  {name}{' *' if name in report.idle else ''}")
                if args.functions:
                    print(f"      {', '.join(report.functions[name])}")
            if report.background:
                print(f"  background only, not counted: {', '.join(report.background)}")
    if args.json is not None:
        args.json.write_text(json.dumps([r.to_json() for r in reports], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
