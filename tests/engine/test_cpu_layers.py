"""A step's decoder layers in one C call (csrc/layers.c through cpu_layers.CpuLayers): the
bits of the layer-by-layer path through every kind of step the engine makes (decode runs of one
row and of draft-verifying rows, prefill chunks, over cached prefixes or not), a bad slot
refused before anything is written, and the models it leaves to the layer-by-layer path.

Needs the kernels with AMX; elsewhere these tests skip saying why (the engine then runs the
layers one by one, which the rest of the suite covers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.services.engine import cpu_kernels
from tandem.services.engine.attention.cpu_backend import KernelPrefill
from tandem.services.engine.attention.torch_backend import TorchPlan
from tandem.services.engine.config import EngineConfig, SpeculativeConfig
from tandem.services.engine.cpu_layers import CpuLayers
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel, load_model
from tandem.services.protocol.request import GenerationRequest, SamplingParams

REASON = cpu_kernels.unavailable_reason()
AMX = REASON is None and cpu_kernels.load().amx
pytestmark = pytest.mark.skipif(not AMX, reason=f"the layers kernel needs our kernels with AMX "
                                f"({REASON or 'no amx_tile / amx_bf16, or no leave from Linux'})")


@pytest.fixture(scope="module")
def bf16_model() -> LoadedModel:
    return load_model(dtype="bfloat16", progress=False)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
        ) -> list[tuple[str, list[int], list[tuple[int, float, list[tuple[int, float]]]]]]:
    """Every step's outputs: each request's new tokens and their logprobs (float bits)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"r{i}", prompt, params))
    steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            steps.append((out.request_id, out.new_token_ids,
                          [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs]))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return steps


@pytest.mark.parametrize("kernel_threads", [1, 2])
def test_one_call_gives_the_layer_by_layer_bits(bf16_model: LoadedModel,
                                                kernel_threads: int) -> None:
    """Prompts sharing a 40-token prefix (cached after the first), chunked by a 48-token
    budget beside decoding rows, with n-gram drafts (decode runs of 1 and of 1 + k rows): each
    step's tokens and logprobs are the same floats with the one call as without it."""
    config = EngineConfig(dtype="bfloat16", num_kv_blocks=128, max_num_batched_tokens=48,
                          kernel_threads=kernel_threads,
                          speculative=SpeculativeConfig(method="ngram"))
    shared = [(7 * i) % 900 + 50 for i in range(40)]
    prompts = [shared + [(11 * i + j) % 700 + 60 for i in range(n)]
               for j, n in enumerate((3, 70, 9, 1, 33))]
    prompts.append([5, 6, 7, 5, 6, 7, 5, 6])  # repetitive: drafts get proposed and verified
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3)
    one_call = LLMEngine(config, bf16_model)
    assert one_call.runner.model.cpu_layers is not None
    calls = []
    driver = one_call.runner.model.cpu_layers
    original = driver.run

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        done = original(*args, **kwargs)
        calls.append(done is not None)
        return done

    driver.run = counted  # type: ignore[method-assign]
    fast = run(one_call, prompts, params)
    assert calls and all(calls)  # every step went through the one call
    assert one_call.stats.prefix_cache_hits > 0 and one_call.stats.spec_draft_tokens > 0
    layered = LLMEngine(config, bf16_model)
    layered.runner.model.cpu_layers = None
    assert run(layered, prompts, params) == fast


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written(
        bf16_model: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_kv_blocks=8), bf16_model)
    model = engine.runner.model
    assert model.cpu_layers is not None
    cache = engine.runner.kv_cache
    assert isinstance(cache, torch.Tensor)
    cache_before = cache.clone()
    tokens = 4
    x = model.embed[torch.arange(100, 100 + tokens)].clone()
    x_before = x.clone()
    plan = TorchPlan(slot_blocks=torch.tensor([0, 0, 0, cache.shape[0]]),
                     slot_offsets=torch.arange(tokens), decodes=[],
                     prefills=[KernelPrefill(torch.tensor([[0], [tokens], [tokens]]),
                                             torch.zeros((1, 1), dtype=torch.int32))])
    with pytest.raises(RuntimeError, match="kernel failed"):
        model.cpu_layers.run(x, torch.arange(tokens), cache, plan, len(model.layers))
    assert torch.equal(x.view(torch.int16), x_before.view(torch.int16))
    assert torch.equal(cache.view(torch.int16), cache_before.view(torch.int16))
    # The same step with its slots in the cache runs.
    good = dataclasses.replace(plan, slot_blocks=torch.zeros(tokens, dtype=torch.int64))
    assert model.cpu_layers.run(x, torch.arange(tokens), cache, good, len(model.layers)) is x
    assert not torch.equal(x.view(torch.int16), x_before.view(torch.int16))


def test_models_it_does_not_fit_run_layer_by_layer(bf16_model: LoadedModel) -> None:
    """float32 (no cpu backend), oneDNN projections (two torch threads) and a q/k-normed
    layer are left to the layer-by-layer path."""
    assert LLMEngine(EngineConfig(num_kv_blocks=8), load_model(progress=False)
                     ).runner.model.cpu_layers is None
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = LLMEngine(EngineConfig(dtype="bfloat16", num_kv_blocks=8), bf16_model)
    finally:
        torch.set_num_threads(torch_threads)
    assert two.runner.model.cpu_layers is None
    model = LLMEngine(EngineConfig(dtype="bfloat16", num_kv_blocks=8),
                      bf16_model).runner.model
    normed = [dataclasses.replace(layer, q_norm=layer.input_norm[:64].clone(),
                                  k_norm=layer.input_norm[:64].clone())
              for layer in model.layers]
    assert CpuLayers.of(model.kernels, normed, model.attention, model.num_heads,
                        model.num_kv_heads, model.config.head_dim,
                        model.config.intermediate_size, model.config.rms_norm_eps, model.cos,
                        model.sin, model.kernel_threads, sharded=False) is None
    assert CpuLayers.of(model.kernels, model.layers, model.attention, model.num_heads,
                        model.num_kv_heads, model.config.head_dim,
                        model.config.intermediate_size, model.config.rms_norm_eps, model.cos,
                        model.sin, model.kernel_threads, sharded=True) is None
