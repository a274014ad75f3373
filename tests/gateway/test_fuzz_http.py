"""Schema-driven fuzzing of the HTTP API: the served OpenAPI document, and schemathesis against it.

Valid and invalid requests, generated from /openapi.json itself, go to a real uvicorn server over
the real gateway and engine: none may get a 5xx, every status and body must be the documented
one, every invalid request a 4xx with an OpenAI error body, and the server keeps serving.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.conftest import MAX_MODEL_LEN
from tests.gateway.helpers import FUZZ_MAX_TOKENS, wait_engine_idle

# Every generated request stops after a few tokens: unset max_tokens defaults to this, and larger
# valid values are folded into 1..MAX_TOKENS (values over the context length stay: they are 400).
MAX_TOKENS = FUZZ_MAX_TOKENS
MAX_EXAMPLES = 40  # per operation and generation mode, in the fuzzing phase
SEED = 20240611


def test_openapi_document_is_valid(server: ServeAddresses) -> None:
    document = httpx.get(f"{server.http_url}/openapi.json", timeout=30).json()
    validate(document)  # OpenAPI 3.1, every $ref resolvable
    assert document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/completions", "CompletionRequest")):
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}
        for status in ("400", "401", "404", "413", "429", "504"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}
        assert {"application/json", "text/event-stream"} <= set(
            operation["responses"]["200"]["content"])
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert "ChatMessage" in schemas and "StreamOptions" in schemas
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "param", "code"]
    docs = httpx.get(f"{server.http_url}/docs", timeout=30)
    assert docs.status_code == 200 and "/openapi.json" in docs.text



@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServeAddresses) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict({"seed": SEED})
    return schemathesis.openapi.from_url(f"{fuzz_server.http_url}/openapi.json", config=config,
                                         timeout=30)


# Every operation that takes input; GET /v1/models has none (its one case is fuzzed too). A
# GET or DELETE has nothing to make invalid (its path parameter is any string).
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("POST", "/v1/messages"),
              ("DELETE", "/v1/responses/{response_id}"),
              ("GET", "/v1/models/{model}"), ("GET", "/v1/models")]
CHECKS = [schemathesis.checks.not_a_server_error, status_code_conformance,
          content_type_conformance, response_schema_conformance, negative_data_rejection]


def test_every_operation_is_fuzzed(api_schema: schemathesis.BaseSchema) -> None:
    served = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert {op for op in served if op[1].startswith("/v1/")} == set(OPERATIONS)


def _bound(body: Any) -> None:
    """Keep a generated body cheap to serve without making it valid or invalid."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if (isinstance(value, int | float) and not isinstance(value, bool)
                and float(value).is_integer() and MAX_TOKENS < value <= MAX_MODEL_LEN):
            body[key] = int(value) % MAX_TOKENS + 1
    timeout = body.get("timeout")  # a valid but tiny deadline is a legitimate 504
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout < 60:
        body["timeout"] = 60


def _check(case: schemathesis.Case) -> None:
    _bound(case.body)
    response = case.call_and_validate(timeout=60, checks=CHECKS)
    meta = case.meta
    negative = meta is not None and meta.generation.mode == GenerationMode.NEGATIVE
    if response.status_code >= 400 and case.path == "/v1/messages":  # Anthropic's errors
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    elif response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        # An invalid field is named, unless the JSON itself could not be read.
        if (negative and response.status_code == 400 and isinstance(case.body, dict)
                and error["code"] != "invalid_json"):
            assert error["param"], (case.body, error)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method, path, mode", [
    (method, path, mode) for method, path in OPERATIONS for mode in GenerationMode
    if mode == GenerationMode.POSITIVE or method == "POST"])
def test_fuzz_http(api_schema: schemathesis.BaseSchema, method: str, path: str,
                   mode: GenerationMode) -> None:
    strategy = api_schema[path][method].as_strategy(generation_mode=mode)

    @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=30_000, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(case=strategy)
    def fuzz(case: schemathesis.Case) -> None:
        _check(case)

    fuzz()


def test_serves_after_fuzzing(fuzz_server: ServeAddresses, async_engine: AsyncEngine) -> None:
    wait_engine_idle(async_engine)
    for path, body in (
            ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0,
                                 "ignore_eos": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 2, "temperature": 0, "ignore_eos": True})):
        response = httpx.post(f"{fuzz_server.http_url}{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2


# Found by the fuzzing above, kept as plain regression tests.

def test_a_tiny_top_p_keeps_the_best_token(server: ServeAddresses) -> None:
    """top_p 5e-324 rounded to 0 in the sampler's float32, dropped every token and failed the
    engine step (500); any top_p up to the best token's probability is greedy."""
    def text(**sampling: object) -> str:
        response = httpx.post(f"{server.http_url}/v1/completions", timeout=60, json={
            "prompt": "The sky is", "max_tokens": 4, "ignore_eos": True, "seed": 1, **sampling})
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    greedy = text(temperature=0)
    for top_p in (5e-324, 1e-300, 1e-45, 1e-9):
        assert text(temperature=1.0, top_p=top_p) == greedy


@pytest.mark.parametrize("field, value", [
    ("seed", True), ("max_tokens", "8"), ("max_tokens", True), ("stream", 1),
    ("temperature", "0.5"), ("ignore_eos", "false"), ("top_k", 2.5), ("prompt", [True]),
])
def test_values_of_another_type_are_400(server: ServeAddresses, field: str,
                                        value: object) -> None:
    """Were converted (`"seed": true` was seed 1): the documented type or a 400 naming it."""
    body = {"prompt": "Hi", "max_tokens": 1, field: value}
    response = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


def test_integral_numbers_are_integers(server: ServeAddresses) -> None:
    """JSON Schema's integers, which the OpenAPI document promises, include 2.0."""
    response = httpx.post(f"{server.http_url}/v1/completions", timeout=60, json={
        "prompt": [1.0, 2.0], "max_tokens": 2.0, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 2)
