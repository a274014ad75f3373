"""Redis clients configured for the router: short timeouts, one quick retry, no long backoff.

Router and workers must notice an outage within a fraction of a second (the router then falls
back), and reconnect on their own once the server is back.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# The exceptions that mean "the server is not reachable right now".
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
)


def connect(url: str, timeout_s: float = 0.5) -> redis.Redis:
    """A client for ``url`` (redis://host:port/db). It connects lazily, on the first command."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        # One immediate retry: a pooled connection to a restarted server fails once, then the
        # retry opens a fresh one.
        retry=Retry(NoBackoff(), 1),
        health_check_interval=0,
    )


def server_run_id(client: redis.Redis) -> str:
    """Random id of the running server process; it changes on every restart."""
    return str(client.info("server")["run_id"])
