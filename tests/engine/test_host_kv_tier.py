"""The host-memory KV tier (issue 20): evicted prefix-cache blocks kept in host RAM, copied back
on a hit. Real engines on the built-in model; exactness is against an engine whose device cache
holds the whole working set."""

from __future__ import annotations

import pytest
import torch

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.host_kv_pool import HostKVPool
from tandem.services.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.protocol.block_hash import BlockHash
from tandem.services.protocol.kv_events import HOST, BlockRemoved, BlockStored, KVEvent
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tandem.services.serving.config import AppConfig, ConfigError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DEVICE_BLOCKS = 72  # the longest prompt fits; the prompt set does not


def pool_gb(engine: LLMEngine, blocks: int) -> float:
    """``host_kv_cache_gb`` holding exactly ``blocks`` of ``engine``'s blocks."""
    return blocks * engine.kv_spec.bytes_per_block / 2**30


def run(engine: LLMEngine, prompt: list[int], events: list[KVEvent]) -> list[int]:
    """One request to completion, collecting the KV events."""
    request_id = f"r{len(events)}-{engine.stats.prefix_cache_queries}"
    engine.add_request(GenerationRequest(request_id, prompt, GREEDY))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        events.extend(engine.take_events())
    return tokens


def full_blocks_tokens(prompt: list[int], block_size: int = 16) -> int:
    """Prompt tokens a prefix lookup can hit (>= 1 token is always computed)."""
    return (len(prompt) - 1) // block_size * block_size


