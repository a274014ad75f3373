"""Chat templates rendered as transformers renders them (``apply_chat_template``).

A model's template is Jinja run in transformers' environment, and templates are written and
trained against it: a sandbox with ``trim_blocks`` and ``lstrip_blocks``; ``tojson`` that keeps
key order and writes ``<``, ``>``, ``&`` and non-ASCII text as they are (Jinja's own sorts keys
and escapes them for HTML); ``raise_exception``, ``strftime_now``, loop controls
(``break``/``continue``), ``{% generation %}`` blocks (rendered as their body), ``dict`` and a
``namespace`` that refuses underscore names. A tokenizer may hold several named templates
(``tokenizer_config.json``'s list of ``{"name", "template"}``): ``tool_use`` when a request
has tools and the model has one, else ``default``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: the body as it is (transformers tracks
    where it lands for assistant masks; a server has no use for that)."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, not the type itself (whose
    attributes reach further than a template should)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore-prefixed names (no reach into Python's insides)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed names, got {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplates:
    """A tokenizer's chat templates by name, compiled once."""

    def __init__(self, sources: Mapping[str, str]) -> None:
        env = _environment()
        self.sources = dict(sources)
        self._compiled = {name: env.from_string(text) for name, text in sources.items()}
        self.renders_tools = any("tools" in text for text in self.sources.values())
        # The template for a request without tools and with (or why there is none), chosen once.
        self.picked = {has_tools: self._pick(has_tools) for has_tools in (False, True)}

    @classmethod
    def of(cls, value: Any) -> ChatTemplates | None:
        """From ``tokenizer_config.json``'s ``chat_template``: one template (a string), or a
        list of ``{"name": ..., "template": ...}`` (or a mapping of name to template)."""
        if value is None:
            return None
        if isinstance(value, str):
            return cls({"default": value})
        if isinstance(value, Mapping):
            return cls({str(k): str(v) for k, v in value.items()})
        if isinstance(value, list) and all(isinstance(t, Mapping) and "name" in t
                                           and "template" in t for t in value):
            return cls({str(t["name"]): str(t["template"]) for t in value})
        raise ValueError(f"chat_template must be a string or a list of name/template pairs, "
                         f"not {type(value).__name__}")

    def _pick(self, has_tools: bool) -> jinja2.Template | str:
        """transformers' choice: ``tool_use`` for a request with tools when there is one, then
        ``default``; a single template whatever its name."""
        if has_tools and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        if len(self._compiled) == 1:
            return next(iter(self._compiled.values()))
        return (f"the model has chat templates {sorted(self._compiled)} and none is named "
                "'default'")
