"""``tandem up``: a private local Ray, the app deployed, one ready line, clean shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import signal
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from tandem.services.gateway.tenants import parse_api_keys
from tandem.services.serving.config import AppConfig, ConfigError
from tandem.services.serving.up_stats import StatsReporter, client_context, kv_capacity
from tandem.services.serving.up_status import APP_NAME, StartupError, StatusMonitor, model_name

READY_TIMEOUT_S = 600.0
STATUS_POLL_S = 0.5  # Serve's status, while starting (its control loop runs every 0.5 s)
SERVING_STATUS_POLL_S = 5.0  # and while serving: replicas lost or unhealthy
CLUSTER_SIGNAL_GRACE_S = 0.5  # on the way out: Ray's processes ending by then were signalled
LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"
LOG_DATE_FORMAT = "%H:%M:%S"
# Tandem's own loggers (the driver's and the replicas', all under "tandem"); everything
# else stays at WARNING.
OWN_LOGGERS = ("tandem",)

log = logging.getLogger("tandem.up")


def configure_logging(level: str, stream: TextIO | None = None) -> None:
    """Tandem's loggers at ``level`` to stderr (short format); others' at WARNING (all at DEBUG
    with ``debug``). Called by ``tandem up`` and, through TANDEM_LOG_LEVEL, in each replica."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
    for name in OWN_LOGGERS:
        own = logging.getLogger(name)
        own.setLevel(level.upper())
        own.handlers[:] = [handler]
        own.propagate = False
    logging.getLogger().setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


def setup_replica_logging() -> None:
    """Ray's ``worker_process_setup_hook``: each worker process (the replicas) logs as
    ``tandem up`` does; Ray forwards its stderr to ``tandem up``'s (deduplicated)."""
    configure_logging(os.environ.get("TANDEM_LOG_LEVEL", "info"))


# ``tandem up`` without a shape (--colocated, --prefill, --decode, or the same in --config)
# splits prefill and decode into two engines only where each can get this many torch
# threads beside a CPU left for the gateway and Ray; below that one colocated engine serves
# faster (2 CPUs, bfloat16, against vLLM at concurrency 1 / 8 / 32: 1P+1D with a thread
# each 0.83x / 0.62x / 0.59x, colocated 0.88x / 0.66x / 0.64x; docs/loadtest.md).
SPLIT_MIN_THREADS = 2
SHAPE_FIELDS = ("colocated", "prefill_replicas", "decode_replicas")


def default_shape(settings: dict[str, Any], cpus: int | None = None,
                  gpu: bool | None = None) -> tuple[dict[str, Any], str | None]:
    """``settings`` with the shape ``tandem up`` picks when none is given, and why (None when
    the settings name one). On a GPU machine, or with enough CPUs, the default 1 prefill +
    1 decode; otherwise colocated."""
    if any(field in settings for field in SHAPE_FIELDS):
        return settings, None
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    device = settings.get("device", "auto")
    if gpu is None:  # what the engines will see (no torch import in this process)
        gpu = device == "cuda" or (device == "auto" and Path("/dev/nvidiactl").exists())
    tp = int(settings.get("tensor_parallel_size", 1))
    if gpu or (cpus - 1) // (2 * tp) >= SPLIT_MIN_THREADS:
        return settings, (f"shape: 1 prefill + 1 decode worker (the default; "
                          f"{'GPUs' if gpu else f'{cpus} CPUs'})")
    return {**settings, "colocated": True}, (
        f"shape: colocated, one engine for prefill and decode: {cpus} CPUs cannot give a "
        f"prefill and a decode engine {SPLIT_MIN_THREADS} threads each (--prefill/--decode "
        f"to split anyway)")


def _kernels_run(config: AppConfig, dtype: str) -> bool:
    """Whether the engines run our CPU kernels (bfloat16 or float32 on a CPU that can), whose
    helper thread ``kernel_threads`` adds."""
    if (dtype not in ("bfloat16", "float32") or config.engine_device() != "cpu"
            or config.attention_backend not in ("auto", "cpu")):
        return False
    from tandem.services.engine import cpu_kernels

    return (cpu_kernels.unavailable_reason() if dtype == "bfloat16"
            else cpu_kernels.f32_unavailable_reason()) is None


