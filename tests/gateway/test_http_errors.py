"""Bad requests get a clear 4xx in OpenAI's error format, and the server keeps serving."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.runner import GatewayServer, ServeAddresses
from tests.gateway.conftest import MAX_MODEL_LEN
from tests.gateway.helpers import wait_engine_idle, wait_until


def error_of(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def post(server: ServeAddresses, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{server.http_url}{path}", timeout=60, **kwargs)  # type: ignore[arg-type]


def assert_still_serving(client: openai.OpenAI, gateway: Gateway) -> None:
    reply = client.completions.create(model=gateway.model_name, prompt="Hello", max_tokens=2,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 2


def test_invalid_json(server: ServeAddresses, client: openai.OpenAI, gateway: Gateway) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = post(server, path, content=b'{"model": "x", "prompt": ',
                        headers={"content-type": "application/json"})
        assert response.status_code == 400
        error = error_of(response)
        assert "not valid JSON" in str(error["message"]) and error["code"] == "invalid_json"
    response = post(server, "/v1/completions", json=["not", "an", "object"])
    assert response.status_code == 400
    assert_still_serving(client, gateway)


@pytest.mark.parametrize("body, words", [
    (b'{"prompt": "Hi", "temperature": NaN}', "NaN"),
    (b'{"prompt": "Hi", "top_p": Infinity}', "Infinity"),
    (b'{"prompt": "Hi", "max_tokens": -Infinity}', "-Infinity"),
    (b'{"prompt": "Hi", "seed": ' + b"9" * 5000 + b"}", "more than 32 digits"),
    (b'{"prompt": "Hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested"),
    (b'{"prompt": "Hi", "logit_bias": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}", "nested"),
])
def test_hostile_json_is_400(server: ServeAddresses, client: openai.OpenAI, gateway: Gateway,
                             body: bytes, words: str) -> None:
    response = post(server, "/v1/completions", content=body,
                    headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["code"] == "invalid_json" and words in str(error["message"])
    assert_still_serving(client, gateway)


def test_a_tiny_temperature_is_greedy(client: openai.OpenAI, gateway: Gateway) -> None:
    """temperature 1e-40 would overflow logits / T: below 1e-5 it is greedy, as in vLLM."""
    def text(temperature: float) -> str:
        reply = client.completions.create(model=gateway.model_name, prompt="The sky is",
                                          max_tokens=8, temperature=temperature,
                                          extra_body={"ignore_eos": True})
        return reply.choices[0].text

    assert text(1e-40) == text(0.0)


@pytest.mark.parametrize("kwargs, param, words", [
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"extra_body": {"top_k": -5}}, "top_k", "greater than or equal to -1"),
    ({"extra_body": {"num_speculative_tokens": 0}}, "num_speculative_tokens",
     "greater than or equal to 1"),
    ({"extra_body": {"num_speculative_tokens": 17}}, "num_speculative_tokens",
     "less than or equal to 16"),
])
def test_invalid_values_are_400(client: openai.OpenAI, gateway: Gateway,
                                kwargs: dict[str, object], param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=gateway.model_name, prompt="Hi", **kwargs)  # type: ignore[call-overload]
    assert info.value.status_code == 400
    assert info.value.param == param
    assert words in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=gateway.model_name,  # type: ignore[call-overload]
                                       messages=[{"role": "user", "content": "Hi"}], **kwargs)
    assert info.value.param == param


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    assert "gpt-17" in info.value.message and info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_prompt_over_the_context_length_is_400(client: openai.OpenAI, gateway: Gateway) -> None:
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=gateway.model_name, prompt=long_prompt, max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length is 1024 tokens" in info.value.message
    # Prompt + max_tokens over the context length is refused the same way.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=gateway.model_name, max_tokens=MAX_MODEL_LEN,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert_still_serving(client, gateway)


def test_unsupported_features_are_400(client: openai.OpenAI, gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.completions.create(model=gateway.model_name, prompt=["a", "b"])
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.completions.create(model=gateway.model_name, prompt="a", suffix="b")
    with pytest.raises(openai.BadRequestError, match="top_logprobs requires logprobs"):
        client.chat.completions.create(model=gateway.model_name, top_logprobs=2,
                                       messages=[{"role": "user", "content": "Hi"}])


def test_ten_megabyte_body_is_413(server: ServeAddresses, client: openai.OpenAI,
                                  gateway: Gateway) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=gateway.model_name, prompt="x" * (10 * 1024 * 1024))
    assert info.value.status_code == 413
    assert "larger than the limit of 1048576 bytes" in info.value.message

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    response = post(server, "/v1/completions", content=chunked(),
                    headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"
    assert_still_serving(client, gateway)


def test_unknown_route_and_method(server: ServeAddresses) -> None:
    assert httpx.get(f"{server.http_url}/v1/nothing").status_code == 404
    response = httpx.get(f"{server.http_url}/v1/completions")
    assert response.status_code == 405
    error_of(response)


def test_full_queue_is_429_with_retry_after(make_engine, loaded_model: LoadedModel) -> None:  # type: ignore[no-untyped-def]
    # One running sequence at most and one waiting: a third request overflows the queue.
    engine = AsyncEngine(make_engine(num_threads=1, num_kv_blocks=64, max_num_seqs=1,
                                     max_waiting=1))
    gateway = Gateway(EngineBackend(engine), loaded_model.tokenizer,
                      GatewayConfig(retry_after_s=3))
    server = GatewayServer(gateway, http_port=0, grpc_port=0)
    addresses = server.start()
    url = f"{addresses.http_url}/v1/completions"
    body = {"prompt": "Count to a thousand:", "temperature": 0, "ignore_eos": True}
    try:
        with httpx.stream("POST", url, json={**body, "max_tokens": 900, "stream": True},
                          timeout=60) as running:
            assert running.status_code == 200
            # Keep the iterator: dropping it would close the connection (and abort the request).
            lines = running.iter_lines()
            next(lines)  # the first token: this request is running
            waiting: list[httpx.Response] = []
            thread = threading.Thread(target=lambda: waiting.append(
                httpx.post(url, json={**body, "max_tokens": 2}, timeout=60)))
            thread.start()
            wait_until(lambda: engine.stats.num_waiting == 1, "a waiting request")
            refused = httpx.post(url, json={**body, "max_tokens": 2}, timeout=60)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "3"
            assert "overloaded" in str(error_of(refused)["message"])
            assert gateway.metrics.registry.get_sample_value(
                "tandem_request_failures_total",
                {"model_name": gateway.model_name, "tenant": "default", "reason": "rejected"}) == 1
        # Closing the running stream aborts it; the waiting request then runs.
        thread.join(60)
        assert waiting and waiting[0].status_code == 200
        wait_engine_idle(engine)
    finally:
        server.stop()
        engine.shutdown()
