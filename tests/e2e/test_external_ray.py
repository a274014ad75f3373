"""`tandem up --address`: Tandem deployed into a Ray cluster it did not start.

The test starts two Ray nodes on this machine (`ray start --block`, on loopback): a head that
declares the gateway's and the prefill workers' resources, and a second node that declares the
decode workers'. Each role's replicas run on the node that declares its resource, the output is
the engine's, and on exit `tandem up` removes only its application: both nodes stay up. A
resource no node declares is refused at start-up, naming it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tandem.loadtest.ports import free_port
from tandem.services.protocol.request import SamplingParams
from tests.e2e.cluster import TANDEM, UpProcess, wait_for

RAY = Path(sys.executable).with_name("ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
PROMPT = "Name three rivers in Europe."

pytestmark = pytest.mark.timeout(600)


@contextlib.contextmanager
def ray_node(log: Path, *args: str) -> Iterator[psutil.Process]:
    """One Ray node (`ray start --block`), stopped with everything it started."""
    process = subprocess.Popen([str(RAY), "start", "--block", "--node-ip-address", "127.0.0.1",
                                "--num-cpus", "1", "--disable-usage-stats", *args],
                               stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV)
    node = psutil.Process(process.pid)
    try:
        yield node
    finally:
        started = node.children(recursive=True) if process.poll() is None else []
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        finally:
            for proc in started:  # only what this node started
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()


def _nodes_alive(address: str) -> int:
    status = subprocess.run([str(RAY), "status", "--address", address], env=ENV,
                            capture_output=True, text=True, timeout=60)
    active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
    return sum(1 for line in active.splitlines() if "node_" in line)


def _replicas(node: psutil.Process, role: str) -> list[psutil.Process]:
    found = []
    for proc in node.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "ServeReplica" in " ".join(proc.cmdline()) and f":{role}" in " ".join(
                    proc.cmdline()):
                found.append(proc)
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, psutil.Process,
                                                                        psutil.Process]]:
    root = tmp_path_factory.mktemp("external-ray")
    port = free_port()
    address = f"127.0.0.1:{port}"
    head_resources = {"tandem_test_gateway": 1, "tandem_test_prefill": 1}
    with ray_node(root / "head.log", "--head", "--port", str(port), "--include-dashboard",
                  "false", "--resources", json.dumps(head_resources)) as head:
        wait_for(lambda: _nodes_alive(address) == 1, 120, "the Ray head")
        with ray_node(root / "node.log", "--address", address, "--resources",
                      json.dumps({"tandem_test_decode": 1})) as node:
            wait_for(lambda: _nodes_alive(address) == 2, 120, "the second Ray node")
            yield address, head, node


def test_a_resource_no_node_declares_is_refused_at_start(
        cluster: tuple[str, psutil.Process, psutil.Process], tmp_path: Path) -> None:
    address, _, _ = cluster
    result = subprocess.run(
        [str(TANDEM), "up", "--address", address, "--prefill", "1", "--decode", "1",
         "--decode-resource", "tandem_test_nowhere", "--port", str(free_port()),
         "--grpc-port", str(free_port())],
        env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "decode_resource 'tandem_test_nowhere': no node of the Ray cluster declares it" in \
        result.stderr
    assert "tandem_test_decode" in result.stderr  # what the cluster does declare


def test_each_role_runs_where_its_resource_is_and_exit_leaves_the_cluster_up(
        cluster: tuple[str, psutil.Process, psutil.Process], tmp_path: Path,
        make_engine) -> None:  # type: ignore[no-untyped-def]
    address, head, node = cluster
    up = UpProcess.from_settings(tmp_path, {
        "ray_address": address, "prefill_replicas": 1, "decode_replicas": 1,
        "kv_transport": "tcp", "gateway_resource": "tandem_test_gateway",
        "prefill_resource": "tandem_test_prefill",
        "decode_resource": "tandem_test_decode"}).start()
    try:
        assert [len(_replicas(head, r)) for r in ("gateway", "prefill", "decode")] == [1, 1, 0]
        assert [len(_replicas(node, r)) for r in ("gateway", "prefill", "decode")] == [0, 0, 1]
        engine = make_engine()
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        expected = engine.generate([engine.tokenizer.encode(PROMPT)], params)[0]
        reply = httpx.post(f"{up.http_url}/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected
    finally:
        assert up.stop() == 0
    # Only Tandem's application went: its replicas, not the nodes.
    wait_for(lambda: not any(_replicas(n, r) for n in (head, node)
                             for r in ("gateway", "prefill", "decode")), 120,
             "Tandem's replicas gone")
    assert head.is_running() and node.is_running()
    assert _nodes_alive(address) == 2
