"""What agent clients send: session names, reasoning_effort, add_special_tokens, earlier
assistant turns as the API returned them (refusal, annotations, reasoning), cache_control on a
text part, X-Request-Id, and cross-origin calls when the operator allows them; over real HTTP
with the official client where it applies."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.openai_protocol import ChatCompletionRequest
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import serving


@pytest.fixture(scope="module")
def http(server: ServeAddresses) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


def chat(http: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
        **fields})


def test_agent_fields_are_accepted_and_an_earlier_turn_renders_as_the_model_said_it(
        http: httpx.Client, client: openai.OpenAI, gateway: Gateway) -> None:
    refusal = "I cannot help with that."
    agent = [{"role": "user", "content": [{"type": "text", "text": "Do something bad.",
                                           "cache_control": {"type": "ephemeral"}}]},
             {"role": "assistant", "content": None, "refusal": refusal,
              "annotations": [{"type": "url_citation"}], "reasoning_content": "It is bad."},
             {"role": "user", "content": "Then say hello."}]
    plain = [{"role": "user", "content": "Do something bad."},
             {"role": "assistant", "content": refusal},
             {"role": "user", "content": "Then say hello."}]
    # The official client, with the fields agent frameworks send.
    completion = client.chat.completions.create(
        model=gateway.model_name, messages=agent, max_tokens=4, temperature=0,  # type: ignore[arg-type]
        prompt_cache_key="conversation-7", reasoning_effort="low",
        extra_body={"session_id": "conversation-7", "add_special_tokens": False,
                    "return_token_ids": True})
    expected = chat(http, plain)
    assert expected.status_code == 200, expected.text
    assert completion.prompt_token_ids == expected.json()["prompt_token_ids"]  # type: ignore[attr-defined]
    assert completion.choices[0].token_ids == expected.json()["choices"][0]["token_ids"]  # type: ignore[attr-defined]


def test_a_reasoning_turn_reaches_the_template_as_reasoning_content() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "assistant", "content": "4", "reasoning": "2+2"},
        {"role": "assistant", "content": "5", "reasoning_content": "2+3"},
        {"role": "assistant", "content": "6"}], "reasoning_effort": "high",
        "chat_template_kwargs": {"enable_thinking": True}}, strict=False)
    assert [m.get("reasoning_content") for m in body.chat_messages()] == ["2+2", "2+3", None]
    assert body.template_kwargs() == {"enable_thinking": True, "reasoning_effort": "high"}


@pytest.mark.parametrize("fields,param", [
    ({"prompt_cache_key": "a", "session_id": "b"}, "session_id"),
    ({"session_id": ""}, "session_id"),
    ({"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
     "reasoning_effort"),
])
def test_a_bad_agent_field_is_400_naming_it(http: httpx.Client, fields: dict[str, Any],
                                            param: str) -> None:
    response = chat(http, [{"role": "user", "content": "Hi"}], **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_add_special_tokens_puts_the_tokenizers_bos_where_the_model_has_one(
        http: httpx.Client, gateway: Gateway) -> None:
    tokenizer = gateway.tokenizer
    messages = [{"role": "user", "content": "Hi"}]
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos else []
    off = chat(http, messages, add_special_tokens=False).json()["prompt_token_ids"]
    on = chat(http, messages, add_special_tokens=True).json()["prompt_token_ids"]
    assert on == bos + off == bos + tokenizer.encode_chat(messages)
    completion = http.post("/v1/completions", json={
        "prompt": "Hi there", "max_tokens": 1, "add_special_tokens": False,
        "return_token_ids": True})
    assert completion.json()["prompt_token_ids"] == tokenizer.encode(
        "Hi there", add_special_tokens=False)


def test_x_request_id_comes_back_on_answers_refusals_and_streams(http: httpx.Client) -> None:
    headers = {"x-request-id": "trace-42"}
    ok = http.post("/v1/chat/completions", headers=headers, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    refused = http.post("/v1/chat/completions", headers=headers, json={"messages": []})
    too_big = http.post("/v1/chat/completions", headers=headers, content=b"x" * (2 << 20))
    with http.stream("POST", "/v1/chat/completions", headers=headers, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "stream": True}) as stream:
        streamed = stream.headers.get("x-request-id")
        stream.read()
    assert [ok.status_code, refused.status_code, too_big.status_code] == [200, 400, 413]
    assert {r.headers.get("x-request-id") for r in (ok, refused, too_big)} == {"trace-42"}
    assert streamed == "trace-42"
    # Not a header value we repeat: too long, or not visible ASCII.
    for bad in ("x" * 129, "a b"):
        response = http.get("/v1/models", headers={"x-request-id": bad})
        assert response.status_code == 200 and "x-request-id" not in response.headers


@pytest.fixture(scope="module")
def cors_server(async_engine: AsyncEngine, loaded_model: LoadedModel
                ) -> Iterator[ServeAddresses]:
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                      GatewayConfig(cors_allow_origins=("https://app.example.com",)))
    with serving(gateway) as addresses:
        yield addresses


def test_cross_origin_calls_only_from_the_origins_allowed(cors_server: ServeAddresses,
                                                          server: ServeAddresses) -> None:
    preflight = {"origin": "https://app.example.com", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    with httpx.Client(base_url=cors_server.http_url, timeout=60) as http:
        allowed = http.options("/v1/chat/completions", headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "POST" in allowed.headers["access-control-allow-methods"]
        other = http.options("/v1/chat/completions",
                             headers={**preflight, "origin": "https://evil.example"})
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        response = http.post("/v1/chat/completions", headers={
            "origin": "https://app.example.com"}, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://app.example.com"
    # The default gateway allows no origin.
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        default = http.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in default.headers
