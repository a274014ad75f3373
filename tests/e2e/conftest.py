from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import UpProcess

SLOW_CLIENT_TIMEOUT_S = 5
HUNG_PREFILL_SEED = 668  # the prefill worker SIGSTOPs itself at D's release of this request


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """`tandem up` with 1 prefill + 1 decode worker on free loopback ports, moving KV over NIXL
    (the default transport; the other e2e clusters use TCP). The decode worker speculates with
    prompt lookup, so every exactness check here also covers speculative decoding. Clients that
    stop reading are cut after 5 s (60 by default) and 64 requests are admitted at once (32), so
    that test_serving's 50 slow readers are all admitted and cut within a minute. A request
    with seed HUNG_PREFILL_SEED hangs the prefill worker during its KV pull (the test-only
    fault hook, services/engine/faults.py)."""
    log = Path(tmp_path_factory.mktemp("up")) / "tandem-up.log"
    up = UpProcess(["--prefill", "1", "--decode", "1", "--kv-transport", "nixl",
                    "--spec", "ngram", "--client-read-timeout", str(SLOW_CLIENT_TIMEOUT_S),
                    "--max-in-flight", "64"], log,
                   env={"TANDEM_TEST_FAULTS": f"prefill:sigstop={HUNG_PREFILL_SEED}"}).start()
    try:
        yield up
    finally:
        up.stop()
