from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway import EngineBackend, Gateway
from tandem.services.gateway.runner import ServeAddresses
from tandem.services.gateway.tenants import Tenants
from tests.gateway.helpers import serving

API_KEY = "sk-batch-test"


@pytest.fixture(scope="package")
def online(make_engine, loaded_model: LoadedModel  # type: ignore[no-untyped-def]
           ) -> Iterator[ServeAddresses]:
    """The online path: the gateway over a colocated engine, served over real HTTP, with an
    API key (as `tandem up --api-key` would)."""
    engine = AsyncEngine(make_engine(num_threads=1))
    tenants = Tenants({API_KEY: "batch"}, secret=b"a cluster secret of 32+ characters!")
    try:
        with serving(Gateway(EngineBackend(engine), loaded_model.tokenizer,
                             tenants=tenants)) as addresses:
            yield addresses
    finally:
        engine.shutdown()
