"""CPU an idle Tandem cluster burns: `python -m tandem.loadtest.idle_cpu [--colocated]`.

Starts `tandem up` (the default shape, or colocated) on free loopback ports, lets it settle,
then reads the CPU time of every process it started (its session, Ray's included) over a
window with no traffic. Prints the total as a share of one core and the busiest processes.
The target (issue 16): under 2% of a core.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

from tandem.loadtest import results
from tandem.loadtest.tandem_up import TandemUp

TICKS = os.sysconf("SC_CLK_TCK")

PROG = "python -m tandem.loadtest.idle_cpu"


def session_cpu(session: int) -> dict[int, tuple[str, float]]:
    """pid -> (command, CPU seconds so far) of every process in ``session``."""
    found: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) != session:  # field 6: session id
            continue
        cpu = (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
        found[int(entry.name)] = (cmdline[:120] or stat[stat.index("(") + 1:stat.rindex(")")],
                                  cpu)
    return found


def measure(session: int, window_s: float) -> tuple[float, list[tuple[float, str]]]:
    """Share of one core the session used over ``window_s``, and per process (busiest first)."""
    before = session_cpu(session)
    time.sleep(window_s)  # the measurement window itself, not a synchronisation
    after = session_cpu(session)
    per = [((cpu - before.get(pid, (name, cpu))[1]) / window_s, name)
           for pid, (name, cpu) in after.items()]
    per.sort(reverse=True)
    return sum(share for share, _ in per), per


def process_cpu(pid: int) -> tuple[float, float]:
    """(CPU seconds of the whole process, of its main thread) so far."""
    def seconds(stat: str) -> float:
        fields = stat[stat.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    return (seconds(Path(f"/proc/{pid}/stat").read_text()),
            seconds(Path(f"/proc/{pid}/task/{pid}/stat").read_text()))


def ray_actor_floor(settle_s: float, window_s: float) -> tuple[float, float]:
    """Share of one core a Ray actor that does nothing uses (and its main thread), on a local
    Ray started as `tandem up` starts it: the floor each Serve replica and the controller pay."""
    from tandem.services.serving import up
    up._quiet_ray_when_idle()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    @ray.remote(num_cpus=0)
    class Idle:
        def pid(self) -> int:
            return os.getpid()

    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="WARNING", log_to_driver=False)
    try:
        actor = Idle.remote()
        pid = int(ray.get(actor.pid.remote()))
        time.sleep(settle_s)
        before = process_cpu(pid)
        time.sleep(window_s)  # the measurement window itself
        after = process_cpu(pid)
    finally:
        ray.shutdown()
    return (after[0] - before[0]) / window_s, (after[1] - before[1]) / window_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--colocated", action="store_true")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after ready (20)")
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured (30)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                        help="an AppConfig setting for the cluster (repeatable)")
    parser.add_argument("--ray-actor", action="store_true",
                        help="measure one idle Ray actor instead (the floor per replica)")
    results.add_argument(parser)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.ray_actor:
        total, main_thread = ray_actor_floor(args.settle, args.window)
        print(f"idle Ray actor: {100 * total:.2f}% of a core over {args.window:g} s "
              f"({100 * main_thread:.2f}% on its main thread)")
        if args.record:
            results.record([results.Result(
                "idle CPU: one do-nothing Ray actor (each Serve replica's floor)",
                f"{100 * total:.2f}% of a core", results.command(PROG, argv))], args.record)
        return 0
    with tempfile.TemporaryDirectory(prefix="tandem-idle-") as tmp:
        config = Path(tmp) / "config.yaml"
        settings = {"colocated": args.colocated}
        for item in args.set:
            key, _, value = item.partition("=")
            settings[key] = yaml.safe_load(value)
        config.write_text(yaml.safe_dump(settings))
        up = TandemUp(config, Path(tmp) / "tandem-up.log").start()
        try:
            assert up.process is not None
            time.sleep(args.settle)  # start-up work (compiles, first polls) ends
            total, per = measure(up.process.pid, args.window)
        finally:
            up.stop()
    shape = "colocated" if args.colocated else "1 prefill + 1 decode"
    print(f"idle {shape}: {100 * total:.1f}% of a core over {args.window:g} s")
    for share, name in per[:args.top]:
        print(f"  {100 * share:5.1f}%  {name}")
    if args.record:
        settings = ", ".join(args.set) or "no settings"
        results.record([results.Result(
            f"idle CPU (target < 2% of a core): {shape}, {settings}",
            f"{100 * total:.1f}% of a core", results.command(PROG, argv))], args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
