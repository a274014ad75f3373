"""Hosts of a Tandem cluster on one machine (root): Linux network namespaces joined by a bridge
(tests/e2e/netns.py), a Ray node in each (`ray start --block`), the head's state in a real Redis
outside them (Ray's GCS fault tolerance), and `tandem up --address` on the head host.

Used by tests/e2e/test_multihost.py, and run alone as `make multihost`
(`python -m tests.e2e.multihost`): three hosts (the head with the gateway, a prefill host, a
decode host), then the checks: greedy exactness with the KV moved across the link over TCP and
over NIXL, and over the prefill host's loopback (decode placed there), with the transfer's
figures (MiB a pull, ms a pull, MiB/s) for each; a faulty link during the transfers (``tc
netem`` delay and loss where the kernel has it, else a rate limit: the JSON says which), output
still exact; a partition of the decode host mid-request (a clear error within the deadlines,
then the next request served exactly with every KV block free). Prints a JSON summary as its
last line; exits 0 when every check passed.
Everything it makes is removed at the end, also after a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from tandem.loadtest.ports import free_port
from tandem.services.tls import InternalTLS
from tests.e2e.cluster import UpProcess, all_blocks_free, metric_values, wait_for
from tests.e2e.netns import Host, hosts

RAY = Path(sys.executable).with_name("ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       # GCS fault tolerance: the workers wait this long for a lost head to come back
       "RAY_gcs_rpc_server_reconnect_timeout_s": "300",
       "RAY_external_storage_namespace": "tandem-multihost"}
RAY_PORT = 6390
PROMPT = "Describe a lighthouse at night."
MAX_TOKENS = 16
GATEWAY, PREFILL, DECODE = "tandem_test_gateway", "tandem_test_prefill", "tandem_test_decode"
GATEWAYS = "tandem_test_gateways"  # every host of a two-host cluster: a gateway on each


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


def nodes_alive(head: Host) -> int:
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
def ray_head(head: Host, log: Path, gcs_redis: str, resources: dict[str, int]
             ) -> Iterator[subprocess.Popen[bytes]]:
    """Ray's head on ``head``, keeping its state in the Redis at ``gcs_redis``; a temp folder
    of its own, as a new head pod would have."""
    temp = tempfile.mkdtemp(prefix="tnd-ray-")  # short: Ray's socket paths live under it
    try:
        with ray_node(head, log, "--head", "--port", str(RAY_PORT), "--include-dashboard",
                      "false", "--temp-dir", temp, "--resources", json.dumps(resources),
                      env={**ENV, "RAY_REDIS_ADDRESS": gcs_redis}) as process:
            yield process
    finally:
        subprocess.run(["rm", "-rf", temp], timeout=60)


@dataclass(frozen=True)
class Cluster:
    hosts: list[Host]  # the head first
    gcs_redis: str  # host:port of the Redis holding the head's state
    head_resources: dict[str, int]
    root: Path  # logs

    @property
    def head(self) -> Host:
        return self.hosts[0]


@contextlib.contextmanager
def ray_cluster(n: int, root: Path) -> Iterator[Cluster]:
    """``n`` hosts with a Ray node each. Two: the head runs the gateway and prefill, the other
    decode (and both a gateway with ``up_on(gateways=2)``); three or more: the head the
    gateway, the second prefill, the rest decode."""
    with contextlib.ExitStack() as stack:
        made = stack.enter_context(hosts(n))
        gcs_redis = stack.enter_context(redis_on(made[0].bridge, root / "redis.log"))
        roles = ([{GATEWAY: 1, PREFILL: 1, GATEWAYS: 1}, {DECODE: 1, GATEWAYS: 1}] if n == 2 else
                 [{GATEWAY: 1}, {PREFILL: 1}, *([{DECODE: 1}] * (n - 2))])
        stack.enter_context(ray_head(made[0], root / "head.log", gcs_redis, roles[0]))
        wait_for(lambda: nodes_alive(made[0]) == 1, 120, "the Ray head")
        for i, (host, resources) in enumerate(zip(made[1:], roles[1:], strict=True), 1):
            stack.enter_context(ray_node(
                host, root / f"node{i}.log", "--address", f"{made[0].address}:{RAY_PORT}",
                "--resources", json.dumps(resources)))
            wait_for(lambda i=i: nodes_alive(made[0]) == i + 1, 120, f"Ray node {i}")
        yield Cluster(made, gcs_redis, roles[0], root)


def up_on(cluster: Cluster, transport: str, decode_resource: str = DECODE,
          tls: InternalTLS | None = None, gateways: int = 1) -> UpProcess:
    """`tandem up --address` on the head host, each role on its resource's hosts (decode on
    the prefill host with ``decode_resource=PREFILL``); with ``tls``, KV between the workers
    over mutual TLS (TCP). ``gateways`` 2: a gateway on each host of two, listening on every
    address, sharing the router's index in the cluster's Redis; ``http_url`` is the head's."""
    head = cluster.head
    settings = {"ray_address": f"{head.address}:{RAY_PORT}", "host": head.address,
                "worker_host": "0.0.0.0", "prefill_replicas": 1, "decode_replicas": 1,
                "kv_transport": transport, "gateway_resource": GATEWAY,
                "prefill_resource": PREFILL, "decode_resource": decode_resource,
                "stream_idle_timeout_s": 10, "kv_transfer_timeout_s": 5.0,
                "request_timeout_s": 60.0}
    if gateways > 1:
        settings |= {"gateway_replicas": gateways, "gateway_resource": GATEWAYS,
                     "host": "0.0.0.0", "redis_url": f"redis://{cluster.gcs_redis}/1"}
    if tls is not None:
        settings |= {"internal_tls_cert_file": tls.cert_file,
                     "internal_tls_key_file": tls.key_file, "internal_tls_ca_file": tls.ca_file}
    folder = cluster.root / f"{transport}{'-tls' if tls else ''}-{decode_resource}-{gateways}"
    folder.mkdir(exist_ok=True)
    up = UpProcess.from_settings(folder, settings)
    up.launcher = head.command()
    up.start()
    up.http_url = gateway_url(up, head)  # the ready line names the wildcard
    return up


