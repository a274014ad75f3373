"""Tool-call parsers per model family (gateway/tool_parsers.py): each reads back the calls its
family's chat template writes for an assistant turn, whole and streamed in pieces of every
size; the family is picked from the template; ``parallel_tool_calls`` false keeps one call;
malformed calls stay text; the parser's special-token tags stay in the reply's text.

The templates below write an assistant turn's tool calls as the families' own templates do
(Qwen2.5/Hermes, Mistral's before and after tokenizer v11, Llama 3.1 JSON, Llama 3.2/4
pythonic, Qwen3-Coder), cut down to that turn."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.pipeline import IncrementalDetokenizer
from tandem.services.gateway.tool_parsers import PARSERS, pick
from tandem.services.gateway.tools import CallDelta, Function, ReplyStream, parse_reply
from tandem.services.serving.config import AppConfig, ConfigError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"},
                                            "detail": {"type": "object"}}}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}}}
FUNCTIONS = [Function("get_weather", None, WEATHER), Function("get_time", None, TIME)]
CALLS = [("get_weather", {"city": "Paris, FR", "days": 3, "detail": {"wind": True}}),
         ("get_time", {"timezone": "CET"})]
CONTENT = "Let me check both."

_EACH_CALL = "{%- for c in messages[0].tool_calls %}{%- set f = c.function %}"
TEMPLATES = {
    # Qwen2.5's: content, then a <tool_call> block per call, arguments as JSON.
    "hermes": "{{- messages[0].content }}" + _EACH_CALL + "\n<tool_call>\n"
              '{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}\n</tool_call>'
              "{%- endfor %}",
    # Mistral's (v3 tokenizer): one JSON array; `function|tojson`, arguments as JSON text.
    "mistral": "{{- messages[0].content }}[TOOL_CALLS] ["
               "{%- for c in messages[0].tool_calls %}{%- set out = c.function | tojson %}"
               "{{- out[:-1] }}, \"id\": \"{{ c.id[-9:] }}\"}{{ ', ' if not loop.last }}"
               "{%- endfor %}]",
    # Mistral's from tokenizer v11 (Magistral, Devstral, Mistral Small 3.2): name[ARGS]{...}.
    "mistral_v11": "{{- messages[0].content }}" + _EACH_CALL
                   + "[TOOL_CALLS]{{ f.name }}[ARGS]{{ f.arguments }}{%- endfor %}",
    # Llama 3.1 JSON: {"name": ..., "parameters": ...}, after <|python_tag|> here.
    "llama3_json": "{{- messages[0].content }}<|python_tag|>" + _EACH_CALL
                   + '{"name": "{{ f.name }}", "parameters": {{ f.arguments | tojson }}}'
                   "{{ '; ' if not loop.last }}{%- endfor %}",
    # Llama 4 pythonic: [name(key="value", ...), ...] (every value as a quoted string).
    "pythonic": "[" + _EACH_CALL + "{{- f.name + '(' -}}{%- for k in f.arguments %}"
                "{{- k + '=\"' }}{{ '%s' | format(f.arguments[k]) }}\"{{ ', ' if not loop.last }}"
                "{%- endfor %}){{ ', ' if not loop.last }}{%- endfor %}]",
    # Qwen3-Coder's XML: a <parameter=key> per argument, mappings as JSON, the rest as text.
    "qwen3_coder": "{{- messages[0].content }}" + _EACH_CALL
                   + "\n<tool_call>\n<function={{ f.name }}>\n{%- for k, v in f.arguments|items %}"
                   "\n<parameter={{ k }}>\n{{ v | tojson if v is mapping else v }}\n</parameter>"
                   "{%- endfor %}\n</function>\n</tool_call>{%- endfor %}",
}
# What each family's template marks itself by (pick reads the whole template).
TEMPLATE_MARKS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "mistral_v11": "[TOOL_CALLS]",
                  "llama3_json": "<|python_tag|>", "pythonic": "[func_name1(params)]",
                  "qwen3_coder": "<function=x>\n<parameter=y>"}


def _family(name: str) -> str:
    return "mistral" if name == "mistral_v11" else name


def _rendered(loaded_model: LoadedModel, name: str, content: str = CONTENT) -> str:
    """The assistant turn making CALLS, as the family's template writes it (Mistral's take
    the arguments as JSON text, as OpenAI sends them; the others as objects)."""
    tokenizer = loaded_model.tokenizer.with_chat_template(TEMPLATES[name])
    as_text = _family(name) == "mistral"
    calls = [{"id": f"call_{i:09d}", "type": "function",
              "function": {"name": fn, "arguments": json.dumps(args) if as_text else args}}
             for i, (fn, args) in enumerate(CALLS)]
    return tokenizer.apply_chat_template([{"role": "assistant", "content": content,
                                           "tool_calls": calls}], add_generation_prompt=False)


def _expected(name: str) -> list[tuple[str, dict[str, Any]]]:
    if name != "pythonic":
        return CALLS
    return [(fn, {k: str(v) for k, v in args.items()}) for fn, args in CALLS]  # as written


@pytest.mark.parametrize("name", TEMPLATES)
def test_each_family_reads_back_what_its_template_writes(loaded_model: LoadedModel,
                                                         name: str) -> None:
    text = _rendered(loaded_model, name, "" if name == "pythonic" else CONTENT)
    parser = PARSERS[_family(name)]
    assert pick("auto", [f"... {TEMPLATE_MARKS[name]} ..."]) is parser
    content, calls = parse_reply(text, FUNCTIONS, "auto", parser)
    assert content == (None if name == "pythonic" else CONTENT)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == _expected(name)
    assert len({c.id for c in calls}) == 2
    # parallel_tool_calls false: the first call only.
    content, calls = parse_reply(text, FUNCTIONS, "auto", parser, parallel=False)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == _expected(name)[:1]
    # Streamed in pieces of every size: the content goes out before the calls begin; in the
    # families that write arguments as JSON text each call's id and name, then its arguments
    # as they form; reassembled, the whole reply as parse_reply reads it.
    for size in range(1, 8):
        stream = ReplyStream(FUNCTIONS, parser)
        fed = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)]
        rest, last = stream.finish()
        assert "".join(sent for sent, _ in fed) + rest == (content or "")
        deltas = [d for _, ds in fed for d in ds] + last
        assert reassembled(deltas) == [(c.name, c.arguments) for c in stream.calls]
        assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == _expected(name)
        first = next(i for i, (_, ds) in enumerate(fed + [("", last)]) if ds)
        assert "".join(sent for sent, _ in fed[:first]) == (content or "")
        # Arguments written as JSON objects stream; Mistral's v3 template writes them as JSON
        # text (a string), and such calls, like the non-JSON families', go out whole at the end.
        if parser.head is not None and name != "mistral":
            assert first < len(fed) and len([d for d in deltas if d.arguments]) > 20 // size
        else:
            assert not any(ds for _, ds in fed)


def reassembled(deltas: list[CallDelta]) -> list[tuple[str, str]]:
    """Calls rebuilt from their deltas as OpenAI's clients do, each begun once, in order."""
    calls: list[tuple[str, str]] = []
    for delta in deltas:
        assert delta.started == (delta.index == len(calls)), delta
        if delta.started:
            calls.append((delta.call.name, ""))
        calls[delta.index] = (calls[delta.index][0], calls[delta.index][1] + delta.arguments)
    return calls


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_cut_off_or_unknown_call(loaded_model: LoadedModel, name: str) -> None:
    """Cut off at max_tokens mid-call: where calls stream, the reply ends with them as far as
    they came (as OpenAI's do); elsewhere it stays text. A call of a function the request did
    not offer stays text. Whole or streamed, the same."""
    text = _rendered(loaded_model, name)
    parser = PARSERS[_family(name)]
    cut = text[:len(text) - 20]
    content, calls = parse_reply(cut, FUNCTIONS, "auto", parser)
    if parser.head is None or name == "mistral":
        assert (content, calls) == (cut, [])
    else:
        assert (calls[0].name, json.loads(calls[0].arguments)) == CALLS[0]
        assert [c.name for c in calls] == [n for n, _ in CALLS][:len(calls)]
    unknown = text.replace("get_weather", "get_date")  # the first call's function
    assert parse_reply(unknown, FUNCTIONS, "auto", parser) == (unknown, [])
    for reply in (cut, unknown):
        stream = ReplyStream(FUNCTIONS, parser)
        sent, deltas = stream.feed(reply)
        rest, last = stream.finish()
        whole = parse_reply(reply, FUNCTIONS, "auto", parser)
        assert ((sent + rest).strip() or None if stream.calls else sent + rest) == whole[0]
        assert reassembled(deltas + last) == [(c.name, c.arguments) for c in whole[1]]


