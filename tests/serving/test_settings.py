"""Each setting is declared once, the AppConfig field (services/serving/config.py): the `tandem up`
flags map onto fields and offer the same choices the config validates, and docs/settings.md is
`tandem settings`' table of them (default and comment included)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from tandem.router.config import POLICIES
from tandem.services import cli
from tandem.services.engine.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    SPEC_METHODS,
    WEIGHT_FORMATS,
)
from tandem.services.kv_transfer.factory import TRANSPORTS
from tandem.services.serving.config import (
    DEVICES,
    DTYPES,
    AppConfig,
    ConfigError,
    setting_comments,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
# Flags with no setting (--enable-auto-tool-choice: vLLM's, accepted; auto is always served).
CLI_ONLY = {"help", "version", "config", "api_key", "log_level", "stats_interval",
            "enable_auto_tool_choice"}


def _up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli._add_up_parser(sub)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["up"]


def _accepts(field: str, value: object) -> bool:
    try:
        AppConfig(**{field: value})
    except ConfigError:
        return False
    return True


def test_every_flag_is_a_setting_with_the_settings_choices() -> None:
    fields = {f.name for f in dataclasses.fields(AppConfig)}
    assert set(cli._UP_FLAGS.values()) <= fields
    choices = {"dtype": DTYPES, "device": DEVICES, "attention_backend": ATTENTION_BACKENDS,
               "kv_transport": TRANSPORTS, "kv_cache_dtype": KV_CACHE_DTYPES,
               "weight_format": WEIGHT_FORMATS, "routing_policy": POLICIES,
               "spec": SPEC_METHODS}
    for action in _up_parser()._actions:
        if action.dest in CLI_ONLY:
            continue
        assert action.dest in cli._UP_FLAGS, f"{action.option_strings}: no AppConfig field"
        field = cli._UP_FLAGS[action.dest]
        if action.choices is not None and field in choices:
            assert list(action.choices) == list(choices[field]), field
        elif action.choices is not None:  # no constant: the config accepts exactly these
            for value in (*action.choices, max(action.choices) + 1, min(action.choices) - 1):
                accepted = _accepts(field, value)
                assert accepted is (value in action.choices), (field, value)
        # Unset, a flag is absent (argparse.SUPPRESS): the file's value or the field's default.
        assert action.default in (None, argparse.SUPPRESS), (
            f"{action.option_strings} has its own default {action.default!r}")


def test_every_setting_has_a_comment_and_the_doc_is_current() -> None:
    comments = setting_comments()
    bare = [f.name for f in dataclasses.fields(AppConfig) if not comments.get(f.name)]
    assert bare == [], "AppConfig fields without a comment in services/serving/config.py"
    table = cli.settings_reference()
    assert table in DOC.read_text(), "docs/settings.md is stale: paste `tandem settings` into it"
    assert "| `gpu_memory_utilization` | `0.9` |" in table  # the field's default, as declared
    assert table.count("\n") == len(dataclasses.fields(AppConfig)) + 2