def gateway_url(up: UpProcess, host: Host) -> str:
    """The HTTP address of ``up``'s gateway on ``host``."""
    return f"http://{host.address}:{httpx.URL(up.http_url).port}"


def complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def replica_pids(host: Host, role: str) -> set[int]:
    """The processes of Serve replicas of ``role`` in ``host``'s namespace."""
    pids = set()
    for pid in host.pids():
        with contextlib.suppress(psutil.NoSuchProcess):
            command = " ".join(psutil.Process(pid).cmdline())
            if "ServeReplica" in command and f":{role}" in command:
                pids.add(pid)
    return pids


def live_pids(host: Host) -> list[int]:
    """``host``'s processes, not counting exited ones their parent has not reaped."""
    live = []
    for pid in host.pids():
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                live.append(pid)
    return live


def bytes_moved(url: str) -> float:
    return sum(metric_values(url, "tandem_kv_transfer_bytes_total").values())


# -- `make multihost` ------------------------------------------------------------------------


def _engine_tokens() -> list[int]:
    import torch

    from tandem.services.engine.config import EngineConfig
    from tandem.services.engine.llm_engine import LLMEngine
    from tandem.services.engine.model_loader import load_model
    from tandem.services.protocol.request import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(num_kv_blocks=256), load_model(progress=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate([engine.tokenizer.encode(PROMPT)], params)[0]


def _link_fault(host: Host) -> str:
    """Delay and loss on ``host``'s link with netem where the kernel has it, else a rate limit;
    says which."""
    netem = subprocess.run(["tc", "qdisc", "add", "dev", host.link, "root", "netem", "delay",
                            "10ms", "loss", "1%"], capture_output=True, text=True, timeout=30)
    if netem.returncode == 0:
        return "netem delay 10ms loss 1%"
    host.rate_limit("50mbit")
    return f"rate limit 50mbit (netem unavailable: {netem.stderr.strip()})"


def _exact(url: str, expected: list[int]) -> bool:
    reply = complete(url)
    return reply.status_code == 200 and reply.json()["choices"][0]["token_ids"] == expected


# The transfer figures: prompts of about this many tokens (45 KiB of float32 KV a token), each
# new to the decode worker's prefix cache, so every pull moves every block.
TRANSFER_PROMPT_WORDS = 400
TRANSFER_REQUESTS = 3


def _checks(cluster: Cluster, expected: list[int]) -> dict[str, Any]:
    results: dict[str, Any] = {"transfers": {}}
    for transport in ("tcp", "nixl"):
        for placement, resource in (("link", DECODE), ("loopback", PREFILL)):
            up = up_on(cluster, transport, resource)
            try:
                name = f"{transport}_{placement}"
                results[f"exact_{name}"] = _exact(up.http_url, expected)
                results["transfers"][name] = _transfers(up.http_url)
                if name == "tcp_link":
                    _faults(cluster, up, expected, results)
            finally:
                results[f"stopped_{transport}_{placement}"] = up.stop() == 0
    return results


def _transfers(url: str) -> dict[str, float]:
    """KV pulls of long prompts: MiB a pull, its mean time (the decode worker's measure) and
    the rate."""
    def totals() -> tuple[float, float, float]:
        return tuple(sum(metric_values(url, name).values()) for name in (  # type: ignore[return-value]
            "tandem_kv_transfer_bytes_total", "tandem_kv_transfer_seconds_sum",
            "tandem_kv_transfers_total"))

    before = totals()
    for i in range(TRANSFER_REQUESTS):
        prompt = f"{i} {time.time_ns()} " + " ".join(["lighthouse"] * TRANSFER_PROMPT_WORDS)
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 2, "temperature": 0})  # 1: prefill alone
        reply.raise_for_status()
    wait_for(lambda: totals()[2] >= before[2] + TRANSFER_REQUESTS, 120, "the pulls counted")
    moved, seconds, pulls = (after - was for after, was in zip(totals(), before, strict=True))
    return {"mib_per_pull": round(moved / pulls / 2**20, 1),
            "ms_per_pull": round(1000 * seconds / pulls, 1),
            "mib_per_s": round(moved / 2**20 / seconds, 1)}


