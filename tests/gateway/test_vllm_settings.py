"""vLLM's serving settings as the gateway honours them: several served model names, a server
seed for requests without one, another chat template, and where request defaults come from
(--generation-config). Real gateways over the session's engine, the official openai client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.serving.config import AppConfig
from tandem.services.serving.gateway import request_defaults
from tests.gateway.helpers import serving

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0, timeout=120)


def test_a_request_may_name_any_served_name_and_answers_under_the_first(
        async_engine: AsyncEngine, loaded_model: LoadedModel) -> None:
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                      GatewayConfig(served_model_names=("smol", "smol-latest")))
    with serving(gateway) as addresses:
        client = _client(addresses.http_url)
        assert [m.id for m in client.models.list()] == ["smol", "smol-latest"]
        assert client.models.retrieve("smol-latest").id == "smol-latest"
        reply = client.chat.completions.create(model="smol-latest", messages=MESSAGES,
                                               max_tokens=2, temperature=0)
        assert reply.model == "smol"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="smol-2", messages=MESSAGES, max_tokens=2)


def test_a_server_seed_makes_unseeded_sampling_repeat_across_fresh_servers(
        async_engine: AsyncEngine, loaded_model: LoadedModel) -> None:
    def run(seed: int) -> list[list[int]]:
        gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                          GatewayConfig(seed=seed))
        with serving(gateway) as addresses:
            client = _client(addresses.http_url)
            return [client.completions.create(
                model="", prompt=prompt, max_tokens=8, temperature=1.0,
                extra_body={"return_token_ids": True}).choices[0].token_ids  # type: ignore[attr-defined]
                for prompt in ("Once upon a time", "The weather today")]

    first = run(seed=7)
    assert run(seed=7) == first
    # Another seed draws other seeds: 16 sampled tokens at temperature 1 all equal by chance is
    # not a thing this model does (its next-token distributions are far from one-hot).
    assert run(seed=8) != first


def test_another_chat_template_is_what_the_prompt_is_rendered_with(
        async_engine: AsyncEngine, loaded_model: LoadedModel) -> None:
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    tokenizer = loaded_model.tokenizer.with_chat_template(template)
    assert tokenizer.apply_chat_template(MESSAGES) == "<user>Name a colour.\n"
    gateway = Gateway(EngineBackend(async_engine), tokenizer)
    with serving(gateway) as addresses:
        reply = _client(addresses.http_url).chat.completions.create(
            model="", messages=MESSAGES, max_tokens=1, temperature=0)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tokenizer.encode("<user>Name a colour.\n",
                                                             add_special_tokens=False))
    assert reply.usage.prompt_tokens != len(loaded_model.tokenizer.encode_chat(MESSAGES))


def test_request_defaults_follow_generation_config(tmp_path: Path) -> None:
    model = {"temperature": 0.6, "top_p": 0.9}
    assert request_defaults(AppConfig(), model) == model
    assert request_defaults(AppConfig(generation_config="vllm"), model) == {}
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.2, "top_k": 20, "do_sample": true, "max_length": 99}')
    assert request_defaults(AppConfig(generation_config=str(tmp_path)), model) == {
        "temperature": 0.2, "top_k": 20}
