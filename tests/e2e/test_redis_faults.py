"""Redis is soft state (docs/router.md, "When Redis fails"): one `tandem up --redis-url` cluster
(1 prefill + 1 decode) is started while nothing listens on the Redis port, serves by rendezvous
hashing over the workers the gateway polls, and connects once Redis is started; its workers then
register in Redis and publish their KV events to its stream. Then, while
requests stream through the official ``openai`` client, Redis is paused (SIGSTOP), filled
(``maxmemory 1mb``, ``noeviction``) and made a read-only replica. Each time: no request fails,
every output is the engine's greedy output, no stream waits long for a chunk, every KV block is
free afterwards, and routing is prefix-aware again.

The tests share the cluster and run in file order: the first needs Redis not started yet.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import httpx
import pytest
import redis
from openai import OpenAI

from tandem.router import RedisRegistry
from tandem.services.protocol.request import SamplingParams
from tests.e2e.cluster import UpProcess, all_blocks_free, metric_values, wait_for
from tests.router.conftest import RedisServer, free_port

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
SHARED = [1000 + i for i in range(4 * BLOCK)]  # a "system prompt" of 4 full blocks
PROMPTS = [SHARED + [3000 + 50 * i + k for k in range(BLOCK + 4)] for i in range(4)]
MAX_TOKENS = 12
STREAMS = 2  # concurrent streaming clients during each fault
STALL_S = 3.0  # the longest a stream may wait for its first or next chunk
FAULT_S = 6.0  # how long each fault lasts at least: longer than a worker record's 5 s TTL


@pytest.fixture(scope="module")
def greedy(make_engine) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The engine's own greedy output for each prompt."""
    engine = make_engine()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [engine.generate([prompt], params)[0] for prompt in PROMPTS]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis the tests start: nothing listens on its port before that."""
    redis_server = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    try:
        yield redis_server
    finally:
        redis_server.stop()


@pytest.fixture(scope="module")
def cluster(server: RedisServer, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[UpProcess]:
    log = Path(tmp_path_factory.mktemp("up")) / "tandem-up.log"
    # The tests count the router's reasons: a prompt goes to P unless every full block is
    # cached on D (no local prefill of a mostly cached one, as the default does).
    up = UpProcess(["--prefill", "1", "--decode", "1", "--kv-transport", "tcp",
                    "--redis-url", server.url, "--max-local-prefill-tokens", "0"], log)
    assert not server.running
    up.start()
    try:
        yield up
    finally:
        assert up.stop() == 0
        assert up.leftovers() == []


@pytest.fixture
def redis_up(cluster: UpProcess, server: RedisServer) -> RedisServer:
    """Redis running, the router reading its stream and both workers registered in it."""
    if not server.running:
        server.start()
    wait_until_connected(cluster, server)
    return server


# -- the tests, in order -------------------------------------------------------------------


def test_serves_before_redis_starts_then_connects(cluster: UpProcess, server: RedisServer,
                                                  greedy: list[list[int]]) -> None:
    assert not server.running, "runs first: the cluster was started without Redis"
    client = openai_client(cluster)
    for i in range(len(PROMPTS)):
        tokens, _ = stream_one(client, i)
        assert tokens == greedy[i]
    reasons = decisions(cluster)
    assert reasons["fallback"] >= len(PROMPTS) and reasons["prefix"] == 0, reasons
    assert bus_connected(cluster) == 0

    server.start()  # on the port the cluster was given
    wait_until_connected(cluster, server)
    assert_prefix_aware(cluster)


def test_workers_register_and_publish_events_in_redis(cluster: UpProcess,
                                                     redis_up: RedisServer) -> None:
    """`tandem up --redis-url`: the workers are in Redis' registry and their KV events on its
    stream, from which the gateway routes."""
    client = redis_up.client()
    registry = RedisRegistry(client)
    wait_for(lambda: sorted(r.info.role for r in registry.workers()) == ["decode", "prefill"],
             60, "a prefill and a decode worker in the Redis registry")
    prompt = list(range(1000, 1064))  # four full blocks
    for _ in range(2):
        response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    wait_for(lambda: client.xlen("tandem:kv-events") > 0, 30, "KV events on the Redis stream")


def test_paused_redis(cluster: UpProcess, redis_up: RedisServer,
                      greedy: list[list[int]]) -> None:
    def hold() -> None:
        wait_for(lambda: bus_connected(cluster) == 0, 30, "the router to lose the bus")

    with StreamingLoad(cluster) as load:
        load.wait_for(2)
        with paused(redis_up):
            load.hold(FAULT_S, hold)
        load.wait_for(load.completed + 2)
    check_after_fault(cluster, redis_up, load, greedy)


def test_full_redis(cluster: UpProcess, redis_up: RedisServer,
                    greedy: list[list[int]]) -> None:
    listing = RedisRegistry(redis_up.client())

    def hold() -> None:  # reads still work: the workers' records lapse there
        wait_for(lambda: listing.workers() == [], 30, "the worker records to lapse")

    with StreamingLoad(cluster) as load:
        load.wait_for(2)
        with out_of_memory(redis_up):
            load.hold(FAULT_S, hold)
        load.wait_for(load.completed + 2)
    check_after_fault(cluster, redis_up, load, greedy)


def test_read_only_redis(cluster: UpProcess, redis_up: RedisServer,
                         greedy: list[list[int]]) -> None:
    listing = RedisRegistry(redis_up.client())

    def hold() -> None:
        wait_for(lambda: bus_connected(cluster) == 0, 30, "the router to lose the bus")
        wait_for(lambda: listing.workers() == [], 30, "the worker records to lapse")

    with StreamingLoad(cluster) as load:
        load.wait_for(2)
        with read_only(redis_up):
            load.hold(FAULT_S, hold)
        load.wait_for(load.completed + 2)
    check_after_fault(cluster, redis_up, load, greedy)


# -- faults --------------------------------------------------------------------------------


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    server.pause()
    try:
        yield
    finally:
        server.resume()


@contextlib.contextmanager
def out_of_memory(server: RedisServer) -> Iterator[None]:
    admin = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
    admin.set("filler", b"x" * 2_000_000)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1mb")
    try:
        with pytest.raises(redis.OutOfMemoryError):
            admin.set("probe", 1)
        yield
    finally:
        admin.config_set("maxmemory", "0")
        admin.delete("filler")
        admin.close()


@contextlib.contextmanager
def read_only(server: RedisServer) -> Iterator[None]:
    """A replica of a master that is not there: it keeps its data and refuses writes."""
    admin = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
    admin.replicaof("127.0.0.1", str(free_port()))
    try:
        with pytest.raises(redis.ReadOnlyError):
            admin.set("probe", 1)
        yield
    finally:
        admin.replicaof("NO", "ONE")
        admin.close()


# -- traffic -------------------------------------------------------------------------------


class StreamingLoad:
    """``STREAMS`` threads stream the prompts in turn until the ``with`` block ends; each
    request's tokens, failures and the longest wait for a chunk are recorded."""

    def __init__(self, cluster: UpProcess) -> None:
        self._client = openai_client(cluster)
        self._next = itertools.count()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.results: list[tuple[int, list[int]]] = []  # (prompt index, tokens)
        self.failures: list[str] = []
        self.longest_wait_s = 0.0
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(STREAMS)]

    @property
    def completed(self) -> int:
        return len(self.results)

    def __enter__(self) -> StreamingLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        assert not any(t.is_alive() for t in self._threads), "a stream never ended"

    def wait_for(self, completed: int) -> None:
        wait_for(lambda: self.completed >= completed or bool(self.failures), 120,
                 f"{completed} completed requests")
        assert not self.failures, self.failures

    def hold(self, seconds: float, check: Callable[[], None]) -> None:
        """Keep a fault for ``seconds`` at least, through ``check`` and through two more
        requests served during it."""
        started, served = time.monotonic(), self.completed
        check()
        self.wait_for(served + 2)
        wait_for(lambda: time.monotonic() - started >= seconds, seconds + 1, "the fault to last")

    def _run(self) -> None:
        while not self._stop.is_set():
            index = next(self._next) % len(PROMPTS)
            try:
                tokens, longest = stream_one(self._client, index)
            except Exception as exc:  # recorded: the test fails on any
                with self._lock:
                    self.failures.append(f"prompt {index}: {exc!r}")
                return
            with self._lock:
                self.results.append((index, tokens))
                self.longest_wait_s = max(self.longest_wait_s, longest)


