"""Structured output: a request's constraint (a JSON schema, a regex, a choice, a grammar),
compiled by llguidance into a matcher that says which tokens may come next.

Why llguidance (not xgrammar): it needs nothing but its Rust extension (no torch, no
transformers), so the gateway, which knows no torch, compiles and checks a request's grammar
with the same code the engines run; it takes JSON schemas, regexes and Lark grammars (GBNF is
converted); its masks cost ~0.04 ms a token for SmolLM2's 49,152-token vocabulary on this
machine, so they are computed inline; and it is maintained by the Guidance team and used by
vLLM and llama.cpp.

A constraint (``StructuredOutput``) travels in ``SamplingParams.structured_output``; every
engine (prefill, decode, colocated, a migrated stream's new worker) builds its own matcher from
it and feeds it the output so far, so the masks, and therefore the tokens, are the same on every
path.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.protocol.request import StructuredOutput

# Compact JSON (no free whitespace): a small model given free whitespace can emit it forever.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def _lark_string(text: str) -> str:
    return json.dumps(text)  # Lark string literals take JSON's escapes


MAX_SPEC_DEPTH = 64  # nesting of a JSON schema or choice list (deeper: refused, not a 500)


def _spec_json(text: str, what: str) -> object:
    """``text`` parsed, nested at most ``MAX_SPEC_DEPTH`` levels (ValueError otherwise)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"the {what} is nested more than {MAX_SPEC_DEPTH} levels deep") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the {what} is not JSON: {exc}") from None
    stack = [(value, 1)]
    while stack:  # iteratively: the check itself cannot recurse too deeply
        item, depth = stack.pop()
        if depth > MAX_SPEC_DEPTH:
            raise ValueError(f"the {what} is nested more than {MAX_SPEC_DEPTH} levels deep")
        children = item.values() if isinstance(item, dict) else (
            item if isinstance(item, list) else ())
        stack.extend((child, depth + 1) for child in children)
    return value


@functools.lru_cache(maxsize=256)
def compiled(constraint: StructuredOutput) -> str:
    """The llguidance grammar of ``constraint`` (raises ValueError when it is malformed)."""
    match constraint.kind:
        case "json":
            schema = _spec_json(constraint.spec, "JSON schema")
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema is an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
        case "choice":
            choices = _spec_json(constraint.spec, "choice list")
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise ValueError("a choice is a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(_lark_string(c) for c in choices))
        case _:
            try:  # Lark as is (a `start:` rule); anything else is read as GBNF
                lark = any_to_lark(constraint.spec)
            except Exception as exc:  # the converter raises whatever its parser meets
                raise ValueError(f"the grammar is neither Lark nor GBNF: {exc}") from None
            return llguidance.LLMatcher.grammar_from_lark(lark)


class Grammars:
    """Matchers for one tokenizer (its llguidance form is built once, on first use: ~0.5 s)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        """``vocab_size``: the model's (default: the tokenizer's); ``eos_token_ids``: the
        tokens that end an output where the grammar is complete (default: the tokenizer's)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size or tokenizer.vocab_size
        self._eos = list(eos_token_ids or tokenizer.eos_token_ids)

    @functools.cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(self._tokenizer.backend.to_str(),
                                      n_vocab=self._vocab_size, eos_token=self._eos)

    def problem(self, constraint: StructuredOutput) -> str | None:
        """Why ``constraint`` cannot be served (a message for the client), or None."""
        try:
            grammar = compiled(constraint)
        except ValueError as exc:
            return str(exc)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer)
        return error or None

    def matcher(self, constraint: StructuredOutput, output: list[int]) -> llguidance.LLMatcher:
        """A matcher that has consumed ``output`` (a resumed request's tokens so far)."""
        matcher = llguidance.LLMatcher(self._ll_tokenizer, compiled(constraint), log_level=0)
        if output:
            matcher.consume_tokens(output)
        return matcher
