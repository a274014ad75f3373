from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import UpProcess


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """`tandem up` with 1 prefill + 1 decode worker on free loopback ports, moving KV over NIXL
    (the default transport; the other e2e clusters use TCP). The decode worker speculates with
    prompt lookup, so every exactness check here also covers speculative decoding."""
    log = Path(tmp_path_factory.mktemp("up")) / "tandem-up.log"
    up = UpProcess(["--prefill", "1", "--decode", "1", "--kv-transport", "nixl",
                    "--spec", "ngram"], log).start()
    try:
        yield up
    finally:
        up.stop()
