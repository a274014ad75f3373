from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.cluster import UpProcess

SLOW_CLIENT_TIMEOUT_S = 5
HUNG_PREFILL_SEED = 668  # the prefill worker SIGSTOPs itself at D's release of this request


# The shared cluster: started by the first module that asks for it, used by every module that
# asks (pytest_collection_modifyitems runs those modules one after another) and stopped after
# the last of them, so the other modules' clusters never run beside it. A module that stops it
# (test_serving's SIGTERM test) gets a fresh one for the next module.
_shared: UpProcess | None = None
_users: set[Path] = set()  # the test files that use it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> UpProcess:
    """`tandem up` with 1 prefill + 1 decode worker on free loopback ports, moving KV over NIXL
    (the default transport; the other e2e clusters use TCP). The decode worker speculates with
    prompt lookup, so every exactness check here also covers speculative decoding. Clients that
    stop reading are cut after 5 s (60 by default) and 64 requests are admitted at once (32), so
    that test_serving's 50 slow readers are all admitted and cut within a minute. A request
    with seed HUNG_PREFILL_SEED hangs the prefill worker during its KV pull (the test-only
    fault hook, services/engine/faults.py). Tests see the traffic of the modules before them:
    they assert on changes of counters, not on their totals."""
    global _shared
    if _shared is None or _shared.process is None or _shared.process.poll() is not None:
        log = Path(tmp_path_factory.mktemp("up")) / "tandem-up.log"
        _shared = UpProcess(["--prefill", "1", "--decode", "1", "--kv-transport", "nixl",
                             "--spec", "ngram", "--client-read-timeout",
                             str(SLOW_CLIENT_TIMEOUT_S), "--max-in-flight", "64"], log,
                            env={"TANDEM_TEST_FAULTS":
                                 f"prefill:sigstop={HUNG_PREFILL_SEED}"}).start()
    return _shared


def _uses_shared_cluster(item: pytest.Item) -> bool:
    defs = getattr(item, "_fixtureinfo", None)
    chosen = defs.name2fixturedefs.get("cluster") if defs is not None else None
    return bool(chosen) and chosen[-1].func is cluster.__wrapped__  # type: ignore[attr-defined]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules using the shared cluster, moved to run one after another (in their order),
    where the first of them was."""
    users = {item.path for item in items if _uses_shared_cluster(item)}
    _users.update(users)
    if not users:
        return
    first = next(i for i, item in enumerate(items) if item.path in users)
    moved = [item for item in items if item.path in users]
    rest = [item for item in items if item.path not in users]
    items[:] = rest[:first] + moved + rest[first:]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    global _shared
    if _shared is not None and (nextitem is None or nextitem.path not in _users):
        if _shared.process is not None and _shared.process.poll() is None:
            _shared.stop()
        _shared = None
