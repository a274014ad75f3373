"""Structured output through the gateway (one process, the engine colocated): OpenAI's
response_format, vLLM's structured_outputs and guided_* fields, gRPC's oneof; bad constraints
are 400s naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import grpc
import httpx
import jsonschema
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tandem.services.protocol.request import StructuredOutput
from tests.gateway.helpers import engine_tokens

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
# Ten prompts, each greedy and sampled: 20 JSON-schema requests through the colocated path (the
# e2e test sends 20 through prefill and a speculating decode worker).
PROMPTS = ["Describe a person.", "Who wrote Hamlet?", "Tell me about a pilot.",
           "Invent a character for a novel.", "Who is your favourite scientist?",
           "Describe a chef.", "Tell me about a sailor.", "Who painted the Mona Lisa?",
           "Describe a teacher.", "Tell me about an astronaut."]


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_response_format_json_schema_validates(client: openai.OpenAI, gateway: Gateway) -> None:
    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for i, text in enumerate(PROMPTS):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": i}):
            completion = client.chat.completions.create(
                model=gateway.model_name, messages=ask(text), max_tokens=60,  # type: ignore[arg-type]
                response_format=schema_format, **sampling)  # type: ignore[arg-type]
            choice = completion.choices[0]
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_json_object_regex_choice_and_grammar(client: openai.OpenAI, gateway: Gateway) -> None:
    def text(**kw: object) -> str:
        completion = client.chat.completions.create(
            model=gateway.model_name, messages=ask("What day is it?"), max_tokens=40,  # type: ignore[arg-type]
            temperature=0, **kw)  # type: ignore[arg-type]
        return completion.choices[0].message.content or ""

    assert isinstance(json.loads(text(response_format={"type": "json_object"})), dict)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
                        text(extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}))
    assert text(extra_body={"structured_outputs": {"choice": ["Monday", "Friday"]}}) in (
        "Monday", "Friday")
    assert text(extra_body={"guided_choice": ["up", "down"]}) in ("up", "down")
    assert re.fullmatch(r"Day [0-9]+", text(extra_body={
        "structured_outputs": {"grammar": 'start: "Day " /[0-9]+/'}}))
    completion = client.completions.create(model=gateway.model_name, prompt="The answer:",
                                           max_tokens=8, temperature=0,
                                           extra_body={"guided_choice": ["yes", "no"]})
    assert completion.choices[0].text in ("yes", "no")


@pytest.fixture(scope="module")
def http(server: ServeAddresses) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_json": "x" * 70_000}, "structured_output"),
    # JSON in a string is nested as deep as its text allows: refused by depth (it was a 500).
    ({"guided_json": '{"type":"object","properties":{"a":' * 1000 + "{}" + "}}" * 1000},
     "guided_json"),
])
def test_a_bad_constraint_is_400_naming_the_field(http: httpx.Client, fields: dict,
                                                  param: str) -> None:
    response = http.post("/v1/chat/completions", json={
        "messages": ask("Hi"), "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert http.post("/v1/chat/completions", json={
        "messages": ask("Hi"), "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def stub(server: ServeAddresses) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


def test_grpc_constraints_give_the_engines_tokens(stub: pb_grpc.GenerationStub,
                                                  gateway: Gateway,
                                                  async_engine: AsyncEngine) -> None:
    prompt = gateway.tokenizer.encode_chat(ask(PROMPTS[0]))
    cases = [
        (pb.SamplingOptions(json_schema=json.dumps(PERSON)),
         StructuredOutput("json", json.dumps(PERSON))),
        (pb.SamplingOptions(choice=pb.Choices(choices=["red", "green"])),
         StructuredOutput("choice", json.dumps(["red", "green"]))),
        (pb.SamplingOptions(regex="[a-z]+ [0-9]"), StructuredOutput("regex", "[a-z]+ [0-9]")),
    ]
    for sampling, constraint in cases:
        sampling.max_tokens, sampling.temperature = 40, 0.0
        ids = [t for r in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                           sampling=sampling), timeout=60)
               for t in r.token_ids]
        assert ids == engine_tokens(async_engine, prompt, 40, structured_output=constraint)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(
            regex="[a-")), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "regex" in (info.value.details() or "")
