"""AppConfig: speculative-decoding settings (decode engines only) and the failure settings
(timeouts, admission bound), validated up front with messages naming the field."""

from __future__ import annotations

import os

import pytest

from services.serving.config import AppConfig, ConfigError
from services.serving.up import ready_line


def test_spec_settings_reach_decode_engines_only():
    config = AppConfig.from_dict({"spec": "ngram", "spec_k": 3}, "test")
    decode = config.engine_config(decodes=True).speculative
    assert (decode.method, decode.k) == ("ngram", 3)
    assert config.engine_config(decodes=False).speculative.method == "none"


@pytest.mark.parametrize("settings, message", [
    ({"spec": "medusa"}, "spec must be one of none, ngram, draft, self"),
    ({"spec": "ngram", "spec_k": 0}, "spec_k must be between 1 and 16"),
    ({"spec": "draft"}, "spec: draft needs draft_model"),
    ({"spec": "draft", "draft_model": "/no/such/draft.gguf"}, "does not exist"),
    ({"spec_k": "4"}, "spec_k must be int"),
])
def test_bad_spec_settings_fail_with_a_clear_message(settings, message):
    with pytest.raises(ConfigError, match=message):
        AppConfig.from_dict(settings, "test")


@pytest.mark.parametrize(("settings", "message"), [
    ({"request_timeout_s": 0}, "request_timeout_s must be > 0"),
    ({"prefill_timeout_s": -1.0}, "prefill_timeout_s must be > 0"),
    ({"control_timeout_s": 0.0}, "control_timeout_s must be > 0"),
    ({"kv_transfer_timeout_s": 0}, "kv_transfer_timeout_s must be > 0"),
    ({"stream_idle_timeout_s": 0}, "stream_idle_timeout_s must be > 0"),
    ({"max_in_flight": 0}, "max_in_flight must be >= 1"),
])
def test_bad_failure_settings_fail_with_a_clear_message(settings, message):
    with pytest.raises(ConfigError, match=message):
        AppConfig(**settings)


def test_the_in_flight_bound_defaults_to_one_decode_batch():
    assert AppConfig(max_num_seqs=32, decode_replicas=3).in_flight_limit() == 96
    assert AppConfig(max_num_seqs=8, colocated=True, decode_replicas=3).in_flight_limit() == 8
    assert AppConfig(max_in_flight=5).in_flight_limit() == 5


def test_engine_threads_come_from_the_cpus_unless_set():
    cpus = len(os.sched_getaffinity(0))
    # One CPU left for the gateway and Ray; the rest shared by the engines on this machine.
    assert AppConfig().engine_threads() == max(1, (cpus - 1) // 2)
    assert AppConfig(colocated=True).engine_threads() == max(1, cpus - 1)
    assert AppConfig(prefill_replicas=4, decode_replicas=4).engine_threads() == max(
        1, (cpus - 1) // 8)
    assert AppConfig(threads_per_worker=3).engine_config().num_threads == 3
    assert AppConfig().engine_config().num_threads == AppConfig().engine_threads()
    with pytest.raises(ConfigError, match="threads_per_worker must be >= 1"):
        AppConfig(threads_per_worker=0)
    # `tandem up` says which shape it chose, and from what.
    line = ready_line(AppConfig())
    assert line.endswith(f"(1 prefill, 1 decode; {max(1, (cpus - 1) // 2)} torch thread"
                         f"{'s' if (cpus - 1) // 2 > 1 else ''} per engine, from {cpus} CPUs)")
    assert ready_line(AppConfig(colocated=True, threads_per_worker=2)).endswith(
        "(colocated; 2 torch threads per engine)")
