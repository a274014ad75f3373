"""bfloat16 runs the same engine paths (on a CPU with prepacked linears); it drifts from float32
over long outputs (expected), so the check is that it starts the same way and answers
sensibly."""

from __future__ import annotations

import torch

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.cpu_kernels import packing_available
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import load_model
from tandem.services.protocol.request import SamplingParams


def test_bfloat16_engine_agrees_with_float32_at_the_start(prompts, references):
    # The torch backend's bfloat16 path (test_cpu_backend.py runs the cpu backend's).
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_kv_blocks=600,
                                    max_num_batched_tokens=128, attention_backend="torch"),
                       load_model(dtype="bfloat16", progress=False))
    assert engine.kv_cache.dtype.is_floating_point and engine.kv_cache.element_size() == 2
    # On a CPU whose oneDNN runs bfloat16 its linears run on prepacked weights, elsewhere (an
    # AVX2-only CPU) on F.linear (engine/cpu_kernels.py).
    packs = packing_available("cpu", torch.bfloat16)
    assert engine.runner.model.head.packed is packs
    assert engine.runner.model.layers[0].qkv.packed is packs
    # The six prompts up to 480 tokens (bfloat16 linears are slow on an AVX2-only CPU: the two
    # of ~1,000 tokens would double the time).
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts[:6], greedy)
    same_first = sum(out[0] == ref.tokens[0] for out, ref in zip(outputs, references[:6],
                                                                  strict=True))
    assert same_first >= 4, f"only {same_first}/6 first tokens agree with float32"
    assert "Paris" in engine.tokenizer.decode(outputs[1])  # "What is the capital of France?"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
