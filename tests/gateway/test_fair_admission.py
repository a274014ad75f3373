"""Admission slots shared fairly across tenants (gateway/tenants.py FairSlots; issue 40: one
tenant sending 96 requests took every slot and the other's first request got 429)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.errors import GatewayError
from tandem.services.gateway.tenants import (
    FairSlots,
    TenantConfigError,
    Tenants,
    parse_api_keys,
    tenant_weights,
)
from tests.gateway.helpers import serving, wait_until

SECRET = b"s" * 32


def test_one_tenant_alone_uses_every_slot_then_gets_429() -> None:
    async def scenario() -> None:
        slots = FairSlots(3)
        for _ in range(3):
            await slots.acquire("a")
        with pytest.raises(GatewayError) as refused:
            await slots.acquire("a")
        assert refused.value.status == 429
        slots.release("a")
        await slots.acquire("a")
        assert slots.in_flight == {"a": 3}

    asyncio.run(scenario())


def test_a_flooding_tenant_is_refused_while_another_waits_for_the_next_slot() -> None:
    async def scenario() -> None:
        slots = FairSlots(4)
        for _ in range(4):
            await slots.acquire("flood")
        waiting = asyncio.ensure_future(slots.acquire("quiet"))
        await asyncio.sleep(0)  # it queues: no slot is free
        assert not waiting.done()
        with pytest.raises(GatewayError):  # over its share (2 of 4) while "quiet" waits
            await slots.acquire("flood")
        slots.release("flood")  # the freed slot goes to the waiting tenant
        await waiting
        assert slots.in_flight == {"flood": 3, "quiet": 1} and slots.total == 4

    asyncio.run(scenario())


def test_with_several_tenants_a_flood_is_capped_and_another_is_admitted_at_once() -> None:
    """By default a tenant holds at most the limit less a quarter: the rest stays free, so
    another tenant's request starts without waiting for a flood's request to end."""
    async def scenario() -> None:
        slots = FairSlots(8, tenants=2)
        for _ in range(6):
            await slots.acquire("flood")
        with pytest.raises(GatewayError) as capped:
            await slots.acquire("flood")
        assert capped.value.status == 429 and "its cap (6 of the 8 slots" in capped.value.message
        await asyncio.wait_for(slots.acquire("quiet"), 1)  # at once: a free slot
        assert slots.in_flight == {"flood": 6, "quiet": 1}
        slots.resize(16)  # the default cap follows the limit
        await slots.acquire("flood")
        assert slots.cap() == 12
        assert FairSlots(8, tenants=1).cap() == 8  # one tenant: every slot
        assert FairSlots(8, tenant_cap=3, tenants=2).cap() == 3  # tenant_max_in_flight

    asyncio.run(scenario())


def test_weights_split_the_slots_under_contention() -> None:
    async def scenario() -> None:
        slots = FairSlots(8, {"big": 3.0})
        for _ in range(8):
            await slots.acquire("small")
        big = [asyncio.ensure_future(slots.acquire("big")) for _ in range(6)]
        await asyncio.sleep(0)
        assert slots.share("big") == 6 and slots.share("small") == 2
        with pytest.raises(GatewayError):  # a 7th would pass big's share of 6
            await slots.acquire("big")
        for _ in range(6):
            slots.release("small")
        await asyncio.gather(*big)
        assert slots.in_flight == {"small": 2, "big": 6}

    asyncio.run(scenario())


def test_a_waiter_that_gives_up_leaks_no_slot() -> None:
    async def scenario() -> None:
        slots = FairSlots(1)
        await slots.acquire("a")
        with pytest.raises(GatewayError) as timed_out:
            await slots.acquire("b", timeout_s=0.01)
        assert "deadline" in timed_out.value.message
        gone = asyncio.ensure_future(slots.acquire("b"))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        slots.release("a")
        assert slots.total == 0
        await slots.acquire("c")  # the slot is free for anyone
        assert slots.in_flight["c"] == 1

    asyncio.run(scenario())


def test_weights_come_from_the_keys_file() -> None:
    text = "acme:key-1 weight=3\nacme:key-2\nbolt:key-3\n"
    assert parse_api_keys(text) == {"key-1": "acme", "key-2": "acme", "key-3": "bolt"}
    assert tenant_weights(text) == {"acme": 3.0}
    for bad in ("acme:key-1 weight=0", "acme:key-1 weight=x", "acme:key-1 size=3"):
        with pytest.raises(TenantConfigError, match="line 1: expected tenant:key"):
            parse_api_keys(bad)


def test_over_http_a_flooding_tenant_does_not_lock_out_another(
        async_engine: AsyncEngine, loaded_model: LoadedModel) -> None:
    keys = {"key-flood": "flood", "key-quiet": "quiet"}
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                      GatewayConfig(max_in_flight=2, tenant_max_in_flight=3),  # share only
                      Tenants(keys, SECRET))
    with serving(gateway) as addresses:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(api_key=key, base_url=f"{addresses.http_url}/v1",
                                 max_retries=0, timeout=120)

        flood = client("key-flood")
        streams = [flood.completions.create(model="", prompt="Count slowly:", max_tokens=400,
                                            stream=True, temperature=0,
                                            extra_body={"ignore_eos": True})
                   for _ in range(2)]
        for stream in streams:
            next(iter(stream))  # both admitted: every slot is flood's
        with pytest.raises(openai.RateLimitError):  # alone, flood gets 429 at the limit
            flood.completions.create(model="", prompt="One more", max_tokens=1)
        # ... before its body is even parsed: a refused request costs next to nothing
        unparsed = httpx.post(f"{addresses.http_url}/v1/completions", content=b"{not json",
                              headers={"authorization": "Bearer key-flood"})
        assert unparsed.status_code == 429, unparsed.text
        answer: dict[str, object] = {}
        quiet = threading.Thread(target=lambda: answer.update(reply=client(
            "key-quiet").completions.create(model="", prompt="Hi", max_tokens=2)))
        quiet.start()
        wait_until(lambda: gateway._slots is not None and gateway._slots.share("flood") == 1,
                   what="the quiet tenant waiting for a slot")
        with pytest.raises(openai.RateLimitError) as refused:  # over its share now
            flood.completions.create(model="", prompt="One more", max_tokens=1)
        assert "holds its share" in refused.value.message
        streams[0].close()  # a flood request ends: its slot goes to the quiet tenant
        quiet.join(120)
        assert answer["reply"].choices[0].text is not None  # type: ignore[attr-defined]
        streams[1].close()
    wait_until(lambda: gateway.in_flight == 0, what="every slot free again")


def test_a_larger_limit_admits_those_waiting_and_a_smaller_one_takes_effect_as_requests_end(
        ) -> None:
    async def scenario() -> None:
        slots = FairSlots(2)
        for tenant in ("a", "b"):
            await slots.acquire(tenant)
        waiting = asyncio.ensure_future(slots.acquire("c"))
        await asyncio.sleep(0)
        assert not waiting.done()
        slots.resize(3)  # a decode worker came back: its batch's slots open at once
        await waiting
        slots.resize(1)  # two went away: nobody is cut, new requests wait for the ends
        with pytest.raises(GatewayError):
            await slots.acquire("a")  # "a" holds more than its third of the one slot
        for tenant in ("a", "b"):
            slots.release(tenant)
        assert slots.total == 1  # still over the new limit's worth: "a" waits for "c"
        again = asyncio.ensure_future(slots.acquire("a"))
        await asyncio.sleep(0)
        assert not again.done()
        slots.release("c")
        await again
        assert slots.in_flight == {"a": 1, "b": 0, "c": 0} and slots.total == 1

    asyncio.run(scenario())
