"""Tandem across hosts: two Linux network namespaces joined by a bridge (tests/e2e/netns.py),
a Ray node in each (`ray start --block`), `tandem up --address` on the head host.

Host 0 runs Ray's head, the gateway and the prefill worker; host 1 the decode worker, each
placed by the Ray resource its node declares (a resource no node declares is refused at
start-up, naming it). The prompt's KV blocks go from host 0 to host 1 over a real network path
(veth links and a bridge), over TCP and over NIXL (UCX over TCP); the output is the engine's,
token for token. On exit `tandem up` removes only its application: the Ray nodes stay up (the
next test deploys into them). With the decode host's link cut while it streams, the request
ends with a clear error within its deadlines, and once the link is back the next request is
served and every block is free.

The head keeps Ray's cluster state in a Redis outside both hosts (GCS fault tolerance, as the
chart sets it up): with every process on the head host killed mid-stream and the head started
again, the open stream ends at the client, the decode host's engine lives on in the same
process, Serve brings the gateway and the prefill worker back by itself, and the next request
is served exactly with every block free. Needs root (the namespaces); everything made is
removed at the end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from tandem.loadtest.ports import free_port
from tandem.services.protocol.request import SamplingParams
from tests.e2e.cluster import TANDEM, UpProcess, all_blocks_free, metric_values, wait_for
from tests.e2e.netns import Host, hosts

RAY = Path(sys.executable).with_name("ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       # GCS fault tolerance: the workers wait this long for a lost head to come back
       "RAY_gcs_rpc_server_reconnect_timeout_s": "300",
       "RAY_external_storage_namespace": "tandem-multihost"}
RAY_PORT = 6390
PROMPT = "Describe a lighthouse at night."
MAX_TOKENS = 16

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]


@contextlib.contextmanager
def ray_node(host: Host, log: Path, *args: str, env: dict[str, str] | None = None
             ) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(host.command(str(RAY), "start", "--block", "--node-ip-address",
                                            host.address, "--num-cpus", "1",
                                            "--disable-usage-stats", *args),
                               stdout=log.open("w"), stderr=subprocess.STDOUT, env=env or ENV)
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


@contextlib.contextmanager
def redis_on(address: str, log: Path) -> Iterator[str]:
    """A real redis-server listening on ``address`` (in this namespace, outside the hosts):
    yields its host:port."""
    port = free_port()
    process = subprocess.Popen(["redis-server", "--bind", address, "--port", str(port),
                                "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                               stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(host=address, port=port, socket_timeout=1)
        wait_for(lambda: _answers(client), 30, "redis-server")
        yield f"{address}:{port}"
    finally:
        process.kill()
        process.wait(30)


def _answers(client: redis.Redis) -> bool:
    with contextlib.suppress(redis.ConnectionError):
        return bool(client.ping())
    return False


@contextlib.contextmanager
def ray_head(head: Host, log: Path, gcs_redis: str) -> Iterator[subprocess.Popen[bytes]]:
    """Ray's head on ``head``, keeping its state in the Redis at ``gcs_redis``; a temp folder
    of its own, as a new head pod would have."""
    temp = tempfile.mkdtemp(prefix="tnd-ray-")  # short: Ray's socket paths live under it
    try:
        with ray_node(head, log, "--head", "--port", str(RAY_PORT), "--include-dashboard",
                      "false", "--temp-dir", temp, "--resources",
                      json.dumps({"tandem_test_gateway": 1, "tandem_test_prefill": 1}),
                      env={**ENV, "RAY_REDIS_ADDRESS": gcs_redis}) as process:
            yield process
    finally:
        subprocess.run(["rm", "-rf", temp], timeout=60)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[Host, Host, Path, str]]:
    """(head host, decode host, a folder, the Redis holding the head's state)."""
    root = tmp_path_factory.mktemp("multihost")
    with contextlib.ExitStack() as stack:
        head, other = stack.enter_context(hosts(2))
        gcs_redis = stack.enter_context(redis_on(head.bridge, root / "redis.log"))
        stack.enter_context(ray_head(head, root / "head.log", gcs_redis))
        wait_for(lambda: _nodes_alive(head) == 1, 120, "the Ray head")
        stack.enter_context(ray_node(
            other, root / "node.log", "--address", f"{head.address}:{RAY_PORT}",
            "--resources", json.dumps({"tandem_test_decode": 1})))
        wait_for(lambda: _nodes_alive(head) == 2, 120, "the second Ray node")
        yield head, other, root, gcs_redis


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
    return len(_replica_pids(host, role))


def _replica_pids(host: Host, role: str) -> set[int]:
    pids = set()
    for pid in host.pids():
        with contextlib.suppress(psutil.NoSuchProcess):
            command = " ".join(psutil.Process(pid).cmdline())
            if "ServeReplica" in command and f":{role}" in command:
                pids.add(pid)
    return pids


def _live_pids(host: Host) -> list[int]:
    """``host``'s processes, not counting exited ones their parent has not reaped."""
    live = []
    for pid in host.pids():
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                live.append(pid)
    return live


def test_a_resource_no_node_declares_is_refused_at_start(
        two_hosts: tuple[Host, Host, Path, str]) -> None:
    head, _, _, _ = two_hosts
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
        two_hosts: tuple[Host, Host, Path, str], expected: list[int], transport: str) -> None:
    head, other, root, _ = two_hosts
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
        two_hosts: tuple[Host, Host, Path, str], expected: list[int]) -> None:
    head, other, root, _ = two_hosts
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


def _stream(url: str, got: list[str], ended: list[BaseException | None]) -> None:
    """A long streamed completion: its chunks into ``got``; how it ended into ``ended``."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=httpx.Timeout(120), json={
                "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}) as response:
            for line in response.iter_lines():
                got.append(line)
        ended.append(None)
    except httpx.HTTPError as error:
        ended.append(error)


def test_a_lost_head_comes_back_from_redis_and_the_engines_live_on(
        two_hosts: tuple[Host, Host, Path, str], expected: list[int]) -> None:
    """Runs last: it replaces the module's head."""
    head, other, root, gcs_redis = two_hosts
    up = _up(head, root, "tcp")
    assert _complete(up.http_url).json()["choices"][0]["token_ids"] == expected
    engines = _replica_pids(other, "decode")
    assert len(engines) == 1
    got: list[str] = []
    ended: list[BaseException | None] = []
    streaming = threading.Thread(target=_stream, args=(up.http_url, got, ended), daemon=True)
    streaming.start()
    wait_for(lambda: len(got) > 2, 120, "the stream's first tokens")

    for pid in head.pids():  # the head host lost: every process on it, `tandem up` too
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _live_pids(head), 60, "the head host's processes gone")
    streaming.join(150)
    # The open stream ends at the client (its connection was to the lost gateway), not hangs.
    assert not streaming.is_alive() and isinstance(ended[0], httpx.TransportError), ended
    assert "data: [DONE]" not in got

    with ray_head(head, root / "head-again.log", gcs_redis):
        wait_for(lambda: _nodes_alive(head) == 2, 180, "the decode host back with the new head")
        # Serve comes back from the state in Redis: its gateway and prefill worker start on the
        # new head by themselves, and the decode host's engine is the same process.
        wait_for(lambda: _served(up.http_url), 240, "the gateway serving again")
        assert _replica_pids(other, "decode") == engines
        assert _complete(up.http_url).json()["choices"][0]["token_ids"] == expected
        wait_for(lambda: all_blocks_free(up, 2), 120, "every KV block free")


def _served(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return _complete(url).status_code == 200
    return False
