"""Reasoning apart (gateway/reasoning.py): <think> text as reasoning_content, whole and
streamed in pieces of any size, and through the HTTP front end with the official client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.reasoning import (
    ReasoningStream,
    split_reasoning,
    starts_in_reasoning,
)
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import engine_tokens, serving

REPLIES = [  # (reply, starts inside a <think>) -> (reasoning, content)
    (("<think>\nhmm, 2+2\n</think>\n\nIt is 4.", False), ("\nhmm, 2+2\n", "It is 4.")),
    (("hmm, 2+2\n</think>\n\nIt is 4.", True), ("hmm, 2+2\n", "It is 4.")),
    (("It is 4.", False), (None, "It is 4.")),
    (("<think>cut off while thinking", False), ("cut off while thinking", "")),
    (("cut off while thinking", True), ("cut off while thinking", "")),
    (("  a <think> inside is text", False), (None, "  a <think> inside is text")),
    (("<thi", False), (None, "<thi")),
    (("<think></think>4", False), ("", "4")),
]


@pytest.mark.parametrize("reply,expected", REPLIES)
def test_a_reply_splits_the_same_whole_and_in_pieces(reply: tuple[str, bool],
                                                      expected: tuple[str | None, str]) -> None:
    text, inside = reply
    assert split_reasoning(text, inside) == expected
    for size in (1, 2, 3, 5):
        stream = ReasoningStream(inside)
        reasoning = content = ""
        for i in range(0, len(text), size):
            r, c = stream.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
            assert "</think>" not in r + c and (i or "<think>" not in r)
        r, c = stream.finish()
        assert ((reasoning + r) if stream.thought else None, content + c) == expected


def test_a_prompt_ending_in_an_open_think_starts_the_reply_inside_it(
        loaded_model: LoadedModel) -> None:
    tokenizer = loaded_model.tokenizer
    assert starts_in_reasoning(tokenizer.encode("Question?<think>\n", False), tokenizer)
    assert not starts_in_reasoning(tokenizer.encode("Q?<think>a</think>\n", False), tokenizer)
    assert not starts_in_reasoning(tokenizer.encode("Question?", False), tokenizer)


# A template that opens the reply's <think>, as DeepSeek-R1's does: the model's reply is
# reasoning until it writes </think>.
THINKING_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}<think>\n"


def thinking_tokenizer(loaded_model: LoadedModel) -> Tokenizer:
    base = loaded_model.tokenizer
    return Tokenizer(base.backend, base.eos_token_ids, chat_template=THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def thinking_server(async_engine: AsyncEngine, loaded_model: LoadedModel
                    ) -> Iterator[ServeAddresses]:
    gateway = Gateway(EngineBackend(async_engine), thinking_tokenizer(loaded_model),
                      GatewayConfig(reasoning_parser="think"))
    with serving(gateway) as addresses:
        yield addresses


@pytest.mark.parametrize("prompt", ["What is 2+2? Think, then answer.",
                                    "Write </think> and then the word done."])
def test_reasoning_content_over_http_whole_and_streamed(
        thinking_server: ServeAddresses, async_engine: AsyncEngine, loaded_model: LoadedModel,
        prompt: str) -> None:
    client = openai.OpenAI(api_key="unused", base_url=f"{thinking_server.http_url}/v1",
                           max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    request = {"model": model, "messages": [{"role": "user", "content": prompt}],
               "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**request).choices[0].message  # type: ignore[call-overload]
    # The same reply, unparsed: the engine's own tokens for the templated prompt.
    tokenizer = thinking_tokenizer(loaded_model)
    ids = engine_tokens(async_engine, tokenizer.encode_chat(request["messages"]), 24,
                        ignore_eos=True)
    assert (whole.reasoning_content, whole.content) == split_reasoning(  # type: ignore[attr-defined]
        tokenizer.decode(ids), True)
    reasoning = content = ""
    for chunk in client.chat.completions.create(**request, stream=True):  # type: ignore[call-overload]
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content or "")  # type: ignore[attr-defined]


def test_a_model_without_the_tags_gets_no_reasoning_by_default(client: openai.OpenAI,
                                                               gateway: Gateway) -> None:
    assert not gateway.reasoning  # auto: the built-in model's vocabulary has no <think>
    message = client.chat.completions.create(
        model=gateway.model_name, messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4, temperature=0).choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content
