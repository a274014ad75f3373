"""What ``tandem up`` says while it starts and serves: Serve's status of the app, polled (a line
per replica starting and up, a warning per replica lost; a replica that fails to start stops
``tandem up`` at once with the loader's message)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tandem.services.serving.config import AppConfig

APP_NAME = "tandem"

log = logging.getLogger("tandem.up")


class StartupError(RuntimeError):
    """A replica failed to start; ``tandem up`` stops (its message is the loader's)."""


def model_name(config: AppConfig) -> str:
    if config.model is None:
        from tandem.services.engine.tokenizer_loader import BUILTIN_MODEL_ID

        return f"{BUILTIN_MODEL_ID} (built-in)"
    path = Path(config.model)
    return path.name if path.exists() else config.model  # a hub id: as given


def failure_line(message: str) -> str:
    """The line of a Serve status message that says what failed: its last (a traceback's
    exception), without the exception's module path."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    head, sep, rest = last.partition(": ")
    if sep and " " not in head and "." in head:  # tandem.services.engine.x.ModelLoadError: ...
        last = f"{head.rsplit('.', 1)[1]}: {rest}"
    return last


class StatusMonitor:
    """Serve's status of the app, polled: a line per replica starting and up, a warning per
    replica lost or deployment unhealthy; while starting, a failure raises ``StartupError``."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.created = time.monotonic()
        self.running: dict[str, int] = {}
        self.starting_since: dict[str, float] = {}
        self.problems: dict[str, str] = {}

    def targets(self) -> dict[str, int]:
        if self.config.colocated:
            return {"gateway": 1}
        return {"prefill": self.config.prefill_replicas,
                "decode": self.config.decode_replicas, "gateway": self.config.gateway_replicas}

    def all_running(self) -> bool:
        return all(self.running.get(name, 0) >= n for name, n in self.targets().items())

    def shape(self) -> str:
        if self.config.colocated:
            return "the gateway with one engine (colocated)"
        n = self.config.gateway_replicas
        gateways = "the gateway" if n == 1 else f"{n} gateways"
        return (f"{self.config.prefill_replicas} prefill and {self.config.decode_replicas} "
                f"decode replica(s), then {gateways}")

    def check(self, starting: bool) -> None:
        from ray import serve

        app = serve.status().applications.get(APP_NAME)
        if app is None:
            return
        for name, deployment in app.deployments.items():
            self._progress(name, {str(getattr(state, "value", state)): count for state, count
                                  in deployment.replica_states.items()})
            status = str(getattr(deployment.status, "value", deployment.status))
            problem = ""
            if (status in ("DEPLOY_FAILED", "UNHEALTHY")
                    or "failed to start" in deployment.message):
                problem = failure_line(deployment.message) or status
            if problem and starting:
                raise StartupError(f"the {name} replica failed to start: {problem}")
            if problem and self.problems.get(name) != problem:
                log.warning("%s: %s", name, problem)
            self.problems[name] = problem
        if starting and str(getattr(app.status, "value", app.status)) == "DEPLOY_FAILED":
            raise StartupError(f"the app failed to deploy: {failure_line(app.message)}")

    def _progress(self, name: str, states: dict[str, int]) -> None:
        now = time.monotonic()
        target = self.targets().get(name, 0)
        if states.get("STARTING", 0) and name not in self.starting_since:
            self.starting_since[name] = now
            log.info("%s: starting %d of %d replica(s)", name, states["STARTING"], target)
        running, before = states.get("RUNNING", 0), self.running.get(name, 0)
        engine = name != "gateway" or self.config.colocated
        took = now - self.starting_since.get(name, self.created)
        for n in range(before + 1, running + 1):
            if engine:
                log.info("%s: replica %d/%d up: engine loaded %s in %.1f s", name, n, target,
                         model_name(self.config), took)
            else:
                log.info("%s: replica %d/%d up in %.1f s", name, n, target, took)
        if running < before:
            log.warning("%s: %d of %d replica(s) running", name, running, target)
        if not states.get("STARTING", 0):
            self.starting_since.pop(name, None)
        self.running[name] = running
