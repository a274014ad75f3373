"""Chat templates render as transformers' ``apply_chat_template`` renders them: its tojson
(key order kept; <, >, & and non-ASCII written as they are), raise_exception, strftime_now,
loop controls, generation blocks, and named templates (tool_use for a request with tools)."""

from __future__ import annotations

from typing import Any

import jinja2
import pytest

from tandem.services.engine.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Find <b>things</b> & more: 東京, café",
    "parameters": {"type": "object", "properties": {"zeta": {"type": "string"},
                                                    "alpha": {"type": "integer"}}}}}]
MESSAGES = [{"role": "system", "content": "Be brief & exact <always>."},
            {"role": "user", "content": "Où est 東京?"},
            {"role": "assistant", "content": "Japan."},
            {"role": "user", "content": "And the time?"}]

# One template using what transformers' environment has and plain Jinja's lacks or does
# otherwise: tojson of nested tools (kept order, no escaping), indent, a loop break, a
# generation block, namespace, dict(), strftime_now, raise_exception on a bad role.
TEMPLATE = """{%- set ns = namespace(first=true) -%}
{%- if tools %}<tools>{{ tools | tojson }}</tools>
<pretty>{{ tools[0].function.parameters | tojson(indent=2) }}</pretty>
{% endif -%}
{%- for m in messages -%}
{%- if m.role not in ['system', 'user', 'assistant'] -%}
{{ raise_exception('bad role ' + m.role) }}{% endif -%}
{%- if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}{% endgeneration %}</a>
{% else %}<{{ m.role }}>{{ m.content }}
{% endif -%}
{%- if loop.index == 3 and not ns.first %}{% break %}{% endif -%}
{%- set ns.first = false -%}
{%- endfor -%}
{{ dict(a=1, b=2) | tojson }}{% if strftime_now('%Y') | length == 4 %} dated{% endif %}
{%- if add_generation_prompt %}<a>{% endif %}"""


def _theirs(template: Any, messages: list[dict[str, Any]], tools: Any = None) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=_backend())
    tok.chat_template = template
    return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=True)


def _backend():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    return HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))


def _ours(template: Any) -> Tokenizer:
    return Tokenizer(_backend(), [0], chat_template=template)


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
def test_renders_as_transformers(tools: Any) -> None:
    ours = _ours(TEMPLATE).apply_chat_template(MESSAGES, tools=tools)
    assert ours == _theirs(TEMPLATE, MESSAGES, tools)
    if tools:  # what Jinja's own tojson would have changed
        assert '"zeta": {"type": "string"}, "alpha"' in ours
        assert "<b>things</b> & more: 東京, café" in ours


def test_raise_exception_is_a_template_error() -> None:
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        _ours(TEMPLATE).apply_chat_template([{"role": "tool", "content": "x"}])


def test_namespaces_refuse_underscore_names() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        _ours("{% set ns = namespace(_x=1) %}").apply_chat_template(MESSAGES)


def test_named_templates_pick_tool_use_for_tools_else_default() -> None:
    named = [{"name": "default", "template": "D{% for m in messages %}|{{ m.content }}"
              "{% endfor %}"},
             {"name": "tool_use", "template": "T{{ tools | tojson }}"}]
    tokenizer = _ours(named)
    assert tokenizer.template_renders_tools
    for tools in (None, TOOLS):
        ours = tokenizer.apply_chat_template(MESSAGES, tools=tools)
        assert ours == _theirs({t["name"]: t["template"] for t in named}, MESSAGES, tools)
        assert ours.startswith("T" if tools else "D")


def test_several_templates_and_no_default_is_refused() -> None:
    tokenizer = _ours([{"name": "a", "template": "A"}, {"name": "b", "template": "B"}])
    with pytest.raises(ValueError, match="none is named 'default'"):
        tokenizer.apply_chat_template(MESSAGES)
