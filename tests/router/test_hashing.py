"""The router's prompt hashes are the engine's, in any process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.router import PromptHasher, RedisRegistry, RedisStreamEventBus, Router, RouterConfig
from tandem.services.protocol.block_hash import HashSettings, hash_token_blocks

from .cluster import SETTINGS, make_info, tokens
from .conftest import RedisServer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_prompt_hasher_equals_engine_function(block_size: int, salt: str | None) -> None:
    settings = HashSettings(block_size, "m")
    hasher = PromptHasher(settings, memo_blocks=64)  # small: the memo rolls over mid-test
    shared = tokens(1, 500)
    for seed in range(6):
        prompt = shared + tokens(100 + seed, 37 * seed)
        expected = hash_token_blocks(prompt, block_size, settings.extra_keys(salt))
        assert hasher.hashes(prompt, salt) == expected
        assert hasher.hashes(prompt, salt) == expected  # memo hit path


def test_salt_and_model_separate_hashes() -> None:
    prompt = tokens(2, 64)
    a = PromptHasher(HashSettings(16, "m")).hashes(prompt)
    assert PromptHasher(HashSettings(16, "m")).hashes(prompt, "s") != a
    assert PromptHasher(HashSettings(16, "other")).hashes(prompt) != a
    # A memo shared across salts must not leak the first block between them.
    hasher = PromptHasher(HashSettings(16, "m"))
    assert hasher.hashes(prompt) == a
    assert hasher.hashes(prompt, "s") != a


def test_partial_block_is_not_hashed() -> None:
    hasher = PromptHasher(SETTINGS)
    assert hasher.hashes(tokens(3, 15)) == []
    assert len(hasher.hashes(tokens(3, 47))) == 2
    assert hasher.num_blocks(47) == 3


WORKER_SCRIPT = """
import json, sys
from tandem.router import RedisStreamEventBus, attach_worker, connect
from tandem.services.protocol.block_hash import HashSettings, hash_token_blocks
from tandem.services.protocol.kv_events import BlockStored

url, prompt, salt = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
settings = HashSettings(16, "smollm2-135m")
hashes = hash_token_blocks(prompt, 16, settings.extra_keys(salt))
forwarder = attach_worker(RedisStreamEventBus(connect(url)), "p-remote")
forwarder.publish([BlockStored(tuple(hashes), None, 16)])
print(json.dumps({"hashes": [h.hex() for h in hashes], "str_hash": hash("tandem")}))
"""


def test_hashes_from_another_process_match_the_router(redis_server: RedisServer) -> None:
    prompt = tokens(4, 16 * 40 + 5)
    salt = "tenant-a"
    client = redis_server.client()
    registry = RedisRegistry(client)
    bus = RedisStreamEventBus(client)
    router = Router(RouterConfig(SETTINGS), registry, bus)
    for worker_id in ("p-remote", "p-other"):
        registry.register(make_info(worker_id))
    child_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    env = dict(os.environ, PYTHONHASHSEED=child_seed, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", WORKER_SCRIPT, redis_server.url, json.dumps(prompt), salt],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60, check=True,
    )
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    assert remote["str_hash"] != hash("tandem")  # Python's own hash() differs between them
    assert remote["hashes"] == [h.hex() for h in router.hasher.hashes(prompt, salt)]

    router.sync()
    decision = router.route(prompt, cache_salt=salt)
    assert decision.prefill_worker == "p-remote"
    assert decision.reason == "prefix"
    assert decision.cached_blocks == 40
    # The same tokens under another salt share nothing.
    assert router.cached_prefix(prompt, cache_salt="tenant-b")["p-remote"] == 0


def test_router_imports_no_torch_or_ray() -> None:
    code = (
        "import sys, tandem.router, tandem.router.events, tandem.router.router;"
        "import tandem.router.redis_registry;"
        "bad = [m for m in ('torch', 'ray') if m in sys.modules];"
        "assert not bad, bad"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, timeout=60, check=True)
