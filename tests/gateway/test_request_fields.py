"""Every request field works or is refused by name; the logits controls reach the engine from
both front ends and equal the engine's own output with the same parameters."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.openai_protocol import (
    NOT_SUPPORTED,
    OPENAI_COMPLETIONS_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tandem.services.gateway.token_text import TokenText
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.gateway.helpers import engine_tokens


def words(text: str) -> list[str]:
    return text.split()


# The request fields of vLLM 0.32's OpenAI server (ChatCompletionRequest, CompletionRequest:
# `model_fields` of vllm.entrypoints.openai.{chat_completion,completion}.protocol), and OpenAI's
# own chat fields beyond them (the API reference, 2026).
VLLM_CHAT_FIELDS = words("""
messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens
n presence_penalty response_format seed stop stream stream_options temperature top_p tools
tool_choice reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user
use_beam_search top_k min_p repetition_penalty watermarking length_penalty stop_token_ids
include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side prompt_logprobs
logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt continue_final_message
add_special_tokens documents chat_template chat_template_kwargs media_io_kwargs
mm_processor_kwargs structured_outputs priority request_id session_id
return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
return_prompt_text mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params
vllm_xargs repetition_detection stream_interval
""")
VLLM_COMPLETION_FIELDS = words("""
model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop
stream stream_options suffix temperature top_p user use_beam_search top_k min_p
repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output
ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens
truncation_side allowed_token_ids prompt_logprobs logprob_token_ids bad_words prompt_embeds
add_special_tokens response_format structured_outputs priority request_id session_id
return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs
repetition_detection thinking_token_budget stream_interval
""")
OPENAI_CHAT_FIELDS = words("""
audio functions function_call metadata modalities prediction prompt_cache_key safety_identifier
service_tier store verbosity web_search_options
""")
PROBE = {"probe": 1}  # a value no field takes as its default

CHAT = {"messages": [{"role": "user", "content": "Count: one, two,"}], "max_tokens": 1}


@pytest.mark.parametrize("fields,model", [
    (VLLM_CHAT_FIELDS + OPENAI_CHAT_FIELDS, ChatCompletionRequest),
    (VLLM_COMPLETION_FIELDS, CompletionRequest)])
def test_every_peer_field_is_served_or_refused_by_name(fields: list[str], model: type) -> None:
    unaccounted = [f for f in fields if f not in model.model_fields and f not in NOT_SUPPORTED]
    assert unaccounted == []


@pytest.fixture(scope="module")
def http(server: ServeAddresses) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("name", sorted(NOT_SUPPORTED))
def test_an_unsupported_field_is_refused_by_name_and_its_default_accepted(
        http: httpx.Client, name: str) -> None:
    refused = http.post("/v1/chat/completions", json={**CHAT, name: PROBE})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == (name, "unsupported")
    assert NOT_SUPPORTED[name][0] in error["message"]
    default = NOT_SUPPORTED[name][1][-1]
    accepted = http.post("/v1/chat/completions", json={**CHAT, name: default})
    assert accepted.status_code == 200, accepted.text


def test_an_unknown_field_is_refused(http: httpx.Client) -> None:
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})):
        response = http.post(path, json={**body, "temprature": 0.5})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "temprature"
        assert response.json()["error"]["code"] == "unknown_field"
    nested = http.post("/v1/chat/completions", json={
        **CHAT, "messages": [{"role": "user", "content": "Hi", "weight": 1}]})
    assert nested.status_code == 400
    assert nested.json()["error"]["param"] == "messages.0.weight"


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
    ("min_p", 1.5), ("min_tokens", -1), ("logit_bias", {"a": 1}), ("logit_bias", {"1": 101}),
    ("logit_bias", {"49152": 1}), ("stop_token_ids", [-1]), ("stop_token_ids", [10**6]),
    ("min_tokens", 5),  # above max_tokens (1)
])
def test_a_bad_control_is_400_naming_it(http: httpx.Client, field: str, value: object) -> None:
    response = http.post("/v1/chat/completions", json={**CHAT, field: value})
    assert response.status_code == 400, (field, value, response.text)
    assert response.json()["error"]["param"] == field


def test_completions_default_to_openais_16_tokens(client: openai.OpenAI,
                                                  gateway: Gateway) -> None:
    completion = client.completions.create(model=gateway.model_name, prompt="Once upon a time",
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == OPENAI_COMPLETIONS_MAX_TOKENS


@pytest.fixture(scope="module")
def stub(server: ServeAddresses) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


CONTROLS = [
    # (HTTP fields, the same as SamplingParams fields)
    ({"frequency_penalty": 1.5, "presence_penalty": 0.5},
     {"frequency_penalty": 1.5, "presence_penalty": 0.5}),
    ({"repetition_penalty": 1.4}, {"repetition_penalty": 1.4}),
    ({"logit_bias": {"42": 100}}, {"logit_bias": ((42, 100.0),)}),
    ({"stop_token_ids": [198]}, {"stop_token_ids": (198,)}),  # "\n": ends at the first
    ({"min_tokens": 12, "stop_token_ids": [198]}, {"min_tokens": 12, "stop_token_ids": (198,)}),
    ({"min_p": 0.3, "temperature": 1.0, "seed": 5},
     {"min_p": 0.3, "temperature": 1.0, "seed": 5}),
]


@pytest.mark.parametrize("fields,params", CONTROLS)
def test_controls_reach_the_engine_on_both_front_ends(
        client: openai.OpenAI, stub: pb_grpc.GenerationStub, gateway: Gateway,
        async_engine: AsyncEngine, fields: dict, params: dict) -> None:
    messages = [{"role": "user", "content": "Write the word 'the' five times."}]
    prompt = gateway.tokenizer.encode_chat(messages)
    expected = engine_tokens(async_engine, prompt, 16, **params)
    plain = engine_tokens(async_engine, prompt, 16)
    assert expected != plain  # each case changes the output
    body = {k: v for k, v in fields.items() if k not in ("temperature", "seed")}
    completion = client.chat.completions.create(
        model=gateway.model_name, messages=messages, max_tokens=16,  # type: ignore[arg-type]
        temperature=fields.get("temperature", 0), seed=fields.get("seed"),
        extra_body={**body, "return_token_ids": True})
    assert completion.choices[0].token_ids == expected  # type: ignore[attr-defined]
    grpc_fields = {k: v for k, v in body.items() if k != "logit_bias"}
    bias = {int(k): float(v) for k, v in body.get("logit_bias", {}).items()}
    sampling = pb.SamplingOptions(max_tokens=16, temperature=fields.get("temperature", 0.0),
                                  logit_bias=bias, **grpc_fields)
    if "seed" in fields:
        sampling.seed = fields["seed"]
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(**m) for m in messages]), sampling=sampling)
    ids = [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
    assert ids == expected


def test_grpc_takes_the_developer_and_tool_roles_as_http_does(
        client: openai.OpenAI, stub: pb_grpc.GenerationStub, gateway: Gateway) -> None:
    messages = [{"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "Let me check."},
                {"role": "tool", "content": "4"}]
    completion = client.chat.completions.create(
        model=gateway.model_name, messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True})
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(**m) for m in messages]), sampling=pb.SamplingOptions(
            max_tokens=6, temperature=0.0))
    ids = [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
    assert ids == completion.choices[0].token_ids  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="robot", content="hi")])), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_refuses_a_bad_control_by_name(stub: pb_grpc.GenerationStub) -> None:
    for sampling in (pb.SamplingOptions(max_tokens=4, presence_penalty=3.0),
                     pb.SamplingOptions(max_tokens=4, logit_bias={10**6: 1.0}),
                     pb.SamplingOptions(max_tokens=4, min_p=float("nan"))):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=sampling), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        field = next(f.name for f, _ in sampling.ListFields() if f.name != "max_tokens")
        assert field in info.value.details()


def test_tokenize_detokenize_and_version(http: httpx.Client, gateway: Gateway) -> None:
    tokenizer = gateway.tokenizer
    text = "Hello, world!"
    tokens = http.post("/tokenize", json={"prompt": text}).json()
    assert tokens == {"count": len(tokenizer.encode(text)), "tokens": tokenizer.encode(text),
                      "max_model_len": gateway.max_model_len}
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    back = http.post("/detokenize", json={"tokens": tokens["tokens"]})
    assert back.json() == {"prompt": text}
    for path, body, param in (("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/detokenize", {"tokens": [tokenizer.vocab_size]}, "tokens"),
                              ("/detokenize", {"tokens": [1], "model": "other"}, "model")):
        response = http.post(path, json=body)
        assert response.status_code in (400, 404), (path, body)
        assert response.json()["error"]["param"] == param
    version = http.get("/version").json()["version"]
    assert version and version[0].isdigit()
    document = http.get("/openapi.json").json()
    assert {"/tokenize", "/detokenize", "/version"} <= set(document["paths"])
    assert document["info"]["version"] == version


def test_grpc_model_info(stub: pb_grpc.GenerationStub, http: httpx.Client,
                         gateway: Gateway) -> None:
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert (info.model, info.max_model_len, info.vocab_size) == (
        gateway.model_name, gateway.max_model_len, gateway.tokenizer.vocab_size)
    assert info.server_version == http.get("/version").json()["version"]


def test_completions_echo_the_prompt(client: openai.OpenAI, gateway: Gateway) -> None:
    args = {"model": gateway.model_name, "prompt": "Once upon a time", "max_tokens": 6,
            "temperature": 0}
    plain = client.completions.create(**args).choices[0].text
    echoed = client.completions.create(**args, echo=True).choices[0].text
    assert echoed == "Once upon a time" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **args, echo=True, stream=True) if c.choices)
    assert streamed == echoed
    ids = gateway.tokenizer.encode("Once upon a time")
    by_ids = client.completions.create(**{**args, "prompt": ids}, echo=True).choices[0].text
    assert by_ids == gateway.tokenizer.decode(ids) + plain


def test_echo_with_logprobs_gives_the_prompts_logprobs(client: openai.OpenAI,
                                                       gateway: Gateway,
                                                       async_engine: AsyncEngine) -> None:
    """The prompt's tokens and logprobs (the first has none) before the completion's; the
    engine's own prompt logprobs; the same streamed and in every choice."""
    text = "Once upon a time there was"
    ids = gateway.tokenizer.encode(text)
    args = {"model": gateway.model_name, "prompt": text, "max_tokens": 4, "temperature": 0,
            "logprobs": 2}
    plain = client.completions.create(**args).choices[0]
    echoed = client.completions.create(**args, echo=True, n=2)
    engine = engine_prompt_logprobs(async_engine, ids, 2)
    for choice in echoed.choices:
        lp = choice.logprobs
        assert lp is not None and choice.text == text + plain.text
        assert lp.tokens == [TokenText(gateway.tokenizer).text(t) for t in ids] + \
            plain.logprobs.tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in engine],
                                                              abs=1e-5)
        assert lp.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs,
                                                             abs=1e-4)
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
        assert lp.text_offset[len(ids)] == len(text)  # the completion's, after the prompt
    chunks = [c for c in client.completions.create(**args, echo=True, stream=True) if c.choices]
    first = chunks[0].choices[0]
    assert first.text == text
    assert first.logprobs.token_logprobs == echoed.choices[0].logprobs.token_logprobs[:len(ids)]
    later = [o for c in chunks[1:] for o in c.choices[0].logprobs.text_offset]
    assert later == echoed.choices[0].logprobs.text_offset[len(ids):]