def openai_client(cluster: UpProcess) -> OpenAI:
    # No retries: a request that failed must count as failed.
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0,
                  timeout=60)


def stream_one(client: OpenAI, index: int) -> tuple[list[int], float]:
    """One streamed completion of prompt ``index``: its tokens and the longest wait for its
    first or next chunk."""
    tokens: list[int] = []
    last = time.monotonic()
    longest = 0.0
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    for chunk in stream:
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        if chunk.choices:
            tokens += (chunk.choices[0].model_extra or {}).get("token_ids") or []
    return tokens, longest


# -- checks --------------------------------------------------------------------------------


def check_after_fault(cluster: UpProcess, server: RedisServer, load: StreamingLoad,
                      greedy: list[list[int]]) -> None:
    assert not load.failures, load.failures
    wrong = [(i, tokens) for i, tokens in load.results if tokens != greedy[i]]
    assert not wrong, wrong
    assert load.longest_wait_s < STALL_S, f"a stream waited {load.longest_wait_s:.1f}s"
    wait_for(lambda: all_blocks_free(cluster), 30, "every KV block free on both workers")
    wait_until_connected(cluster, server)
    assert_prefix_aware(cluster)


def wait_until_connected(cluster: UpProcess, server: RedisServer) -> None:
    registry = RedisRegistry(server.client())
    wait_for(lambda: bus_connected(cluster) == 1, 60, "the router to read the Redis stream")
    wait_for(lambda: sorted(r.info.role for r in registry.workers()) == ["decode", "prefill"],
             60, "both workers registered in Redis")


_probes = itertools.count()


def assert_prefix_aware(cluster: UpProcess) -> None:
    """A new prompt sharing the cached prefix goes to the prefill worker holding it, by prefix
    (once the worker's republished cache is in the rebuilt index)."""
    wait_for(lambda: index_blocks(cluster) >= len(SHARED) // BLOCK, 60,
             "the prefill worker's cache in the router's index")
    probe = SHARED + [20_000 + 40 * next(_probes) + k for k in range(BLOCK + 4)]
    before = decisions(cluster)
    response = openai_client(cluster).completions.create(model=MODEL, prompt=probe,
                                                         max_tokens=2, temperature=0)
    assert response.choices[0].text is not None
    after = decisions(cluster)
    assert after - before == collections.Counter({"prefix": 1}), (before, after)


def decisions(cluster: UpProcess) -> collections.Counter[str]:
    values = metric_values(cluster.http_url, "tandem_router_decisions_total")
    counts: collections.Counter[str] = collections.Counter()
    for labels, value in values.items():
        counts[dict(labels)["reason"]] += int(value)
    return counts


def bus_connected(cluster: UpProcess) -> float:
    return sum(metric_values(cluster.http_url, "tandem_router_bus_connected").values())


def index_blocks(cluster: UpProcess) -> float:
    return sum(metric_values(cluster.http_url, "tandem_router_index_blocks").values())

