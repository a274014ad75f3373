"""``tandem up``: a private local Ray, the app deployed, one ready line, clean shutdown."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from services.gateway.tenants import parse_api_keys
from services.serving.config import AppConfig, ConfigError

APP_NAME = "tandem"
READY_TIMEOUT_S = 600.0


def ready_line(config: AppConfig) -> str:
    shape = ("colocated" if config.colocated
             else f"{config.prefill_replicas} prefill, {config.decode_replicas} decode")
    threads = config.engine_threads()
    shape += f"; {threads} torch thread{'s' if threads > 1 else ''} per engine"
    if config.threads_per_worker is None:
        shape += f", from {len(os.sched_getaffinity(0))} CPUs"
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


def run(config: AppConfig, out: TextIO = sys.stdout) -> int:
    """Serve until SIGINT/SIGTERM; every Ray process started here is stopped on the way out."""
    stop = threading.Event()
    _on_signals(stop)
    # Loopback-only, no auth token, no usage reporting: a private cluster for this command.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Serve's own clocks, slowed for an idle machine (measured: an idle 1P+1D cluster went from
    # 17% to 12% of a core): its controller loop (reacts within 0.5 s instead of 0.1 s) and
    # each replica's export of Serve metrics, which nothing scrapes here (10 a second -> 1).
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "1000")
    # Ray starts worker processes (our replicas: the engines) at nice 15, below its own daemons
    # and anything else on the machine; a serving engine runs at normal priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray
    from ray import serve

    from services.app import build_app

    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, logging_level="WARNING",
             object_store_memory=128 * 1024 * 1024)
    _on_signals(stop)  # again: ray.init installs its own SIGTERM handler (it aborts)
    try:
        # No Serve HTTP proxy: the gateway replica serves HTTP and gRPC itself.
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        serve.run(build_app(config), name=APP_NAME, route_prefix=None, blocking=False)
        _wait_healthy(config, stop)
        if not stop.is_set():
            print(ready_line(config), file=out, flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def _on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def _wait_healthy(config: AppConfig, stop: threading.Event) -> None:
    url = f"{config.http_url()}/health"
    context = None
    if config.tls_cert_file is not None:
        # Trust the served certificate itself (a leaf will do: partial chain), not the name it
        # carries, which is the service's, not the loopback address polled here.
        context = ssl.create_default_context(cafile=config.tls_cert_file)
        context.check_hostname = False
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLCertVerificationError):
                raise RuntimeError(f"{url}: the gateway's certificate (tls_cert_file) does not "
                                   f"verify: {exc.reason.verify_message}") from None
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {READY_TIMEOUT_S} s")
        stop.wait(0.1)
