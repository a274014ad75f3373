"""The cpu attention backend on a float32 cache: our AVX2 decode kernel
(csrc/decode_attention_f32.c) against a dense reference on random paged layouts, its
bit-for-bit rule for draft-verifying rows, ``auto`` choosing it for float32, and the engine
decoding through it with transformers' greedy tokens (float32 is what plain `tandem up` serves
on a CPU without AVX-512 BF16).

The kernel needs an x86 CPU with AVX2 and FMA and a C compiler (or the library built at
install); elsewhere these tests skip saying so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.services.engine import cpu_kernels
from tandem.services.engine.attention import resolve_backend
from tandem.services.engine.attention.cpu_backend import CpuAttention
from tandem.services.engine.config import EngineConfig, SpeculativeConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.protocol.request import SamplingParams
from tests.engine.paged_layouts import (
    BUILTIN,
    LAYER,
    LLAMA3,
    MHA,
    Step,
    assert_matches,
    make_step,
    reference,
)
from tests.hf_reference import Reference, compare

REASON = cpu_kernels.f32_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"float32 decode kernel: {REASON}")


def run_kernel(step: Step, query_len: int, threads: int = 1) -> torch.Tensor:
    q = step.q.contiguous()
    out = torch.full_like(q, float("nan"))
    cache = step.kv_cache[:, LAYER]
    cpu_kernels.load_f32().decode_attention(q, out, cache[:, 0], cache[:, 1], step.block_tables,
                                            step.seq_lens, query_len, step.scale, threads)
    return out


# (query_len, seq_len) per sequence, head layout, block size: lengths below, at and past a
# multiple of 8 (the kernel's key groups), blocks smaller and larger than a group, query rows
# per KV head past 8 (its output row groups).
SCENARIOS = {
    "decode": ([(1, 1), (1, 7), (1, 8), (1, 9), (1, 64), (1, 100), (1, 208)], BUILTIN, 16),
    "small_blocks": ([(1, 5), (1, 47), (1, 96)], BUILTIN, 4),
    "large_blocks": ([(1, 90), (1, 130), (1, 16)], MHA, 64),
    "head_dim_128": ([(1, 31), (1, 160)], LLAMA3, 16),
    "speculative": ([(4, 4), (4, 37), (4, 80), (4, 48)], LLAMA3, 16),
    "speculative_gqa3": ([(5, 5), (5, 70), (5, 112)], BUILTIN, 32),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kernel_matches_reference(scenario: str) -> None:
    seqs, heads, block_size = SCENARIOS[scenario]
    step = make_step(seqs, heads, block_size, torch.float32, shared_prefix_blocks=0)
    one = run_kernel(step, seqs[0][0])
    assert_matches(one, reference(step), torch.float32)
    assert torch.equal(run_kernel(step, seqs[0][0], threads=2), one)  # whichever thread


def test_a_verifying_row_equals_the_decode_row_at_its_position() -> None:
    # One sequence verifying 4 rows against 37 keys; the same cache read as 4 sequences that
    # decode one row each at positions 34..37: the same bits (a row sees only its own keys).
    step = make_step([(4, 37)], BUILTIN, 16, torch.float32)
    verify = run_kernel(step, 4)
    table = step.block_tables.expand(4, -1).contiguous()
    as_decodes = Step(step.q, step.kv_cache, torch.arange(5, dtype=torch.int32),
                      torch.arange(34, 38, dtype=torch.int32), table, 1, 37, step.scale)
    assert torch.equal(run_kernel(as_decodes, 1), verify)


def test_the_kernel_refuses_other_dtypes_and_layouts() -> None:
    step = make_step([(1, 20), (1, 9)], BUILTIN, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        run_kernel(step, 1)


def test_auto_chooses_cpu_for_a_float32_cache() -> None:
    assert resolve_backend("auto", "cpu", torch.float32) == "cpu"
    assert resolve_backend("cpu", "cpu", torch.float32) == "cpu"
    assert resolve_backend("auto", "cpu", torch.int8) == "torch"
    with pytest.raises(ValueError, match="attention_backend cpu needs a bfloat16 or float32"):
        resolve_backend("cpu", "cpu", torch.float16)
    EngineConfig(attention_backend="cpu", dtype="float32")  # accepted
    with pytest.raises(ValueError, match="attention_backend cpu needs dtype bfloat16 or float32"):
        EngineConfig(attention_backend="cpu", dtype="float16")


def test_without_a_compiler_auto_falls_back_to_torch(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cpu_kernels, "PREBUILT", tmp_path / "none")  # not built at install
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels.tempfile, "tempdir", str(tmp_path / "tmp"))
    cpu_kernels._load_f32.cache_clear()
    try:
        assert "could not build it" in (cpu_kernels.f32_unavailable_reason() or "")
        assert resolve_backend("auto", "cpu", torch.float32) == "torch"
        with pytest.raises(ValueError, match="attention_backend cpu cannot run here: could not"):
            resolve_backend("cpu", "cpu", torch.float32)
    finally:
        cpu_kernels._load_f32.cache_clear()


def test_the_engine_decodes_through_the_kernel_as_transformers_does(  # type: ignore[no-untyped-def]
        loaded_model: LoadedModel, prompts, references: list[Reference]) -> None:
    config = EngineConfig(dtype="float32", num_kv_blocks=600, max_num_batched_tokens=64,
                          speculative=SpeculativeConfig(method="ngram"))
    engine = LLMEngine(config, loaded_model)
    attention = engine.runner.model.attention
    assert isinstance(attention, CpuAttention) and attention.float32  # auto, float32, here
    assert engine.runner.decode_rows is None  # K/V read in place: no per-sequence rows
    greedy = SamplingParams(max_tokens=len(references[0].tokens), temperature=0.0,
                            ignore_eos=True)
    outputs = engine.generate(prompts, greedy)
    assert engine.stats.spec_draft_tokens > 0  # verifying rows went through the kernel too
    for i, (out, ref) in enumerate(zip(outputs, references, strict=True)):
        compare(out, ref, f"prompt {i}")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # With the kernel's helper thread: the same tokens (the same bits, whichever thread).
    helped = LLMEngine(dataclasses.replace(config, kernel_threads=2), loaded_model)
    assert helped.generate(prompts, greedy) == outputs