def _faults(cluster: Cluster, up: UpProcess, expected: list[int],
            results: dict[str, Any]) -> None:
    """A faulty decode link during transfers, then the decode host cut off mid-request."""
    decode_host = cluster.hosts[2]
    results["link_fault"] = _link_fault(decode_host)
    try:
        results["exact_under_link_fault"] = all(_exact(up.http_url, expected) for _ in range(3))
    finally:
        decode_host.rate_limit(None)  # removes whichever qdisc was added
    decode_host.link_down()
    try:
        cut = complete(up.http_url)
    finally:
        decode_host.link_up()
    results["partition_status"] = cut.status_code
    results["partition_clear_error"] = cut.status_code in (503, 504) and cut.json()["error"][
        "code"] in ("unavailable", "timeout")
    wait_for(lambda: complete(up.http_url).status_code == 200, 180,
             "a request served once the link is back")
    results["exact_after_partition"] = _exact(up.http_url, expected)
    wait_for(lambda: all_blocks_free(up, 2), 120, "every KV block free")
    results["blocks_free_after_partition"] = True


def main() -> int:
    if os.geteuid() != 0:
        print("make multihost builds network namespaces: run it as root", file=sys.stderr)
        return 2
    started = time.monotonic()
    expected = _engine_tokens()
    summary: dict[str, Any] = {"hosts": 3}
    with tempfile.TemporaryDirectory(prefix="tandem-multihost-") as tmp:
        try:
            with ray_cluster(3, Path(tmp)) as cluster:
                summary.update(_checks(cluster, expected))
        except Exception as error:  # reported in the summary, and the exit status
            summary["error"] = f"{type(error).__name__}: {error}"
            for log in sorted(Path(tmp).rglob("*.log")):
                print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["ok"] = "error" not in summary and all(
        v for k, v in summary.items() if k.startswith(("exact", "partition_clear", "blocks",
                                                       "stopped")))
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