def engine_prompt_logprobs(engine: AsyncEngine, prompt: list[int], top: int) -> list:
    async def run() -> list:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top)
        async for out in engine.generate(GenerationRequest(
            f"ref-{uuid.uuid4().hex}", prompt, params)):
            return list(out.prompt_logprobs or ())
        return []

    return asyncio.run(run())


def test_chat_template_kwargs_reach_the_template(http: httpx.Client, gateway: Gateway) -> None:
    from tandem.services.engine.tokenizer import Tokenizer

    base = gateway.tokenizer
    templated = Tokenizer(base.backend, base.eos_token_ids, chat_template=(
        "{% if enable_thinking %}<think>{% endif %}{% for m in messages %}{{ m['content'] }}"
        "{% endfor %}"))
    messages = [{"role": "user", "content": "Hi"}]
    assert templated.apply_chat_template(messages, extra={"enable_thinking": True}) == \
        "<think>Hi"
    assert templated.apply_chat_template(messages) == "Hi"
    with pytest.raises(ValueError, match="messages"):
        templated.apply_chat_template(messages, extra={"messages": []})
    ok = http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {
        "enable_thinking": False}})
    assert ok.status_code == 200
    refused = http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {
        "add_generation_prompt": False}})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs"


def test_the_models_sampling_defaults_fill_what_a_request_leaves_unset(
        async_engine: AsyncEngine, gateway: Gateway) -> None:
    """GatewayConfig.sampling_defaults (a model's generation_config.json): a request without
    temperature or repetition_penalty gets the model's; one that sets them keeps its own."""
    from tandem.services.gateway.config import GatewayConfig
    from tests.gateway.helpers import serving

    tuned = Gateway(gateway.backend, gateway.tokenizer, GatewayConfig(
        sampling_defaults={"temperature": 0.0, "repetition_penalty": 1.5}))
    messages = [{"role": "user", "content": "Write the word 'the' five times."}]
    prompt = gateway.tokenizer.encode_chat(messages)
    with serving(tuned) as addresses, httpx.Client(base_url=addresses.http_url,
                                                   timeout=60) as http:
        def tokens(**fields: object) -> list[int]:
            response = http.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 12, "return_token_ids": True, **fields})
            return response.json()["choices"][0]["token_ids"]

        assert tokens() == engine_tokens(async_engine, prompt, 12, repetition_penalty=1.5)
        assert tokens(repetition_penalty=1.0) == engine_tokens(async_engine, prompt, 12)
