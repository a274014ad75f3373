"""Structured output in the engine: JSON schemas, regexes, choices and grammars hold for greedy
and sampled requests, with speculation and resumed elsewhere, token for token the same."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tandem.services.engine.config import SpeculativeConfig
from tandem.services.engine.grammar import Grammars
from tandem.services.protocol.request import SamplingParams, StructuredOutput
from tests.engine.helpers import chat, run

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"enum": ["Paris", "Tokyo", "Lima"]}}}
PROMPTS = ["Describe a person as JSON.", "Give me a JSON record of a famous scientist.",
           "Who lives in Tokyo? Answer in JSON."]


def json_params(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=80, structured_output=StructuredOutput(
        "json", json.dumps(PERSON)), **kw)  # type: ignore[arg-type]


def test_json_schema_output_validates_greedy_and_sampled(make_engine):  # type: ignore[no-untyped-def]
    engine = make_engine()
    for i, text in enumerate(PROMPTS):
        for params in (json_params(temperature=0.0), json_params(temperature=1.0, seed=i)):
            tokens = run(engine, chat(engine, text), params)
            document = json.loads(engine.tokenizer.decode(tokens))
            jsonschema.validate(document, PERSON)


def test_every_path_gives_the_same_tokens(make_engine):  # type: ignore[no-untyped-def]
    """With ngram speculation (drafts checked against the grammar) and resumed from the first
    tokens (the new engine's matcher is fed the output so far)."""
    plain, spec = make_engine(), make_engine(speculative=SpeculativeConfig(method="ngram"))
    prompt = chat(plain, PROMPTS[0])
    for params in (json_params(temperature=0.0), json_params(temperature=0.8, seed=4)):
        whole = run(plain, prompt, params)
        assert run(spec, prompt, params) == whole
        assert whole[:5] + run(spec, prompt, params, output=whole[:5]) == whole


def test_regex_choice_and_grammar(make_engine):  # type: ignore[no-untyped-def]
    engine = make_engine()
    prompt = chat(engine, "What is the date today?")
    cases = [
        (StructuredOutput("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
         lambda text: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text)),
        (StructuredOutput("choice", json.dumps(["yes", "no", "maybe later"])),
         lambda text: text in ("yes", "no", "maybe later")),
        (StructuredOutput("grammar", 'start: "The answer is " NUMBER\nNUMBER: /[0-9]+/'),
         lambda text: re.fullmatch(r"The answer is [0-9]+", text)),
        (StructuredOutput("grammar", 'root ::= "A" | "B" "C"'),  # GBNF
         lambda text: text in ("A", "BC")),
    ]
    for constraint, holds in cases:
        for params in (SamplingParams(max_tokens=24, temperature=0.0,
                                      structured_output=constraint),
                       SamplingParams(max_tokens=24, temperature=1.0, seed=9,
                                      structured_output=constraint)):
            tokens = run(engine, prompt, params)
            text = engine.tokenizer.decode(tokens)
            assert holds(text), (constraint, text)
            assert engine.block_manager.num_free_blocks == engine.kv_spec.num_blocks


def test_a_bad_constraint_is_named(loaded_model) -> None:  # type: ignore[no-untyped-def]
    grammars = Grammars(loaded_model.tokenizer, loaded_model.config.vocab_size, [2])
    assert grammars.problem(StructuredOutput("json", json.dumps(PERSON))) is None
    for constraint, words in ((StructuredOutput("regex", "[a-"), "regex"),
                              (StructuredOutput("json", "{not json"), "not JSON"),
                              (StructuredOutput("json", '{"type": "objectx"}'), "objectx"),
                              (StructuredOutput("choice", "[]"), "choice"),
                              (StructuredOutput("grammar", "start: undefined_rule"), "undefined")):
        problem = grammars.problem(constraint)
        assert problem is not None and words in problem, (constraint, problem)
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("yaml", "")