def _capacity(config: AppConfig, stop: Stop, wait_s: float = 10.0
              ) -> tuple[int, int] | None:
    """``kv_capacity`` once the gateway's stats hold every engine's cache (a status poll
    after /health turned 200); None if they do not within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while (capacity := kv_capacity(config)) is None and time.monotonic() < deadline:
        if stop.wait(0.5):
            return None
    return capacity


def ready_line(config: AppConfig, capacity: tuple[int, int] | None = None) -> str:
    """``capacity``: the served context and the fewest tokens an engine's KV cache holds
    (``up_stats.kv_capacity``)."""
    shape = ("colocated" if config.colocated
             else f"{config.prefill_replicas} prefill, {config.decode_replicas} decode")
    if config.gateway_replicas > 1:
        shape += f", {config.gateway_replicas} gateways"
    tp = config.tensor_parallel_size
    if tp > 1:
        shape += f" ({tp} ranks{'' if config.colocated else ' each'})"
    threads = config.engine_threads()
    dtype, why = config.engine_dtype()
    shape += (f"; {threads} torch thread{'s' if threads > 1 else ''} per engine"
              f"{' rank' if tp > 1 else ''}")
    if config.engine_prefill_threads() != threads:
        shape += f" ({config.engine_prefill_threads()} in prefill steps)"
    if config.engine_kernel_threads() > 1 and _kernels_run(config, dtype):
        shape += " (+1 for our CPU kernels)"
    if config.threads_per_worker is None:
        shape += f", from {len(os.sched_getaffinity(0))} CPUs"
    shape += f"; dtype {dtype}" + (f" ({why})" if why else "")
    if capacity is not None:
        context, tokens = capacity
        shape += (f"; KV cache {tokens} tokens per engine: {tokens // context} sequence(s) of "
                  f"max_model_len {context}")
    keys = "API keys on" if config.api_keys_file else "no API keys"
    tls = "" if config.tls_cert_file is None else " (TLS)"
    return (f"Tandem ready: HTTP {config.http_url()}/v1  "
            f"gRPC {config.host}:{config.grpc_port}{tls}  ({shape}; {keys})")


@contextlib.contextmanager
def secret_files(settings: dict[str, Any], keys: list[str]) -> Iterator[dict[str, Any]]:
    """``settings`` with the API keys given on the command line (``tenant:key``) written to a
    private file (``api_keys_file``), and a new cluster secret for this run unless one is
    named (it authenticates the workers to each other and keys the tenants' cache salts); the
    files are removed afterwards. Keys never travel in the config."""
    with tempfile.TemporaryDirectory(prefix="tandem-secrets-") as private:  # mode 0700
        settings = dict(settings)
        if keys:
            if settings.get("api_keys_file"):
                raise ConfigError("give API keys as --api-key/TANDEM_API_KEYS or as "
                                  "--api-keys-file, not both")
            parse_api_keys("\n".join(keys), "--api-key")  # malformed: refused here
            settings["api_keys_file"] = _private_file(private, "api-keys", "\n".join(keys))
        if not settings.get("cluster_secret_file"):
            settings["cluster_secret_file"] = _private_file(private, "cluster-secret",
                                                            secrets.token_urlsafe(36))
        yield settings


def _private_file(directory: str, name: str, text: str) -> str:
    path = Path(directory) / name
    path.touch(mode=0o600)
    path.write_text(text + "\n")
    return str(path)


def run(config: AppConfig, out: TextIO = sys.stdout, log_level: str = "info",
        stats_interval_s: float = 10.0, shape_reason: str | None = None) -> int:
    """Serve until SIGINT/SIGTERM; every Ray process started here is stopped on the way out.
    The ready line goes to ``out``; progress, the replicas' logs and stats go to stderr.
    ``shape_reason``: why the shape (``default_shape``), logged first."""
    stop = Stop()
    _on_signals(stop)
    configure_logging(log_level)
    if shape_reason is not None:
        log.info("%s", shape_reason)
    if config.model is not None and not Path(config.model).exists():
        # A hub id: fetched (or found in the cache) once, here, before any replica looks; a
        # missing model fails now, naming where it was looked for.
        from tandem.services.engine.tokenizer_loader import hub_snapshot

        began = time.monotonic()
        log.info("model %s: %s (%.1f s)", config.model, hub_snapshot(config.model),
                 time.monotonic() - began)
    os.environ["TANDEM_LOG_LEVEL"] = log_level  # the replicas inherit it
    ray_level = "DEBUG" if log_level == "debug" else "WARNING"
    if log_level != "debug":
        # Serve's own logs (its controller's tracebacks of each failed replica start, ...) to
        # its files under the session's logs/serve only: what failed is said here, in one line.
        os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    # Loopback-only, no auth token, no usage reporting: a private cluster for this command.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    _quiet_ray_when_idle()
    # Ray starts worker processes (our replicas: the engines) at nice 15, below its own daemons
    # and anything else on the machine; a serving engine runs at normal priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray
    from ray import serve

    from tandem.services.app import build_app

    logging.getLogger("ray.serve").setLevel(ray_level)  # this process's Serve client
    started = time.monotonic()
    # The replicas' stderr comes here (Ray deduplicates repeated lines across them), where
    # setup_replica_logging sends Tandem's logs; Ray's and Serve's own stay at WARNING, and
    # Serve's per-call access log off, unless debug.
    runtime_env = {"worker_process_setup_hook":
                   "tandem.services.serving.up.setup_replica_logging"}
    external = config.ray_address is not None
    if external:  # someone else's cluster: joined, never stopped from here
        ray.init(address=config.ray_address, log_to_driver=True, logging_level=ray_level,
                 runtime_env=runtime_env)
    else:
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=True, logging_level=ray_level, runtime_env=runtime_env,
                 object_store_memory=128 * 1024 * 1024)
    _on_signals(stop)  # again: ray.init installs its own SIGTERM handler (it aborts)
    serve_logging = {"log_level": ray_level, "enable_access_log": log_level == "debug"}
    try:
        resources = ray.cluster_resources()
        log.info("Ray is up in %.1f s (%s, %d node(s), %d CPUs)", time.monotonic() - started,
                 f"the cluster at {config.ray_address}" if external else
                 "a private local cluster", len(ray.nodes()), int(resources.get("CPU", 0)))
        _check_placement(config, resources)
        # No Serve HTTP proxy: the gateway replica serves HTTP and gRPC itself.
        serve.start(proxy_location="Disabled", logging_config=serve_logging)
        monitor = StatusMonitor(config)
        log.info("deploying %s: %s", model_name(config), monitor.shape())
        # Not waiting for the app here: _wait_healthy watches it and reports its progress.
        serve.run_many([serve.RunTarget(build_app(config), name=APP_NAME, route_prefix=None,
                                        logging_config=serve_logging)],
                       wait_for_ingress_deployment_creation=False,
                       wait_for_applications_running=False)
        _wait_healthy(config, stop, monitor)
        if not stop.is_set():
            print(ready_line(config, _capacity(config, stop)), file=out, flush=True)
        _serve(config, stop, monitor, stats_interval_s)
    except StartupError:
        if external:
            with contextlib.suppress(Exception):
                serve.delete(APP_NAME)
        ray.shutdown()  # nothing to drain: stop every process now
        raise
    finally:
        if ray.is_initialized():
            try:
                if external:  # only what this command deployed
                    serve.delete(APP_NAME)
                elif not _cluster_signalled():  # else Serve is gone with it: nothing to drain
                    serve.shutdown()
            finally:
                ray.shutdown()
    return 0


def _cluster_signalled() -> bool:
    """Whether the private cluster's own Ray processes (GCS, raylet, ...) are ending, watched
    for up to CLUSTER_SIGNAL_GRACE_S. A SIGTERM to this command's whole process group (docker
    stop, systemd, `kill -- -PGID`) reaches them too: Serve is gone with them, and its
    shutdown would wait 30 s on a controller that does not answer (plain `tandem up` took
    38 s to stop)."""
    from ray._private import worker

    node = worker._global_node
    deadline = time.monotonic() + CLUSTER_SIGNAL_GRACE_S
    while node is not None and node.remaining_processes_alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _check_placement(config: AppConfig, resources: dict[str, float]) -> None:
    """A role's placement resource that no node declares would leave its replicas pending
    forever: refused now, naming it."""
    roles = [("gateway", config.gateway_resource)]
    if not config.colocated:
        roles += [("prefill", config.prefill_resource), ("decode", config.decode_resource)]
    for role, resource in roles:
        if resource is not None and resources.get(resource, 0) <= 0:
            declared = sorted(k for k in resources
                              if k not in ("CPU", "GPU", "memory", "object_store_memory")
                              and not k.startswith("node:"))
            raise StartupError(f"{role}_resource {resource!r}: no node of the Ray cluster "
                               f"declares it (custom resources: {', '.join(declared) or 'none'}"
                               f"); start the {role} nodes with ray start --resources="
                               f"'{{\"{resource}\": 1}}'")
    have = resources.get(config.gateway_resource or "", 0)
    if config.gateway_replicas > 1 and have < config.gateway_replicas:
        raise StartupError(f"gateway_replicas {config.gateway_replicas}: the Ray cluster's nodes "
                           f"declare {have:g} of gateway_resource {config.gateway_resource!r} "
                           f"in all (one replica per node, one unit each)")


# Ray's and Serve's clocks and extras that a private one-machine cluster does not need, set
# (unless the environment already does) before Ray starts, so every Ray process inherits them.
# Measured with `python -m tandem.loadtest.idle_cpu --settle 40` (docs/loadtest.md "Idle CPU");
# shares are of one core, idle 1P+1D cluster. None of them touches what detects a dead or hung
# replica (Serve's health checks, Ray's actor death notices) or what replaces it.
IDLE_RAY_ENV: dict[str, str] = {
    # Serve's controller loop: reacts (a dead replica replaced) within 0.5 s, not 0.1 s; with
    # the next, an idle 1P+1D cluster went from 17% to 12% (1 s: nothing measurable more).
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Each replica's flush of Serve's request metrics, which nothing exports (see the next):
    # 10 a second -> 1 (in the 17% -> 12%), -> one per 10 s.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "10000",
    # No Ray metrics (Tandem's /metrics are its own): the dashboard agent stops ingesting
    # every process's OpenTelemetry exports (agent 1.1-1.3% -> 0.1-0.3%).
    "RAY_enable_metrics_collection": "0",
    # No idle workers started for the driver: nothing here runs Ray tasks, only actors (two
    # ray::IDLE processes, 1.9% together -> gone).
    "RAY_prestart_worker_first_driver": "0",
    # The log monitor finds new worker log files every 2 s instead of globbing the log
    # directory 10 times a second; lines are still forwarded within 0.1 s (1.1% -> 0.3%).
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "2",
    # The agents (dashboard, runtime env) learn the raylet died from their stdin pipe closing
    # rather than by asking psutil 2.5 times a second; the dashboard agent's node stats (for
    # a dashboard that is off) every 60 s, its event-file scan every 60 s.
    "RAY_enable_pipe_based_agent_to_parent_health_check": "1",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "SCAN_EVENT_DIR_INTERVAL_SECONDS": "60",
    # The raylet's 100-250 ms timers to 1 s (memory monitor, resource report to GCS, plasma
    # GC check, disk-full check, idle-worker reaping) and load reports for autoscaling (one
    # fixed machine here) to 10 s: raylet 0.8-0.9% -> 0.3-0.5%, GCS 0.9-1.0% -> 0.4-0.6%
    # (measured together, not one by one).
    "RAY_memory_monitor_refresh_ms": "1000",
    "RAY_raylet_report_resources_period_milliseconds": "1000",
    "RAY_raylet_check_gc_period_milliseconds": "1000",
    "RAY_local_fs_monitor_interval_ms": "1000",
    "RAY_kill_idle_workers_interval_ms": "1000",
    "RAY_report_worker_backlog_interval_ms": "10000",
    "RAY_gcs_pull_resource_loads_period_milliseconds": "10000",
    "RAY_io_context_monitor_probe_interval_ms": "10000",
    "RAY_debug_dump_period_milliseconds": "60000",
    # Not RAY_event_stats_print_interval_ms=-1: GCS 2.60 then prints its debug state in a
    # busy loop (a core, gigabytes of log a minute).
}


def _quiet_ray_when_idle() -> None:
    for name, value in IDLE_RAY_ENV.items():
        os.environ.setdefault(name, value)


class Stop:
    """`tandem up`'s stop flag, set by SIGINT/SIGTERM: ``set`` takes no lock, so a signal
    handler may call it. (``threading.Event.set`` from a handler deadlocks when the handler runs
    on the main thread while that thread holds the Event's lock: a second signal during the
    first one's ``set``, e.g. Ctrl-C forwarded by a supervisor as well as sent to the group.)
    Waiters sleep in ``select`` on a pipe that ``set`` makes readable for good."""

    def __init__(self) -> None:
        self._flag = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def set(self) -> None:
        self._flag = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._write, b"!")

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False after ``timeout`` seconds."""
        if not self._flag:
            select.select([self._read], [], [], timeout)
        return self._flag


def _on_signals(stop: Stop) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def _wait_healthy(config: AppConfig, stop: Stop,
                  monitor: StatusMonitor | None = None) -> None:
    """Until /health answers 200 and (with a ``monitor``) Serve reports every replica running;
    a replica that fails to start raises ``StartupError`` (Serve's status, polled on the way)
    at once, instead of the wait running out."""
    url = f"{config.http_url()}/health"
    context = client_context(config)
    deadline = time.monotonic() + READY_TIMEOUT_S
    next_status = 0.0
    healthy = False
    while not stop.is_set():
        if monitor is None and healthy:
            return
        if monitor is not None and time.monotonic() >= next_status:
            monitor.check(starting=True)
            next_status = time.monotonic() + STATUS_POLL_S
            if healthy and monitor.all_running():  # and each replica's line printed
                return
        if not healthy:
            healthy = _answers(url, context)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer, or not every replica started, within "
                               f"{READY_TIMEOUT_S} s")
        stop.wait(0.1)


def _answers(url: str, context: ssl.SSLContext | None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            raise RuntimeError(f"{url}: the gateway's certificate (tls_cert_file) does not "
                               f"verify: {exc.reason.verify_message}") from None
    except OSError:
        pass
    return False


def _serve(config: AppConfig, stop: Stop, monitor: StatusMonitor,
           stats_interval_s: float) -> None:
    """Until stopped: Serve's status every SERVING_STATUS_POLL_S (replicas lost and back) and a
    stats line every ``stats_interval_s`` that something changed in (0: none)."""
    stats = StatsReporter(config) if stats_interval_s > 0 else None
    next_status = time.monotonic() + SERVING_STATUS_POLL_S
    next_stats = time.monotonic() + stats_interval_s
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_status:
            try:
                monitor.check(starting=False)
            except Exception as exc:  # Serve's controller busy or gone: say so, go on
                log.debug("serve status: %r", exc)
            next_status = now + SERVING_STATUS_POLL_S
        if stats is not None and now >= next_stats:
            line = stats.poll()
            if line is not None:
                log.info("%s", line)
            next_stats = max(next_stats + stats_interval_s, now)
        wake = next_status if stats is None else min(next_status, next_stats)
        stop.wait(max(wake - time.monotonic(), 0.0))
