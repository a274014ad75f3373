"""The engine with the triton attention backend: greedy output equals transformers' and the
torch backend's through decoding, chunked prefill, prefix-cache hits and speculative
verification, and a Qwen3-MoE model's logprobs equal transformers'. On a CPU the kernels
run under the Triton interpreter (a Python loop per kernel program): short prompts, few
tokens, and the backends compared on the model's first layers."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels' module is imported (see its tests)
    os.environ["TRITON_INTERPRET"] = "1"

from tandem.services.engine.attention import get_attention_backend, resolve_backend  # noqa: E402
from tandem.services.engine.config import EngineConfig, SpeculativeConfig  # noqa: E402
from tandem.services.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.services.engine.model_loader import load_model  # noqa: E402
from tandem.services.protocol.request import SamplingParams  # noqa: E402
from tests.engine.helpers import outputs  # noqa: E402
from tests.engine.tiny_models import assert_matches_transformers, tiny_qwen3_moe  # noqa: E402
from tests.hf_reference import Reference, compare  # noqa: E402

NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_triton_engine_equals_transformers(make_engine, prompts, references) -> None:  # type: ignore[no-untyped-def]
    # The whole model: prefill in two chunks over the cache, then decoding (the batched and
    # mixed steps are the next test's, on fewer layers).
    engine = make_engine(attention_backend="triton", max_num_batched_tokens=8)
    out = engine.generate([prompts[0]], GREEDY)[0]
    ref = Reference(references[0].tokens[:NEW_TOKENS], references[0].gaps[:NEW_TOKENS])
    result = compare(out, ref, "triton prompt 0")
    assert result.matched == NEW_TOKENS or result.near_tie_at is not None, result


def test_triton_equals_torch_on_prefix_hits_and_speculation(loaded_model, prompts) -> None:  # type: ignore[no-untyped-def]
    # The model's first 4 layers (the rest of the weights unused): the paths, not the depth.
    short = dataclasses.replace(loaded_model, config=dataclasses.replace(loaded_model.config,
                                                                         num_layers=4))
    shared = prompts[1] + prompts[2]  # the second request finds the first's blocks cached
    batch = [shared, shared + prompts[0][:5]]
    outputs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(num_kv_blocks=64, attention_backend=backend,
                                        max_num_batched_tokens=32,
                                        speculative=SpeculativeConfig(method="ngram")), short)
        outputs[backend] = [engine.generate([p], GREEDY)[0] for p in batch]
        assert engine.stats.prefix_cache_hits > 0
        # Decodes, draft verification and prefill chunks in the same steps.
        outputs[backend] += engine.generate([prompts[0], prompts[2], shared], GREEDY)
        assert engine.stats.spec_draft_tokens > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outputs["triton"] == outputs["torch"]


def test_triton_qwen3_moe_matches_transformers(loaded_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The fused layers with mixture-of-experts MLPs: a chunked prefill, then decoding.
    hf = tiny_qwen3_moe()
    hf.save_pretrained(tmp_path)
    loaded_model.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    engine = LLMEngine(EngineConfig(num_kv_blocks=16, attention_backend="triton",
                                    max_num_batched_tokens=8), load_model(tmp_path, progress=False))
    prompt = [int(t) for t in torch.randint(3, 49152, (20,),
                                             generator=torch.Generator().manual_seed(3))]
    params = dataclasses.replace(GREEDY, max_tokens=4, logprobs=0)
    out = outputs(engine, prompt, params)
    tokens = [t for o in out for t in o.new_token_ids]
    assert_matches_transformers(hf, prompt, tokens,
                                  [lp.logprob for o in out for lp in o.new_logprobs])


def test_backend_choice() -> None:
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_backend("flash", "cpu")
    interpret = os.environ.pop("TRITON_INTERPRET")
    try:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            get_attention_backend("triton", "cpu", 9, 3, 64)
    finally:
        os.environ["TRITON_INTERPRET"] = interpret
