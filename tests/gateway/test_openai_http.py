"""The official openai client, unchanged, against a real server on a real engine."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import engine_tokens, wait_engine_idle, wait_until

MAX_TOKENS = 8
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Here is a list of the five largest cities in Europe by population:"


@pytest.fixture(scope="module")
def tokenizer(gateway: Gateway) -> Tokenizer:
    return gateway.tokenizer


def test_models_and_health(client: openai.OpenAI, server: ServeAddresses,
                           gateway: Gateway) -> None:
    assert [m.id for m in client.models.list()] == [gateway.model_name]
    assert client.models.retrieve(gateway.model_name).id == gateway.model_name
    health = httpx.get(f"{server.http_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_chat_greedy_matches_engine(client: openai.OpenAI, gateway: Gateway,
                                    async_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode_chat(CHAT)
    expected = engine_tokens(async_engine, prompt, MAX_TOKENS)
    reply = client.chat.completions.create(model=gateway.model_name, messages=CHAT,
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    assert choice.token_ids == expected  # type: ignore[attr-defined]
    assert choice.message.content == tokenizer.decode(expected)
    assert choice.finish_reason == ("stop" if expected[-1] in tokenizer.eos_token_ids
                                    else "length")
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(expected)
    assert reply.usage.total_tokens == len(prompt) + len(expected)


def test_chat_stream_matches_engine_with_usage(client: openai.OpenAI, gateway: Gateway,
                                               async_engine: AsyncEngine,
                                               tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode_chat(CHAT)
    expected = engine_tokens(async_engine, prompt, MAX_TOKENS)
    stream = client.chat.completions.create(
        model=gateway.model_name, messages=CHAT, max_completion_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True},
        logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    ids = [t for c in content_chunks for t in (c.choices[0].token_ids or [])]  # type: ignore[attr-defined]
    logprobs = [lp for c in content_chunks if c.choices[0].logprobs
                for lp in c.choices[0].logprobs.content or []]
    assert ids == expected
    assert text == tokenizer.decode(expected)
    assert len(logprobs) == len(expected)
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert content_chunks[-1].choices[0].finish_reason in ("length", "stop")
    usage = chunks[-1].usage  # the usage chunk comes last, with no choices
    assert not chunks[-1].choices and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(expected))


def test_completion_greedy_matches_engine(client: openai.OpenAI, gateway: Gateway,
                                          async_engine: AsyncEngine,
                                          tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    expected = engine_tokens(async_engine, prompt, MAX_TOKENS, ignore_eos=True)
    reply = client.completions.create(model=gateway.model_name, prompt=PROMPT,
                                      max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text == tokenizer.decode(expected)
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == MAX_TOKENS
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), MAX_TOKENS)


def test_completion_stream_from_token_ids_matches_engine(
        client: openai.OpenAI, gateway: Gateway, async_engine: AsyncEngine,
        tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    expected = engine_tokens(async_engine, prompt, MAX_TOKENS)
    chunks = list(client.completions.create(
        model=gateway.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True}))
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids or []]  # type: ignore[attr-defined]
    assert ids == expected
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(expected)
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(expected))


def test_sixteen_concurrent_streams_all_finish(server: ServeAddresses, gateway: Gateway,
                                               async_engine: AsyncEngine,
                                               tokenizer: Tokenizer) -> None:
    questions = [f"Name a city that starts with the letter {chr(ord('A') + i)}." for i in range(16)]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    expected = [engine_tokens(async_engine, p, MAX_TOKENS, ignore_eos=True) for p in prompts]

    async def one(client: openai.AsyncOpenAI, question: str) -> tuple[list[int], str, int]:
        stream = await client.chat.completions.create(
            model=gateway.model_name, messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True})
        ids: list[int] = []
        text, completion_tokens = "", -1
        async for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].token_ids or []  # type: ignore[attr-defined]
                text += chunk.choices[0].delta.content or ""
            elif chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
        return ids, text, completion_tokens

    async def all_of_them() -> list[tuple[list[int], str, int]]:
        async with openai.AsyncOpenAI(api_key="unused", base_url=f"{server.http_url}/v1",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, q) for q in questions))

    results = asyncio.run(all_of_them())
    for (ids, text, completion_tokens), want in zip(results, expected, strict=True):
        assert ids == want
        assert text == tokenizer.decode(want)
        assert completion_tokens == MAX_TOKENS
    wait_engine_idle(async_engine)


def test_stop_string_ends_the_stream_and_frees_blocks(
        client: openai.OpenAI, gateway: Gateway, async_engine: AsyncEngine,
        tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    reference = engine_tokens(async_engine, prompt, 12, ignore_eos=True)
    ref_text = tokenizer.decode(reference)
    # A stop string straddling the boundary between the 4th and 5th generated tokens.
    boundary = len(tokenizer.decode(reference[:4]))
    stop = ref_text[boundary - 2:boundary + 2]
    cut = ref_text.index(stop)
    needed = next(n for n in range(1, len(reference) + 1)
                  if stop in tokenizer.decode(reference[:n]))
    # Without the abort on the stop string, this request would hold its blocks for minutes.
    long = {"max_tokens": 900, "temperature": 0, "stop": [stop, "never-seen-stop"],
            "extra_body": {"ignore_eos": True}}

    reply = client.completions.create(model=gateway.model_name, prompt=PROMPT, **long)
    assert reply.choices[0].text == ref_text[:cut]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == needed
    wait_engine_idle(async_engine, timeout_s=20)

    chunks = list(client.completions.create(model=gateway.model_name, prompt=PROMPT,
                                            stream=True, **long))
    assert "".join(c.choices[0].text for c in chunks) == ref_text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_engine_idle(async_engine, timeout_s=20)


def _abort_count(server: ServeAddresses) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.http_url}/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "tandem_request_success":
            return sum(s.value for s in family.samples
                       if s.name.endswith("_total") and s.labels["finished_reason"] == "abort")
    return 0.0


def test_client_disconnecting_mid_stream_frees_every_block(
        client: openai.OpenAI, server: ServeAddresses, gateway: Gateway,
        async_engine: AsyncEngine) -> None:
    aborted = _abort_count(server)
    stream = client.chat.completions.create(
        model=gateway.model_name, messages=CHAT, max_tokens=900, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            break
    assert async_engine.stats.num_running == 1
    assert async_engine.stats.num_free_blocks < async_engine.stats.num_blocks
    stream.close()  # drops the connection mid-stream
    wait_engine_idle(async_engine, timeout_s=20)
    assert _abort_count(server) == aborted + 1


def test_client_giving_up_on_a_non_streaming_request_aborts_it(
        server: ServeAddresses, gateway: Gateway, async_engine: AsyncEngine) -> None:
    aborted = _abort_count(server)
    body = json.dumps({"model": gateway.model_name, "prompt": PROMPT, "max_tokens": 900,
                       "temperature": 0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection((server.host, server.http_port), timeout=30) as conn:
        conn.sendall(head.encode() + body)
        wait_until(lambda: async_engine.stats.num_running == 1, "the request to run")
    # The connection is closed with no response read.
    wait_engine_idle(async_engine, timeout_s=20)
    assert _abort_count(server) == aborted + 1
