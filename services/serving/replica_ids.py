"""Which replica ids each deployment has, as this process's Serve handles last heard.

Kept apart from the request router class: Serve pickles that class by value, and a lock in
its module would not pickle.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_replicas: dict[str, frozenset[str]] = {}  # deployment name -> replica ids


def record(deployment: str, replica_ids: frozenset[str]) -> None:
    with _lock:
        _replicas[deployment] = replica_ids


def known_replicas(deployment: str) -> frozenset[str]:
    with _lock:
        return _replicas.get(deployment, frozenset())
