"""Free loopback ports for servers a script or test starts itself."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray's workers take ports 10002-19999 by default; the kernel hands out ports from its
# ephemeral range to every bind to port 0 and every outgoing connection.
_LOW = 20000


def free_port() -> int:
    """A free loopback port between Ray's worker ports and the kernel's ephemeral range.

    A port found by binding port 0 comes from the ephemeral range, where any process of a
    cluster started in the meantime may be given it before our server binds it (a gateway once
    failed with "Address already in use" that way); ports below that range are only ever taken
    by name.
    """
    try:
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768  # Linux's default
    pool = range(_LOW, max(high, _LOW + 1))
    for port in random.Random().sample(pool, min(64, len(pool))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {_LOW}-{high - 1}")
