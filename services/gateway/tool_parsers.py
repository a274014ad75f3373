"""Tool-call parsers, one per model family: how a reply under ``tool_choice`` auto writes its
calls, as the family's chat template writes an assistant turn that made them.

- ``hermes`` (Qwen2.5, Hermes 2/3, and Tandem's own tools prompt): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks; a reply that is one such JSON object alone also
  counts.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (tokenizers before
  v11) or ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11 and later).
- ``llama3_json`` (Llama 3.1-3.3, Llama 4 JSON): ``{"name": ..., "parameters": {...}}``,
  perhaps after ``<|python_tag|>``, several separated by ``;``.
- ``pythonic`` (Llama 3.2 and 4 pythonic templates, many small models): the reply is a Python
  list of calls with keyword arguments, ``[get_weather(city="Paris"), get_time(tz="CET")]``,
  perhaps inside ``<|python_start|>...<|python_end|>``. Read with ``ast`` (literals only), never
  evaluated.
- ``qwen3_coder`` (Qwen3-Coder's XML): ``<tool_call><function=name><parameter=key>value
  </parameter>...</function></tool_call>``; each value is read by its parameter's schema type.

``pick`` chooses by the ``tool_call_parser`` setting; ``auto`` reads the model's chat template
(which family's format it writes tool calls in) and falls back to ``hermes``, the format
Tandem's own tools prompt teaches where the template does not render tools.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

Call = tuple[str, dict[str, Any]]  # a call's function name and its arguments

# vLLM's names for the same parsers.
ALIASES = {"llama4_json": "llama3_json", "llama4_pythonic": "pythonic",
           "qwen3_xml": "qwen3_coder"}


@dataclass(frozen=True)
class ToolParser:
    """``markers``: text at which a call may begin (a reply is held from there while it
    streams); ``bare``: a reply that opens with this (after whitespace) may be all calls;
    ``tags``: the tags the parser reads, which some vocabularies hold as special tokens;
    ``head``: a call's start, up to where its JSON arguments begin (``next_call``); None: the
    family's arguments are not JSON text as written, and its calls go out whole once the
    reply ends."""

    name: str
    markers: tuple[str, ...]
    bare: str | None
    tags: tuple[str, ...]
    head: re.Pattern[str] | None = None

    def parse(self, text: str, schemas: dict[str, dict[str, Any]]
              ) -> tuple[str, list[Call]] | None:
        """The reply's content and its calls, or None if it holds no well-formed call of one
        of the functions (``schemas``: each function's parameters)."""
        try:
            found = _PARSE[self.name](text, schemas)
        except (ValueError, SyntaxError, TypeError, RecursionError):  # malformed calls
            return None
        if found is None or not found[1]:
            return None
        content, calls = found
        if any(name not in schemas or not isinstance(args, dict) for name, args in calls):
            return None
        return content.strip(), calls

    def next_call(self, text: str, at: int) -> tuple[str, int] | None:
        """The next call's function name in ``text`` from ``at``, and where its arguments (a
        JSON object) begin; None: no call's start there yet, or a family without ``head``."""
        found = self.head.search(text, at) if self.head is not None else None
        if found is None:
            return None
        groups = found.groupdict()
        try:
            name = json.loads(groups["name"]) if groups["name"] is not None else groups["bare"]
        except json.JSONDecodeError:
            return None
        return (name, found.end()) if isinstance(name, str) else None

    def token_ids(self, token_to_id: Callable[[str], int | None]) -> frozenset[int]:
        """The ids of the tags that are tokens of their own (``token_to_id``: the
        tokenizer's): a reply's text keeps them, special or not."""
        ids = (token_to_id(tag) for tag in self.tags)
        return frozenset(i for i in ids if i is not None)


_XML = ("<tool_call>", "</tool_call>")
# A call object's head, up to its arguments' opening brace: {"name": "f", "arguments": {
_JSON_HEAD = re.compile(r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,'
                        r'\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_MISTRAL_HEAD = re.compile(  # both of Mistral's forms: a JSON list of calls, or name[ARGS]{
    rf"{_JSON_HEAD.pattern}|\[TOOL_CALLS\]\s*(?P<bare>[A-Za-z0-9_.-]+)\s*\[ARGS\]\s*(?=\{{)")
PARSERS = {
    "hermes": ToolParser("hermes", ("<tool_call>",), "{", _XML, _JSON_HEAD),
    "mistral": ToolParser("mistral", ("[TOOL_CALLS]",), None, ("[TOOL_CALLS]", "[ARGS]"),
                          _MISTRAL_HEAD),
    "llama3_json": ToolParser("llama3_json", ("<|python_tag|>",), "{", ("<|python_tag|>",),
                              _JSON_HEAD),
    "pythonic": ToolParser("pythonic", ("<|python_start|>",), "[",
                           ("<|python_start|>", "<|python_end|>")),
    "qwen3_coder": ToolParser("qwen3_coder", ("<tool_call>",), None, _XML),
}
NAMES = ("auto", *PARSERS)


def pick(setting: str, template_sources: Iterable[str]) -> ToolParser:
    """The parser the setting names; ``auto``: the one the chat template's own tool-call
    format is (``hermes`` if it shows none)."""
    setting = ALIASES.get(setting, setting)
    if setting != "auto":
        return PARSERS[setting]
    text = "\n".join(template_sources)
    if "[TOOL_CALLS]" in text:
        return PARSERS["mistral"]
    if "<function=" in text and "<parameter=" in text:
        return PARSERS["qwen3_coder"]
    if "<tool_call>" in text:
        return PARSERS["hermes"]
    if "<|python_start|>" in text or re.search(r"\[func_name1\(", text):
        return PARSERS["pythonic"]
    if "<|python_tag|>" in text or '"parameters": ' in text or "ipython" in text:
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]


# -- The families ----------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str, schemas: dict[str, dict[str, Any]]) -> tuple[str, list[Call]] | None:
    blocks = _HERMES.findall(text)
    if not blocks:
        return "", [_json_call(json.loads(text))]  # one JSON object, alone
    return _HERMES.sub("", text), [_json_call(json.loads(block)) for block in blocks]


def _mistral(text: str, schemas: dict[str, dict[str, Any]]) -> tuple[str, list[Call]] | None:
    content, marker, rest = text.partition("[TOOL_CALLS]")
    if not marker:
        return None
    if rest.lstrip().startswith("["):  # one JSON array of calls
        calls = json.loads(rest)
        if not isinstance(calls, list):
            return None
        return content, [_json_call(call) for call in calls]
    found: list[Call] = []
    for part in rest.split("[TOOL_CALLS]"):  # name[ARGS]{...}, once per call
        name, args_marker, arguments = part.partition("[ARGS]")
        if not args_marker:
            return None
        found.append((name.strip(), _object(json.loads(arguments))))
    return content, found


def _llama3_json(text: str, schemas: dict[str, dict[str, Any]]
                 ) -> tuple[str, list[Call]] | None:
    content, marker, rest = text.partition("<|python_tag|>")
    if not marker:
        content, rest = "", text
    decoder, found, at = json.JSONDecoder(), [], 0
    while True:
        at = len(rest) - len(rest[at:].lstrip())
        if at == len(rest):
            return content, found
        if found:  # calls are separated by ";"
            if rest[at] != ";":
                return None
            at = len(rest) - len(rest[at + 1:].lstrip())
        value, at = decoder.raw_decode(rest, at)
        found.append(_json_call(value))


def _pythonic(text: str, schemas: dict[str, dict[str, Any]]) -> tuple[str, list[Call]] | None:
    content, marker, rest = text.partition("<|python_start|>")
    if not marker:
        content, rest = "", text
    rest = rest.replace("<|python_end|>", "")
    tree = ast.parse(rest.strip(), mode="eval").body
    if not isinstance(tree, ast.List):
        return None
    found: list[Call] = []
    for call in tree.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            return None
        found.append((call.func.id, {k.arg: ast.literal_eval(k.value) for k in call.keywords
                                     if k.arg is not None}))
    return content, found


_QWEN_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>",
                        re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _qwen3_coder(text: str, schemas: dict[str, dict[str, Any]]
                 ) -> tuple[str, list[Call]] | None:
    found: list[Call] = []
    for name, body in _QWEN_CALL.findall(text):
        properties = (schemas.get(name) or {}).get("properties") or {}
        found.append((name, {key: _typed(value, properties.get(key) or {})
                             for key, value in _QWEN_PARAMETER.findall(body)}))
    rest = _QWEN_CALL.sub("", text)
    if "<tool_call>" in rest:  # a call cut short or malformed
        return None
    return rest, found


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A Qwen3-Coder parameter's text as its schema's type reads it (strings as written)."""
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds == {"string"}:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # not JSON: the text, as a string parameter


def _json_call(value: object) -> Call:
    """``{"name": ..., "arguments" | "parameters": {...}}`` (arguments perhaps as JSON text, as
    Mistral's templates write earlier turns' calls)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("not a call")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return value["name"], _object(arguments)


def _object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("arguments are not an object")
    return value


_PARSE = {"hermes": _hermes, "mistral": _mistral, "llama3_json": _llama3_json,
          "pythonic": _pythonic, "qwen3_coder": _qwen3_coder}

