"""The KV cache's size and the context it must hold (services/engine/kv_sizing.py): a cache that
cannot hold one sequence of max_model_len refuses to start with the numbers; a GPU engine sizes
its cache from gpu_memory_utilization after a profiling step."""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.kv_sizing import (
    CPU_KV_CACHE_GB,
    GIB,
    DeviceMemory,
    KVCacheTooSmall,
    context_length,
    gpu_kv_bytes,
)
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.protocol.request import GenerationRequest, SamplingParams


def test_the_gpu_budget_is_the_utilization_less_the_profiled_peak_and_all_outside_torch() -> None:
    memory = DeviceMemory(total=80 * GIB, free=60 * GIB, torch_reserved=18 * GIB,
                          torch_peak=17 * GIB, profile_cache=GIB)
    # 0.9 x 80 = 72; the peak without its own cache: 16; outside torch: 80 - 60 - 18 = 2.
    assert gpu_kv_bytes(memory, 0.9) == int(72 * GIB) - 16 * GIB - 2 * GIB
    assert gpu_kv_bytes(memory, 0.2) < 0  # nothing left: the engine refuses (_profiled_blocks)


def test_context_length_is_the_asked_or_the_models_and_never_shrunk_unasked() -> None:
    assert context_length(None, 8192, 16384, False, "1 GiB") == 8192
    assert context_length(2048, 8192, 4096, False, "1 GiB") == 2048
    with pytest.raises(KVCacheTooSmall, match="max_model_len 9000 is longer than the model's "
                                              "context \\(8192 tokens\\)"):
        context_length(9000, 8192, 16384, False, "1 GiB")
    for asked, hand_sized in ((None, False), (8192, True), (8192, False)):
        with pytest.raises(KVCacheTooSmall) as refused:
            context_length(asked, 8192, 4096, hand_sized, "sizing X")
        message = str(refused.value)
        assert "(sizing X) holds 4096 tokens" in message and "max_model_len 8192" in message
        assert "set max_model_len to at most 4096" in message


def test_a_hand_sized_cache_without_a_length_serves_what_it_holds_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "tandem.services.engine.kv_sizing"):
        assert context_length(None, 8192, 1024, True, "num_kv_blocks") == 1024
    assert "max_model_len 1024, not the model's 8192" in caplog.text


def test_an_engine_refuses_a_length_its_cache_cannot_hold(loaded_model: LoadedModel) -> None:
    with pytest.raises(KVCacheTooSmall, match="num_kv_blocks\\) holds 1024 tokens, fewer than "
                                              "one sequence of max_model_len 2048"):
        LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=2048), loaded_model)


def test_the_cpu_default_holds_the_models_context(loaded_model: LoadedModel,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "tandem.services.engine.llm_engine"):
        engine = LLMEngine(EngineConfig(), loaded_model)
    spec = engine.kv_spec
    assert spec.num_blocks == int(CPU_KV_CACHE_GB * GIB) // spec.bytes_per_block
    assert engine.max_model_len == loaded_model.config.max_position_embeddings
    stats = engine.stats
    assert stats.num_blocks * stats.block_size == spec.num_blocks * spec.block_size
    assert (f"KV cache: {spec.num_blocks} blocks of 16 tokens = {spec.num_blocks * 16} tokens "
            f"in 1.00 GiB (the CPU default): ") in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sizing from GPU memory needs a GPU")
def test_a_gpu_engine_sizes_its_cache_from_the_utilization(loaded_model: LoadedModel) -> None:
    free, total = torch.cuda.mem_get_info()
    engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16",
                                    gpu_memory_utilization=0.3), loaded_model)
    cache = engine.kv_spec.num_blocks * engine.kv_spec.bytes_per_block
    assert 0 < cache <= 0.3 * total
    # Everything this process holds, the cache included, stays within the share asked for.
    assert torch.cuda.memory_reserved() <= 0.3 * total + (total - free)
    engine.add_request(GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=4,
                                                                        temperature=0)))
    while engine.has_unfinished_requests():
        engine.step()
