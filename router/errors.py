"""Errors the router raises to its callers (gateway, workers)."""

from __future__ import annotations


class RouterError(Exception):
    """Base class of every router error."""


class RegistrationRefused(RouterError):
    """A worker's hash settings do not match the cluster's: its blocks could never be hit."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id!r} refused: {reason}")
        self.worker_id = worker_id
        self.reason = reason


class SettingsMismatch(RouterError):
    """This router's hash settings differ from those already published for the cluster."""


class BusUnavailable(RouterError):
    """The event bus (Redis) cannot be reached right now."""


class BusReset(RouterError):
    """The bus lost its history (e.g. Redis restarted empty): the index must be rebuilt."""


class RegistryUnavailable(RouterError):
    """The worker registry (Redis) cannot be reached right now."""


class NoHealthyWorkers(RouterError):
    """No live worker of any role is known, so no decision can be made."""
