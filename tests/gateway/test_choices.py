"""Several choices per request (``n``, ``best_of``) through the HTTP front end with the official
client: each choice equals the same request with n = 1 and seed + index, the prompt is
prefilled once, and a refused or abandoned request leaves every block free."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway, choice_request
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.gateway.helpers import serving, wait_engine_idle, wait_until

BLOCK_SIZE = 16  # the engine's (EngineConfig.block_size)
SEED = 1234


def fresh_prompt() -> str:
    """A prompt no earlier test has cached, over several KV blocks."""
    return (f"Request {uuid.uuid4().hex}. Write a short story about a lighthouse keeper who "
            "finds a message in a bottle on a stormy night. Begin:")


def sampled(client: openai.OpenAI, prompt: str, seed: int, n: int = 1, **kw: object
            ) -> openai.types.Completion:
    return client.completions.create(
        model="", prompt=prompt, max_tokens=8, temperature=1.0, seed=seed, n=n,
        extra_body={"return_token_ids": True, "ignore_eos": True}, **kw)  # type: ignore[arg-type]


def test_choice_requests_take_seed_plus_index() -> None:
    request = GenerationRequest("cmpl-1", [1, 2], SamplingParams(seed=2**64 - 2))
    seeds = [choice_request(request, i).params.seed for i in range(3)]
    assert seeds == [2**64 - 2, 2**64 - 1, 0]  # wraps within 64 bits
    assert [choice_request(request, i).request_id for i in range(3)] == [
        "cmpl-1", "cmpl-1-1", "cmpl-1-2"]
    greedy = GenerationRequest("g", [1], SamplingParams(temperature=0.0))
    assert choice_request(greedy, 2).params.seed is None


def test_n_choices_equal_single_requests_and_share_one_prefill(
        client: openai.OpenAI, async_engine: AsyncEngine) -> None:
    prompt = fresh_prompt()
    before = async_engine.stats
    four = sampled(client, prompt, SEED, n=4)
    after = async_engine.stats
    prompt_len = len(four.prompt_token_ids)  # type: ignore[attr-defined]
    assert prompt_len > 2 * BLOCK_SIZE
    # Choice 0 computed the prompt; the other three found its full blocks cached.
    full = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert after.prefix_cache_queries - before.prefix_cache_queries == 4 * prompt_len
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * full

    assert sorted(c.index for c in four.choices) == [0, 1, 2, 3]
    assert four.usage.completion_tokens == 4 * 8
    assert four.usage.prompt_tokens == prompt_len
    by_index = {c.index: c.token_ids for c in four.choices}  # type: ignore[attr-defined]
    for i in range(4):
        single = sampled(client, prompt, SEED + i)
        assert single.choices[0].token_ids == by_index[i], i  # type: ignore[attr-defined]
    assert len({tuple(ids) for ids in by_index.values()}) > 1  # the seeds differ
    wait_engine_idle(async_engine)


def test_streamed_choices_reassemble_to_the_same_choices(client: openai.OpenAI) -> None:
    prompt = fresh_prompt()
    whole = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], max_tokens=6, n=3,
        temperature=0.8, seed=SEED, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], max_tokens=6, n=3,
        temperature=0.8, seed=SEED, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 18
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_best_of_returns_the_most_likely_choices(client: openai.OpenAI) -> None:
    prompt = fresh_prompt()
    best = sampled(client, prompt, SEED, n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 3 * 8  # every candidate was generated

    def score(seed: int) -> tuple[float, list[int]]:
        single = sampled(client, prompt, seed, logprobs=0)
        lp = single.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None
        return sum(lp.token_logprobs), single.choices[0].token_ids  # type: ignore[attr-defined]

    candidates = [score(SEED + i) for i in range(3)]
    assert best.choices[0].token_ids == max(candidates)[1]  # type: ignore[attr-defined]
    two = sampled(client, prompt, SEED, n=2, best_of=3, logprobs=0)
    ranked = sorted(candidates, reverse=True)[:2]
    assert [c.token_ids for c in two.choices] == [ids for _, ids in ranked]  # type: ignore[attr-defined]
    assert [c.index for c in two.choices] == [0, 1]


@pytest.fixture(scope="module")
def http(server: ServeAddresses) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("body,param", [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 17}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
])
def test_bad_choice_counts_are_400_naming_the_field(http: httpx.Client, body: dict,
                                                    param: str) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_choices_over_the_in_flight_limit_are_shed_and_nothing_is_left(
        async_engine: AsyncEngine, loaded_model: LoadedModel) -> None:
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                      GatewayConfig(max_in_flight=2))
    with serving(gateway) as addresses:
        client = openai.OpenAI(api_key="unused", base_url=f"{addresses.http_url}/v1",
                               max_retries=0, timeout=60)
        with pytest.raises(openai.RateLimitError):
            sampled(client, fresh_prompt(), SEED, n=3)
        assert gateway.in_flight == 0
        wait_engine_idle(async_engine)
        assert len(sampled(client, fresh_prompt(), SEED, n=2).choices) == 2


def test_a_client_that_leaves_aborts_every_choice(server: ServeAddresses,
                                                  async_engine: AsyncEngine,
                                                  gateway: Gateway) -> None:
    async def leave_after_first_chunks() -> int:
        seen: set[int] = set()
        async with openai.AsyncOpenAI(api_key="unused", base_url=f"{server.http_url}/v1",
                                      max_retries=0, timeout=60) as client:
            stream = await client.completions.create(
                model="", prompt=fresh_prompt(), max_tokens=200, n=3, temperature=1.0,
                seed=SEED, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                seen.update(c.index for c in chunk.choices if c.text)
                if len(seen) == 3:
                    break
            await stream.close()
        return len(seen)

    assert asyncio.run(leave_after_first_chunks()) == 3
    wait_engine_idle(async_engine)
    wait_until(lambda: gateway.in_flight == 0, "every choice to end at the gateway")


def test_grpc_streams_each_choice_with_its_index(client: openai.OpenAI,
                                                 server: ServeAddresses) -> None:
    prompt = fresh_prompt()
    http = sampled(client, prompt, SEED, n=3)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(prompt=prompt, n=3, sampling=pb.SamplingOptions(
            max_tokens=8, temperature=1.0, seed=SEED, ignore_eos=True))
        tokens: dict[int, list[int]] = {}
        finished: dict[int, int] = {}
        for message in stub.Generate(request, timeout=60):
            tokens.setdefault(message.index, []).extend(message.token_ids)
            if message.finish_reason:
                finished[message.index] = message.usage.completion_tokens
        assert tokens == {c.index: c.token_ids for c in http.choices}  # type: ignore[attr-defined]
        assert finished == {0: 8, 1: 8, 2: 8}
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(prompt="Hi", n=17), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "n must be" in str(refused.value.details())
