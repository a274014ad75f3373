"""The decode channel on the shared `tandem up` cluster (1 prefill + 1 decode worker): every
request's tokens reach the gateway on one multiplexed stream from the decode replica
(services/serving/decode_channel.py). Many concurrent streams through it each equal the
engine's own output; clients that leave mid-stream, beside others that go on, leave no KV block
allocated on either worker. (A channel whose replica is killed: tests/e2e/test_migration.py.)"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tandem.services.protocol.request import SamplingParams
from tests.e2e.cluster import UpProcess, all_blocks_free, wait_for

STREAMS = 32
MAX_TOKENS = 24

pytestmark = pytest.mark.timeout(600)


def _body(i: int, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    """Even streams greedy, odd ones seeded sampling, each prompt its own."""
    sampling: dict[str, object] = ({"temperature": 0} if i % 2 == 0
                                   else {"temperature": 0.8, "seed": 1000 + i})
    return {"prompt": f"Write one sentence about the number {i}.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **sampling}


async def _stream(http: httpx.AsyncClient, body: dict[str, object],
                  leave_after: int | None = None) -> list[int]:
    """The output token ids of a streamed completion; with ``leave_after``, the client
    disconnects once it has that many tokens."""
    tokens: list[int] = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                tokens += chunk["choices"][0].get("token_ids") or []
            if leave_after is not None and len(tokens) >= leave_after:
                break
    return tokens


def _expected(make_engine, loaded_model, bodies: list[dict[str, object]]  # type: ignore[no-untyped-def]
              ) -> list[list[int]]:
    """The engine's own outputs for ``bodies``, in one batch (each request's draws depend on
    its seed and positions, not on its batch)."""
    prompts = [loaded_model.tokenizer.encode(str(b["prompt"])) for b in bodies]
    params = [SamplingParams(max_tokens=int(b["max_tokens"]), ignore_eos=True,  # type: ignore[call-overload]
                             temperature=float(b["temperature"]), seed=b.get("seed"))  # type: ignore[arg-type]
              for b in bodies]
    return list(make_engine().generate(prompts, params))


def test_thirty_two_concurrent_streams_through_one_channel_equal_the_engine(
        cluster: UpProcess, make_engine, loaded_model) -> None:  # type: ignore[no-untyped-def]
    bodies = [_body(i) for i in range(STREAMS)]

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=300,
                                     limits=httpx.Limits(max_connections=STREAMS)) as http:
            return list(await asyncio.gather(*(_stream(http, b) for b in bodies)))

    results = asyncio.run(run())
    expected = _expected(make_engine, loaded_model, bodies)
    for i, tokens in enumerate(results):
        assert tokens == expected[i], i
    wait_for(lambda: all_blocks_free(cluster), 60, "every KV block free on both workers")


def test_clients_leaving_mid_stream_free_every_block_while_the_others_go_on(
        cluster: UpProcess, make_engine, loaded_model) -> None:  # type: ignore[no-untyped-def]
    """Half the streams leave after a few tokens (their requests aborted on D through the
    channel), the other half, on the same channel, run to the end exactly."""
    bodies = [_body(i, max_tokens=200 if i % 2 else MAX_TOKENS) for i in range(16)]

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=300,
                                     limits=httpx.Limits(max_connections=16)) as http:
            return list(await asyncio.gather(*(
                _stream(http, b, leave_after=4 if i % 2 else None)
                for i, b in enumerate(bodies))))

    results = asyncio.run(run())
    stayed = [i for i in range(16) if i % 2 == 0]
    expected = _expected(make_engine, loaded_model, [bodies[i] for i in stayed])
    for i, want in zip(stayed, expected, strict=True):
        assert results[i] == want, i
    for i in range(1, 16, 2):
        assert 4 <= len(results[i]) < 200, i
    wait_for(lambda: all_blocks_free(cluster), 60, "every KV block free on both workers")
