from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import FUZZ_MAX_TOKENS, serving

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def async_engine(make_engine) -> Iterator[AsyncEngine]:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(make_engine(num_threads=1, num_kv_blocks=128,
                                     max_model_len=MAX_MODEL_LEN))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def gateway(async_engine: AsyncEngine, loaded_model: LoadedModel) -> Gateway:
    return Gateway(EngineBackend(async_engine), loaded_model.tokenizer)


@pytest.fixture(scope="session")
def server(gateway: Gateway) -> Iterator[ServeAddresses]:
    with serving(gateway) as addresses:
        yield addresses


@pytest.fixture
def client(server: ServeAddresses) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{server.http_url}/v1", max_retries=0,
                         timeout=120)



@pytest.fixture(scope="module")
def fuzz_server(async_engine: AsyncEngine, loaded_model: LoadedModel
                ) -> Iterator[ServeAddresses]:
    """A gateway whose requests without max_tokens stop after FUZZ_MAX_TOKENS tokens."""
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                      GatewayConfig(default_max_tokens=FUZZ_MAX_TOKENS))
    with serving(gateway) as addresses:
        yield addresses
