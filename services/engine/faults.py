"""A test-only fault hook: off unless ``TANDEM_TEST_FAULTS`` is set in the worker's environment.

The fault tests need real faults at exact points inside real worker processes. The variable
holds ``[role:]kind=seed`` items, comma-separated; a request sampled with that seed triggers
the fault, on workers of that role (prefill, decode, colocated) or, without a role, on all:

- ``step``: the engine step that runs the request raises, naming it (the engine fails that
  request only; the step's others run on);
- ``batch``: the step raises without naming a request (the engine fails every request of that
  step and goes on);
- ``fatal``: the step raises ``FatalEngineFault``, which the engine treats as a device error
  (it stops and its worker reports unhealthy);
- ``hang``: the step blocks, as a kernel that never returns would (until the process ends, or
  ``release_hung_steps`` in a test's own process);
- ``sigstop``: (prefill role) the prefill worker sends its result, then stops its process
  with SIGSTOP (as a hung machine would) when the decode worker calls about that request:
  at its pairing if the two have not paired yet, else when it releases the lease after the
  pull;
- ``sigkill``: (prefill role) the same, with SIGKILL (the machine died after the first token).

Unset, nothing is installed and steps pay nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping

from tandem.services.engine.sequence import Sequence, SequenceFault

ENV = "TANDEM_TEST_FAULTS"
KINDS = ("step", "batch", "fatal", "hang", "sigstop", "sigkill")
_RELEASE = threading.Event()  # what a hung step waits for

FaultHook = Callable[[Iterable[Sequence]], None]


class InjectedFault(SequenceFault):
    """An injected failure of one request in an engine step."""


class InjectedStepFault(RuntimeError):
    """An injected failure of an engine step as a whole."""


class FatalEngineFault(RuntimeError):
    """An injected unrecoverable fault, as a CUDA error would be."""


def planned_faults(role: str | None = None, environ: Mapping[str, str] | None = None
                   ) -> dict[int, str]:
    """seed -> fault kind, for a worker of ``role`` (None: only faults for every role)."""
    spec = (os.environ if environ is None else environ).get(ENV, "").strip()
    faults: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        target, _, assignment = item.rpartition(":")
        kind, _, seed = assignment.partition("=")
        if kind not in KINDS or not seed.lstrip("-").isdigit():
            raise ValueError(f"{ENV}: expected [role:]kind=seed items with kind in {KINDS}, "
                             f"got {item!r}")
        if not target or target == role:
            faults[int(seed)] = kind
    return faults


def fault_hook_from_env(role: str | None = None, environ: Mapping[str, str] | None = None
                        ) -> FaultHook | None:
    """The step hook for a worker of ``role``, or None when no step fault is planned."""
    seeds = {seed: kind for seed, kind in planned_faults(role, environ).items()
             if kind in ("step", "batch", "fatal", "hang")}
    if not seeds:
        return None

    def hook(scheduled: Iterable[Sequence]) -> None:
        for seq in scheduled:
            kind = seeds.get(seq.sampling.seed) if seq.sampling.seed is not None else None
            if kind == "fatal":
                raise FatalEngineFault(f"injected fatal fault (request {seq.request_id})")
            if kind == "step":
                raise InjectedFault(seq.request_id,
                                    f"injected step fault (request {seq.request_id})")
            if kind == "batch":
                raise InjectedStepFault(f"injected batch fault (request {seq.request_id})")
            if kind == "hang":
                _RELEASE.wait()
                raise InjectedStepFault(f"injected hang released (request {seq.request_id})")

    return hook


def release_hung_steps() -> None:
    """Let the steps that ``hang`` blocks in this process return (they then raise)."""
    _RELEASE.set()
