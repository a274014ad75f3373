"""Tandem across hosts: two Linux network namespaces joined by a bridge, a Ray node in each,
`tandem up --address` on the head host (the harness: tests/e2e/multihost.py).

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
is served exactly with every block free. With a gateway on each host (sharing the router's
index in Redis), either serves the engine's tokens; one killed, the other serves on while Serve
starts it again; the decode host's gateway outlives the head and answers while it is gone.
Needs root (the namespaces); everything made is removed at the end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator

import httpx
import pytest

from tandem.services.protocol.request import SamplingParams
from tandem.services.tls import InternalTLS
from tests.certs import issue
from tests.e2e.cluster import TANDEM, UpProcess, all_blocks_free, metric_values, wait_for
from tests.e2e.multihost import (
    ENV,
    MAX_TOKENS,
    PROMPT,
    RAY_PORT,
    Cluster,
    bytes_moved,
    complete,
    gateway_url,
    live_pids,
    nodes_alive,
    ray_cluster,
    ray_head,
    replica_pids,
    up_on,
)
from tests.e2e.netns import Host

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The head (gateway, prefill) and a decode host."""
    with ray_cluster(2, tmp_path_factory.mktemp("multihost")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def expected(make_engine) -> list[int]:  # type: ignore[no-untyped-def]
    engine = make_engine()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate([engine.tokenizer.encode(PROMPT)], params)[0]


def _replicas(host: Host, role: str) -> int:
    """Serve replicas of ``role`` running in ``host``'s namespace."""
    return len(replica_pids(host, role))


def test_a_resource_no_node_declares_is_refused_at_start(
        two_hosts: Cluster) -> None:
    head = two_hosts.head
    result = subprocess.run(head.command(
        str(TANDEM), "up", "--address", f"{head.address}:{RAY_PORT}", "--prefill", "1",
        "--decode", "1", "--decode-resource", "tandem_test_nowhere"),
        env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "decode_resource 'tandem_test_nowhere': no node of the Ray cluster declares it" in \
        result.stderr
    assert "tandem_test_decode" in result.stderr  # what the cluster does declare


@pytest.fixture(scope="module")
def internal_tls(tmp_path_factory: pytest.TempPathFactory) -> InternalTLS:
    """The workers' certificate (no names: they are reached by IP) and the CA that signed it,
    as the chart mounts them from one Secret into every worker pod."""
    directory = tmp_path_factory.mktemp("internal-tls")
    ca, ca_cert, ca_key = issue(directory, "ca", "Tandem test cluster CA", [], ca=True)
    worker = issue(directory, "worker", "tandem worker", [], issuer=(ca_cert, ca_key))[0]
    return InternalTLS.read(worker.cert_file, worker.key_file, ca.cert_file)


@pytest.mark.parametrize("transport", ["tcp+tls", "nixl"])
def test_kv_moved_across_hosts_gives_the_engines_tokens(
        two_hosts: Cluster, expected: list[int], transport: str,
        internal_tls: InternalTLS) -> None:
    """Over TCP the KV crosses the link in mutual TLS (the internal_tls_* settings); plain
    TCP is what the other e2e clusters move KV with."""
    head, other = two_hosts.hosts
    tls = internal_tls if transport == "tcp+tls" else None
    up = up_on(two_hosts, transport.removesuffix("+tls"), tls=tls)
    try:
        assert [_replicas(head, r) for r in ("gateway", "prefill", "decode")] == [1, 1, 0]
        assert [_replicas(other, r) for r in ("gateway", "prefill", "decode")] == [0, 0, 1]
        (info,) = metric_values(up.http_url, "tandem_config_info").keys()
        assert ("internal_tls", str(tls is not None).lower()) in info
        moved = bytes_moved(up.http_url)
        reply = complete(up.http_url)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected
        # pulled over the link, not recomputed on the decode host
        wait_for(lambda: bytes_moved(up.http_url) > moved, 30, "the KV bytes counted")
        assert sum(metric_values(up.http_url, "tandem_decode_recomputes_total").values()) == 0
    finally:
        assert up.stop() == 0
    # Only Tandem's application went: its replicas, not the nodes.
    wait_for(lambda: not any(_replicas(h, r) for h in (head, other)
                             for r in ("gateway", "prefill", "decode")), 120,
             "Tandem's replicas gone")
    assert nodes_alive(head) == 2


def test_a_cut_link_ends_the_request_clearly_and_the_next_one_is_served(
        two_hosts: Cluster, expected: list[int]) -> None:
    other = two_hosts.hosts[1]
    up = up_on(two_hosts, "tcp")
    try:
        assert complete(up.http_url).status_code == 200  # paired and warm
        other.link_down()
        try:
            reply = complete(up.http_url)
        finally:
            other.link_up()
        # The decode host is unreachable: the stream's idle deadline (10 s) fires; with no
        # other decode worker there is nowhere to go.
        assert reply.status_code in (503, 504), reply.text
        assert reply.json()["error"]["code"] in ("unavailable", "timeout")
        wait_for(lambda: complete(up.http_url).status_code == 200, 180,
                 "a request served once the link is back")
        assert complete(up.http_url).json()["choices"][0]["token_ids"] == expected
        wait_for(lambda: all_blocks_free(up, 2), 120, "every KV block free")
    finally:
        assert up.stop() == 0


@pytest.fixture(scope="module")
def gateways_up(two_hosts: Cluster) -> Iterator[UpProcess]:
    """One `tandem up` moving KV over plain TCP, with a gateway on each host, for the last
    two tests (the last one kills it with the head host)."""
    up = up_on(two_hosts, "tcp", gateways=2)
    try:
        yield up
    finally:
        if up.process is not None and up.process.poll() is None:
            assert up.stop() == 0


def test_a_gateway_on_each_host_and_one_lost_leaves_the_other_serving(
        two_hosts: Cluster, gateways_up: UpProcess, expected: list[int]) -> None:
    """Either host's gateway serves the engines' tokens (one router index, in Redis); with one
    gateway killed the other serves on, and Serve starts the lost one again."""
    head, other = two_hosts.hosts
    urls = [gateway_url(gateways_up, host) for host in (head, other)]
    assert [_replicas(host, "gateway") for host in (head, other)] == [1, 1]
    for url in urls:
        reply = complete(url)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected
    (lost,) = replica_pids(other, "gateway")
    os.kill(lost, signal.SIGKILL)
    assert complete(urls[0]).json()["choices"][0]["token_ids"] == expected
    wait_for(lambda: _served(urls[1]), 180, "the lost gateway started again")
    assert replica_pids(other, "gateway") - {lost}
    assert complete(urls[1]).json()["choices"][0]["token_ids"] == expected


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
        two_hosts: Cluster, gateways_up: UpProcess, expected: list[int]) -> None:
    """Runs last: it replaces the module's head (and kills `tandem up` with it)."""
    head, other = two_hosts.hosts
    up = gateways_up
    assert complete(up.http_url).json()["choices"][0]["token_ids"] == expected
    engines = replica_pids(other, "decode")
    assert len(engines) == 1
    other_gateway = replica_pids(other, "gateway")
    assert len(other_gateway) == 1
    got: list[str] = []
    ended: list[BaseException | None] = []
    streaming = threading.Thread(target=_stream, args=(up.http_url, got, ended), daemon=True)
    streaming.start()
    wait_for(lambda: len(got) > 2, 120, "the stream's first tokens")

    for pid in head.pids():  # the head host lost: every process on it, `tandem up` too
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not live_pids(head), 60, "the head host's processes gone")
    streaming.join(150)
    # The open stream ends at the client (its connection was to the lost gateway), not hangs.
    assert not streaming.is_alive() and isinstance(ended[0], httpx.TransportError), ended
    assert "data: [DONE]" not in got
    # The decode host's gateway still answers, within its deadlines: with the prefill worker
    # gone with the head, a clear error.
    while_down = complete(gateway_url(up, other))
    assert while_down.status_code in (503, 504), while_down.text
    assert while_down.json()["error"]["code"] in ("unavailable", "timeout")

    with ray_head(head, two_hosts.root / "head-again.log", two_hosts.gcs_redis,
                  two_hosts.head_resources):
        wait_for(lambda: nodes_alive(head) == 2, 180, "the decode host back with the new head")
        # Serve comes back from the state in Redis: its gateway and prefill worker start on the
        # new head by themselves, and the decode host's engine is the same process.
        wait_for(lambda: _served(up.http_url), 240, "the gateway serving again")
        assert replica_pids(other, "decode") == engines
        assert replica_pids(other, "gateway") == other_gateway  # it lived on too
        for url in (up.http_url, gateway_url(up, other)):
            assert complete(url).json()["choices"][0]["token_ids"] == expected
        wait_for(lambda: all_blocks_free(up, 2), 120, "every KV block free")


def _served(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return complete(url).status_code == 200
    return False
