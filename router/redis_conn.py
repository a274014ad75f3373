"""Redis clients configured for the router: short timeouts, one quick retry, no long backoff.

Router and workers must notice an outage within a fraction of a second (the router then falls
back), and reconnect on their own once the server is back.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# Every way a command can fail: no connection, a timeout, or an error reply such as READONLY (the
# server was made a replica), OOM (``maxmemory`` reached under ``noeviction``) or LOADING. Redis
# holds soft state only, so callers handle each of them like a disconnect.
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)


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
