"""Several hosts on this machine: Linux network namespaces joined by a bridge (needs root).

``hosts(n)`` makes ``n`` namespaces, each with loopback and one veth link to a bridge in this
(the root) namespace, on a /24 of its own (10.X.Y.1 .. n; the bridge is .254, so the test
process reaches every host). Traffic between hosts crosses their veth links and the bridge: a
real network path, which a test can cut (``Host.link_down``) or slow (``Host.rate_limit``).
Everything is removed at the end, also after a failure: the processes left in the
namespaces are killed, then the namespaces and the bridge deleted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str  # on the bridge
    link: str  # its veth end on the bridge, in the root namespace
    bridge: str  # the bridge's address: this (the root) namespace, as every host reaches it

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def link_down(self) -> None:
        """Cut this host off the network (its own loopback stays up)."""
        _ip("link", "set", self.link, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.link, "up")

    def rate_limit(self, rate: str | None) -> None:
        """Traffic to this host through ``rate`` (tc's units, e.g. "100mbit"); None: none."""
        subprocess.run(["tc", "qdisc", "del", "dev", self.link, "root"], capture_output=True,
                       timeout=30)
        if rate is not None:
            subprocess.run(["tc", "qdisc", "add", "dev", self.link, "root", "tbf", "rate", rate,
                            "burst", "256kbit", "latency", "400ms"], check=True,
                           capture_output=True, timeout=30)

    def pids(self) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True,
                                text=True, timeout=30)
        return [int(pid) for pid in listed.stdout.split()]


@contextlib.contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    tag = f"tnd{os.getpid() % 100000}"  # interface names: 15 characters at most
    subnet = f"10.{100 + os.getpid() % 100}.{os.getpid() % 250}"
    bridge = f"{tag}br"
    made: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(n):
            host = Host(f"{tag}h{i}", f"{subnet}.{i + 1}", f"{tag}v{i}", f"{subnet}.254")
            peer = f"{tag}p{i}"
            _ip("netns", "add", host.namespace)
            made.append(host)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.namespace)
            _ip("link", "set", host.link, "master", bridge)
            _ip("link", "set", host.link, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", peer)
            _ip("-n", host.namespace, "link", "set", peer, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield made
    finally:
        for host in made:
            for pid in host.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True,
                           timeout=30)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)
