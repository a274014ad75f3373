"""Tandem across hosts: two Linux network namespaces joined by a bridge (tests/e2e/netns.py),
a Ray node in each (`ray start --block`), `tandem up --address` on the head host.

Host 0 runs Ray's head, the gateway and the prefill worker; host 1 the decode worker, each
placed by the Ray resource its node declares (a resource no node declares is refused at
start-up, naming it). The prompt's KV blocks go from host 0 to host 1 over a real network path
(veth links and a bridge), over TCP and over NIXL (UCX over TCP); the output is the engine's,
token for token. On exit `tandem up` removes only its application: the Ray nodes stay up (the
next test deploys into them). With the decode host's link cut while it streams, the request
ends with a clear error within its deadlines, and once the link is back the next request is
served and every block is free. Needs root (the namespaces); everything made is removed at the
end."""

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

from tandem.services.protocol.request import SamplingParams
from tests.e2e.cluster import TANDEM, UpProcess, all_blocks_free, metric_values, wait_for
from tests.e2e.netns import Host, hosts

RAY = Path(sys.executable).with_name("ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
RAY_PORT = 6390
PROMPT = "Describe a lighthouse at night."
MAX_TOKENS = 16

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]


@contextlib.contextmanager
def ray_node(host: Host, log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(host.command(str(RAY), "start", "--block", "--node-ip-address",
                                            host.address, "--num-cpus", "1",
                                            "--disable-usage-stats", *args),
                               stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(60)  # what is left in the namespace is killed with it (netns.hosts)


def _nodes_alive(head: Host) -> int:
    status = subprocess.run(head.command(str(RAY), "status", "--address",
                                         f"{head.address}:{RAY_PORT}"),
                            env=ENV, capture_output=True, text=True, timeout=60)
    active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
    return sum(1 for line in active.splitlines() if "node_" in line)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, Host, Path]]:
    root = tmp_path_factory.mktemp("multihost")
    with contextlib.ExitStack() as stack:
        head, other = stack.enter_context(hosts(2))
        stack.enter_context(ray_node(
            head, root / "head.log", "--head", "--port", str(RAY_PORT), "--include-dashboard",
            "false", "--resources",
            json.dumps({"tandem_test_gateway": 1, "tandem_test_prefill": 1})))
        wait_for(lambda: _nodes_alive(head) == 1, 120, "the Ray head")
        stack.enter_context(ray_node(
            other, root / "node.log", "--address", f"{head.address}:{RAY_PORT}",
            "--resources", json.dumps({"tandem_test_decode": 1})))
        wait_for(lambda: _nodes_alive(head) == 2, 120, "the second Ray node")
        yield head, other, root


@pytest.fixture(scope="module")
def expected(make_engine) -> list[int]:  # type: ignore[no-untyped-def]
    engine = make_engine()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate([engine.tokenizer.encode(PROMPT)], params)[0]


def _up(head: Host, root: Path, transport: str) -> UpProcess:
    settings = {"ray_address": f"{head.address}:{RAY_PORT}", "host": head.address,
                "worker_host": "0.0.0.0", "prefill_replicas": 1, "decode_replicas": 1,
                "kv_transport": transport, "gateway_resource": "tandem_test_gateway",
                "prefill_resource": "tandem_test_prefill",
                "decode_resource": "tandem_test_decode", "stream_idle_timeout_s": 10,
                "kv_transfer_timeout_s": 5.0, "request_timeout_s": 60.0}
    folder = root / transport
    folder.mkdir(exist_ok=True)
    up = UpProcess.from_settings(folder, settings)
    up.launcher = head.command()
    return up.start()


def _complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def _replicas(host: Host, role: str) -> int:
    """Serve replicas of ``role`` running in ``host``'s namespace."""
    count = 0
    for pid in host.pids():
        with contextlib.suppress(psutil.NoSuchProcess):
            command = " ".join(psutil.Process(pid).cmdline())
            count += "ServeReplica" in command and f":{role}" in command
    return count


def test_a_resource_no_node_declares_is_refused_at_start(
        two_hosts: tuple[Host, Host, Path]) -> None:
    head, _, _ = two_hosts
    result = subprocess.run(head.command(
        str(TANDEM), "up", "--address", f"{head.address}:{RAY_PORT}", "--prefill", "1",
        "--decode", "1", "--decode-resource", "tandem_test_nowhere"),
        env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "decode_resource 'tandem_test_nowhere': no node of the Ray cluster declares it" in \
        result.stderr
    assert "tandem_test_decode" in result.stderr  # what the cluster does declare


def _bytes_moved(url: str) -> float:
    return sum(metric_values(url, "tandem_kv_transfer_bytes_total").values())


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_kv_moved_across_hosts_gives_the_engines_tokens(
        two_hosts: tuple[Host, Host, Path], expected: list[int], transport: str) -> None:
    head, other, root = two_hosts
    up = _up(head, root, transport)
    try:
        assert [_replicas(head, r) for r in ("gateway", "prefill", "decode")] == [1, 1, 0]
        assert [_replicas(other, r) for r in ("gateway", "prefill", "decode")] == [0, 0, 1]
        moved = _bytes_moved(up.http_url)
        reply = _complete(up.http_url)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected
        # pulled over the link, not recomputed on the decode host
        wait_for(lambda: _bytes_moved(up.http_url) > moved, 30, "the KV bytes counted")
        assert sum(metric_values(up.http_url, "tandem_decode_recomputes_total").values()) == 0
    finally:
        assert up.stop() == 0
    # Only Tandem's application went: its replicas, not the nodes.
    wait_for(lambda: not any(_replicas(h, r) for h in (head, other)
                             for r in ("gateway", "prefill", "decode")), 120,
             "Tandem's replicas gone")
    assert _nodes_alive(head) == 2


def test_a_cut_link_ends_the_request_clearly_and_the_next_one_is_served(
        two_hosts: tuple[Host, Host, Path], expected: list[int]) -> None:
    head, other, root = two_hosts
    up = _up(head, root, "tcp")
    try:
        assert _complete(up.http_url).status_code == 200  # paired and warm
        other.link_down()
        try:
            reply = _complete(up.http_url)
        finally:
            other.link_up()
        # The decode host is unreachable: the stream's idle deadline (10 s) fires; with no
        # other decode worker there is nowhere to go.
        assert reply.status_code in (503, 504), reply.text
        assert reply.json()["error"]["code"] in ("unavailable", "timeout")
        wait_for(lambda: _complete(up.http_url).status_code == 200, 180,
                 "a request served once the link is back")
        assert _complete(up.http_url).json()["choices"][0]["token_ids"] == expected
        wait_for(lambda: all_blocks_free(up, 2), 120, "every KV block free")
    finally:
        assert up.stop() == 0