def test_working_set_larger_than_device_kv_comes_back_from_host(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    reference = make_engine().generate(prompts, GREEDY)
    probe = make_engine(num_kv_blocks=DEVICE_BLOCKS)
    working_set = sum(probe.block_manager.blocks_needed(len(p) + 8) for p in prompts)
    assert working_set > 2 * DEVICE_BLOCKS, "the working set must not fit on the device"
    engine = make_engine(num_kv_blocks=DEVICE_BLOCKS,
                         host_kv_cache_gb=pool_gb(probe, working_set))
    events: list[KVEvent] = []
    first = [run(engine, p, events) for p in prompts]
    assert first == reference
    stats = engine.stats
    assert stats.host_kv_offloaded_blocks > 0 and stats.host_kv_restored_blocks == 0
    assert any(isinstance(e, BlockStored) and e.medium == HOST for e in events)

    hits, queries = stats.prefix_cache_hits, stats.prefix_cache_queries
    again = [run(engine, p, events) for p in prompts]
    assert again == reference
    after = engine.stats
    # Every full prompt block was a hit (device or host): no prompt token was recomputed.
    assert after.prefix_cache_queries - queries == sum(len(p) for p in prompts)
    assert after.prefix_cache_hits - hits == sum(full_blocks_tokens(p) for p in prompts)
    assert after.host_kv_restored_blocks > 0
    assert after.host_kv_blocks <= after.host_kv_capacity_blocks == working_set
    # Without the pool the same revisit recomputes most of it.
    plain = make_engine(num_kv_blocks=DEVICE_BLOCKS)
    plain.generate(prompts, GREEDY)
    plain_hits = plain.stats.prefix_cache_hits
    assert plain.generate(prompts, GREEDY) == reference
    assert plain.stats.prefix_cache_hits - plain_hits < after.prefix_cache_hits - hits


def test_pool_is_bounded_and_drops_the_least_recently_used() -> None:
    spec = KVCacheSpec(4, 2, 1, 1, 4, "float32")
    cache = allocate_kv_cache(spec)
    assert isinstance(cache, torch.Tensor)
    for block in range(4):
        cache[block] = block + 1.0
    pool = HostKVPool(cache, capacity=2)
    a, b, c = (bytes([i]) * 32 for i in range(3))
    assert pool.store(a, 0) is None and pool.store(b, 1) is None
    pool.touch(a)  # now b is the least recently used
    dropped: BlockHash | None = pool.store(c, 2)
    assert dropped == b and len(pool) == 2 and a in pool and c in pool
    assert pool.store(a, 3) is None and pool.offloaded == 3  # a hash is its bytes: kept
    pool.load(a, 3)
    pool.load(c, 1)
    assert torch.equal(cache[3], torch.full_like(cache[3], 1.0))  # block 0's bytes
    assert torch.equal(cache[1], torch.full_like(cache[1], 3.0))
    assert pool.restored == 2


def test_small_pool_emits_host_removals(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    probe = make_engine(num_kv_blocks=DEVICE_BLOCKS)
    engine = make_engine(num_kv_blocks=DEVICE_BLOCKS, host_kv_cache_gb=pool_gb(probe, 4))
    events: list[KVEvent] = []
    for p in prompts[-3:]:
        run(engine, p, events)
    assert engine.stats.host_kv_blocks == 4 < engine.stats.host_kv_offloaded_blocks
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == HOST
               for h in e.block_hashes]
    stored = [h for e in events if isinstance(e, BlockStored) and e.medium == HOST
              for h in e.block_hashes]
    assert len(stored) - len(removed) == 4
    # The events name exactly the hashes the pool holds.
    held = set(stored) - set(removed)
    assert engine.host_pool is not None
    assert all(h in engine.host_pool for h in held) and len(held) == len(engine.host_pool)


def test_preemption_swaps_out_through_the_pool(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    """A long prompt is preempted while a short one decodes on, taking its freed (cached) blocks:
    they go to the pool, and the resumed prompt copies them back instead of recomputing."""
    batch = [prompts[3], prompts[-1]]
    params = [SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), GREEDY]
    reference = make_engine().generate(batch, params)
    probe = make_engine(num_kv_blocks=DEVICE_BLOCKS)
    engine = make_engine(num_kv_blocks=DEVICE_BLOCKS, max_num_batched_tokens=256,
                         host_kv_cache_gb=pool_gb(probe, 512))
    assert engine.generate(batch, params) == reference
    assert engine.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert engine.stats.host_kv_restored_blocks > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_int8_cache_with_the_pool_is_exact(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    # One request at a time on both (int8's rounding makes a near-tie batch-dependent).
    events: list[KVEvent] = []
    big = make_engine(kv_cache_dtype="int8")
    reference = [run(big, p, events) for p in prompts[-4:] * 2]
    probe = make_engine(kv_cache_dtype="int8", num_kv_blocks=DEVICE_BLOCKS)
    engine = make_engine(kv_cache_dtype="int8", num_kv_blocks=DEVICE_BLOCKS,
                         host_kv_cache_gb=pool_gb(probe, 512))
    assert [run(engine, p, events) for p in prompts[-4:] * 2] == reference
    assert engine.stats.host_kv_restored_blocks > 0


def test_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="host_kv_cache_gb must be >= 0, got -1"):
        EngineConfig(host_kv_cache_gb=-1)
    with pytest.raises(ConfigError, match="host_kv_cache_gb"):
        AppConfig(host_kv_cache_gb=-1)


def test_up_flag_reaches_the_engines() -> None:
    import argparse

    from tandem.services.cli import _add_up_parser, up_settings

    parser = argparse.ArgumentParser(prog="tandem")
    _add_up_parser(parser.add_subparsers())
    settings = up_settings(parser.parse_args(["up", "--host-kv-cache-gb", "2.5"]))
    config = AppConfig.from_dict(settings, "command line")
    assert config.engine_config(decodes=True).host_kv_cache_gb == 2.5
    assert config.engine_config(decodes=False).host_kv_cache_gb == 2.5
    assert AppConfig.from_dict(up_settings(parser.parse_args(["up"])), "-").host_kv_cache_gb == 0


def test_a_pool_smaller_than_a_block_is_refused(make_engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="host_kv_cache_gb of 1e-09 GiB holds no"):
        make_engine(num_kv_blocks=8, host_kv_cache_gb=1e-9)
