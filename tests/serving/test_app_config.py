"""AppConfig's speculative-decoding settings: validated up front, applied to decode engines only."""

from __future__ import annotations

import pytest

from services.serving.config import AppConfig, ConfigError


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