def test_plain_text_streams_through_every_parser() -> None:
    text = "Paris is sunny [and warm] today; 3 < 4 {roughly}."
    for parser in PARSERS.values():
        stream = ReplyStream(FUNCTIONS, parser)
        sent = "".join(stream.feed(c)[0] for c in text)
        assert stream.finish() == (text[len(sent):], []) and not stream.calls
        assert parse_reply(text, FUNCTIONS, "auto", parser) == (text, [])


def test_pythonic_calls_are_read_as_literals_never_run() -> None:
    parser = PARSERS["pythonic"]
    content, calls = parse_reply(
        '<|python_start|>[get_weather(city="Oslo", days=2, detail={"wind": None})]'
        "<|python_end|>", FUNCTIONS, "auto", parser)
    assert content is None and json.loads(calls[0].arguments) == {
        "city": "Oslo", "days": 2, "detail": {"wind": None}}
    for text in ('[get_weather(city=__import__("os").getcwd())]',  # not a literal
                 "[get_weather(city=open('/etc/passwd').read())]", "[get_weather('Oslo')]"):
        assert parse_reply(text, FUNCTIONS, "auto", parser) == (text, [])


def test_qwen3_coder_values_follow_their_schema_types() -> None:
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n"
            "<parameter=days>\n5\n</parameter>\n<parameter=note>\nrain,\nthen sun\n"
            "</parameter>\n</function>\n</tool_call>")
    _, calls = parse_reply(text, FUNCTIONS, "auto", PARSERS["qwen3_coder"])
    # city is a string in the schema (kept as written), days an integer, note unknown (text).
    assert json.loads(calls[0].arguments) == {"city": "123", "days": 5, "note": "rain,\nthen sun"}


