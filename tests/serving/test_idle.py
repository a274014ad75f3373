"""An idle `tandem up` cluster: the Ray settings `tandem up` quiets Ray with leave the
environment's own alone, and the gateway's polled workers do not lapse between idle polls."""

from __future__ import annotations

import os

import pytest

from tandem.services.serving import up
from tandem.services.serving.config import AppConfig
from tandem.services.serving.gateway import registry_ttl_s


def test_polled_workers_outlive_two_idle_polls() -> None:
    assert registry_ttl_s(AppConfig()) == 2 * AppConfig().idle_poll_interval_s
    assert registry_ttl_s(AppConfig.from_dict({"idle_poll_interval_s": 30.0}, "test")) == 60.0
    fast = AppConfig.from_dict({"poll_interval_s": 0.1, "idle_poll_interval_s": 0.1}, "test")
    assert registry_ttl_s(fast) == 5.0


def test_idle_settings_give_way_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"RAY_enable_metrics_collection": "1"}
    monkeypatch.setattr(os, "environ", environ)
    up._quiet_ray_when_idle()
    assert environ["RAY_enable_metrics_collection"] == "1"  # the operator's choice stands
    assert environ["RAY_prestart_worker_first_driver"] == "0"
    assert set(environ) == set(up.IDLE_RAY_ENV)
    # GCS prints its debug state in a busy loop with this at -1: never set it.
    assert "RAY_event_stats_print_interval_ms" not in environ
