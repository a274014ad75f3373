"""The router's choice is final, on a real Ray Serve application (the built-in model, 1 prefill
and 1 decode replica, run by tests/serving/route_to_scenario.py in its own process): a call
reaches the replica it names; a call naming a replica that is gone is refused with
ReplicaGoneError (never silently served elsewhere) and changes nothing; the disaggregated
backend then fails over visibly (counted) and the request completes on a live worker. A
decode channel refuses submits naming no open channel, and aborts what runs on it when it is
cancelled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.serving.route_to_scenario import GONE, PARAMS

pytestmark = pytest.mark.timeout(660)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def observed() -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "tests.serving.route_to_scenario"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_call_reaches_the_replica_it_names_or_is_refused(observed: dict[str, Any]) -> None:
    named = observed["named"]
    assert named["named_status_from"] == named["worker"]
    assert named["gone_status"] is None
    assert "no-such-replica is gone" in named["gone_prefill"]
    assert "no-such-replica is gone" in named["gone_reject"]
    # The refused calls prefilled and pinned nothing.
    assert named["leases_after"] == 0 and named["running_after"] == 0


def test_backend_fails_over_from_a_gone_prefill_replica(observed: dict[str, Any]) -> None:
    run = observed["failover"]
    assert run["chosen_before"] == GONE  # the router's choice: the prefix is "there"
    assert len(run["tokens"]) == PARAMS.max_tokens and run["finished"]
    assert run["failovers"] == [["prefill", "replica_gone", 1]]
    assert run["chosen_after"] == run["live"]  # routed around the gone replica since
    assert run["leases_after"] == 0  # the failed-over request left no lease behind


def test_a_decode_channel_aborts_its_requests_when_cancelled(observed: dict[str, Any]) -> None:
    run = observed["channel"]
    assert "has no channel no-such-channel" in run["unknown"]
    assert run["hello"] == ["WorkerReport"]
    assert run["running"] == 2 and run["running_after_abort"] == 1
    assert run["running_after_cancel"] == 0 and run["free_after_cancel"]
    assert "has no channel test-channel" in run["submit_after_cancel"]