def test_the_parser_is_picked_from_the_setting_or_the_template() -> None:
    assert pick("auto", []) is PARSERS["hermes"]  # no template: Tandem's own tools prompt
    assert pick("auto", ["{{ messages }}"]) is PARSERS["hermes"]
    assert pick("llama4_pythonic", ["[TOOL_CALLS]"]) is PARSERS["pythonic"]  # vLLM's name
    assert pick("qwen3_xml", []) is PARSERS["qwen3_coder"]
    assert AppConfig(tool_call_parser="llama4_json").tool_call_parser == "llama4_json"
    with pytest.raises(ConfigError, match="tool_call_parser must be one of auto, hermes"):
        AppConfig(tool_call_parser="granite")


def test_a_parsers_special_tags_stay_in_the_reply_text(loaded_model: LoadedModel) -> None:
    """A tag the vocabulary holds as a special token is skipped in replies unless kept: the
    parser's tags are kept (here <|im_start|> plays [TOOL_CALLS], a special token of SmolLM2's
    vocabulary), the other special tokens still skipped."""
    tokenizer = loaded_model.tokenizer
    tag, other = (tokenizer.backend.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert tag is not None and other is not None
    ids = [*tokenizer.encode("Sure.", add_special_tokens=False), tag,
           *tokenizer.encode(' [{"name": "x"}]', add_special_tokens=False), other]

    def text(keep: frozenset[int]) -> str:
        detok = IncrementalDetokenizer(tokenizer, keep=keep)
        return "".join(detok.push(i) for i in ids) + detok.flush()

    assert text(frozenset()) == 'Sure. [{"name": "x"}]'
    assert text(frozenset({tag})) == 'Sure.<|im_start|> [{"name": "x"}]'
    parser = PARSERS["mistral"]
    assert parser.token_ids({"[TOOL_CALLS]": 7, "[ARGS]": 9}.get) == {7, 9}
    assert PARSERS["hermes"].token_ids(tokenizer.backend.token_to_id) == frozenset()
