"""The cpu attention backend: our C decode kernel against a dense reference on random paged
layouts, its bit-for-bit rule for draft-verifying rows, how ``auto`` chooses it, and the engine
decoding with it in bfloat16.

The kernel needs an x86 CPU with AVX-512 BF16 and a C compiler; on a machine without them these
tests skip saying so (the engine then runs the torch backend, which the rest of the suite
covers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.services.engine import cpu_kernels
from tandem.services.engine.attention import get_attention_backend, resolve_backend
from tandem.services.engine.attention.cpu_backend import CpuAttention
from tandem.services.engine.config import EngineConfig, SpeculativeConfig
from tandem.services.engine.cpu_kernels import AmxLinear
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel, load_model
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

REASON = cpu_kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cpu decode kernel: {REASON}")


def run_kernel(step: Step, query_len: int, threads: int = 1) -> torch.Tensor:
    """Every sequence of ``step`` (all decoding ``query_len`` rows) through the kernel
    (``threads`` 2: the helper thread takes sequences from the back)."""
    q = step.q.contiguous()
    out = torch.full_like(q, float("nan"))
    cache = step.kv_cache[:, LAYER]
    cpu_kernels.load().decode_attention(q, out, cache[:, 0], cache[:, 1], step.block_tables,
                                        step.seq_lens, query_len, step.scale, threads)
    return out


# (query_len, seq_len) per sequence, head layout, block size: lengths below, at and past a
# multiple of 16 (the kernel's key groups), blocks smaller and larger than a group.
SCENARIOS = {
    "decode": ([(1, 1), (1, 17), (1, 64), (1, 100), (1, 33), (1, 208)], BUILTIN, 16),
    "small_blocks": ([(1, 5), (1, 47), (1, 96)], BUILTIN, 8),
    "large_blocks": ([(1, 90), (1, 130), (1, 16)], MHA, 64),
    "head_dim_128": ([(1, 31), (1, 160)], LLAMA3, 16),
    "speculative": ([(4, 4), (4, 37), (4, 80), (4, 48)], LLAMA3, 16),
    "speculative_gqa3": ([(5, 5), (5, 70), (5, 112)], BUILTIN, 32),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kernel_matches_reference(scenario: str) -> None:
    seqs, heads, block_size = SCENARIOS[scenario]
    step = make_step(seqs, heads, block_size, torch.bfloat16, shared_prefix_blocks=0)
    one = run_kernel(step, seqs[0][0])
    assert_matches(one, reference(step), torch.bfloat16)
    assert torch.equal(run_kernel(step, seqs[0][0], threads=2), one)  # whichever thread


def test_a_verifying_row_equals_the_decode_row_at_its_position() -> None:
    # One sequence verifying 4 rows against 37 keys; the same cache read as 4 sequences that
    # decode one row each at positions 34..37: the same bits (a row sees only its own keys).
    step = make_step([(4, 37)], BUILTIN, 16, torch.bfloat16)
    verify = run_kernel(step, 4)
    table = step.block_tables.expand(4, -1).contiguous()
    as_decodes = Step(step.q, step.kv_cache, torch.arange(5, dtype=torch.int32),
                      torch.arange(34, 38, dtype=torch.int32), table, 1, 37, step.scale)
    assert torch.equal(run_kernel(as_decodes, 1), verify)


AMX = REASON is None and cpu_kernels.load().amx
needs_amx = pytest.mark.skipif(not AMX, reason="the prefill kernel needs AMX (amx_tile, "
                                               "amx_bf16) and Linux's leave to use it")


def run_prefill(step: Step, threads: int = 1) -> torch.Tensor:
    """Every sequence of ``step`` as a prefill span through the AMX prefill kernel."""
    q = step.q.contiguous()
    out = torch.full_like(q, float("nan"))
    starts = step.query_start.tolist()
    spans = torch.tensor([starts[:-1], [e - s for s, e in zip(starts, starts[1:], strict=False)],
                          step.seq_lens.tolist()], dtype=torch.int64)
    cache = step.kv_cache[:, LAYER]
    cpu_kernels.load().prefill_attention(q, out, cache[:, 0], cache[:, 1], step.block_tables,
                                         spans, step.scale, threads)
    return out


# (query_len, seq_len) per prefill span: fresh prompts and chunks over cached keys, lengths
# below, at and past multiples of 16 and 32 (the kernel's key tiles and pairs of them), query
# rows x group past 16 (its row tiles); head sizes 64 and 128 (4 and 8 tiles of 16 dims).
PREFILLS = {
    "fresh": ([(1, 1), (5, 5), (16, 16), (33, 33), (70, 70)], BUILTIN, 16),
    "over_cache": ([(1, 40), (7, 100), (48, 64), (32, 300)], BUILTIN, 16),
    "small_blocks": ([(9, 9), (20, 47)], BUILTIN, 8),
    "head_dim_128": ([(17, 17), (6, 90)], LLAMA3, 16),
    "mha": ([(12, 12), (31, 95)], MHA, 64),
}


@needs_amx
@pytest.mark.parametrize("scenario", list(PREFILLS))
def test_prefill_kernel_matches_reference(scenario: str) -> None:
    seqs, heads, block_size = PREFILLS[scenario]
    step = make_step(seqs, heads, block_size, torch.bfloat16)
    one = run_prefill(step)
    assert_matches(one, reference(step), torch.bfloat16)
    assert torch.equal(run_prefill(step, threads=2), one)  # whichever thread


@needs_amx
def test_a_prefill_row_is_the_same_bits_cached_or_not() -> None:
    """A prompt's last rows prefilled after a cached prefix, or in another chunking, give the
    bits they give prefilled whole (each row's own query and keys only)."""
    whole = make_step([(100, 100)], BUILTIN, 16, torch.bfloat16)
    full = run_prefill(whole)
    for chunk in (37, 1, 64):
        tail = dataclasses.replace(whole, q=whole.q[100 - chunk:],
                                   query_start=torch.tensor([0, chunk], dtype=torch.int32))
        assert torch.equal(run_prefill(tail), full[100 - chunk:])


def test_the_backend_runs_mixed_steps_like_the_reference() -> None:
    # Decodes (the kernel), a prefill chunk over cached keys and a fresh prefill (the AMX
    # prefill kernel, else SDPA) in one step, through prepare/forward as the model calls them.
    # The step's new k/v are the ones the cache already holds at their slots, so storing them
    # changes nothing.
    seqs = [(1, 50), (1, 9), (1, 71), (33, 33 + 60), (12, 12)]
    step = make_step(seqs, BUILTIN, 16, torch.bfloat16)
    num_heads, num_kv_heads, head_dim = BUILTIN
    backend = get_attention_backend("cpu", "cpu", num_heads, num_kv_heads, head_dim,
                                    torch.bfloat16)
    assert isinstance(backend, CpuAttention)
    block_size, starts = step.kv_cache.shape[3], step.query_start.tolist()
    slots = [int(step.block_tables[s, pos // block_size]) * block_size + pos % block_size
             for s, n in enumerate(step.seq_lens.tolist())
             for pos in range(n - (starts[s + 1] - starts[s]), n)]
    meta = step.metadata()
    meta.slot_mapping = torch.tensor(slots)
    cache = step.kv_cache[:, LAYER]
    k = cache[meta.slot_mapping // block_size, 0, meta.slot_mapping % block_size]
    v = cache[meta.slot_mapping // block_size, 1, meta.slot_mapping % block_size]
    plan = backend.prepare(meta)
    assert [type(b).__name__ for b in plan.decodes] == ["KernelBatch"]
    assert [type(p).__name__ for p in plan.prefills] == (
        ["KernelPrefill"] if AMX else ["PrefillSpan", "PrefillSpan"])
    out = backend.forward(LAYER, step.q, k, v, step.kv_cache, plan)
    assert_matches(out.view_as(step.q), reference(step), torch.bfloat16)


def test_auto_chooses_cpu_for_a_bfloat16_cache() -> None:
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "cpu"
    assert resolve_backend("auto", "cpu", torch.int8) == "torch"
    assert resolve_backend("cpu", "cpu", torch.bfloat16) == "cpu"
    with pytest.raises(ValueError, match="attention_backend cpu needs a bfloat16 or float32"):
        resolve_backend("cpu", "cpu", torch.float16)
    with pytest.raises(ValueError, match="attention_backend cpu runs on a CPU"):
        resolve_backend("cpu", "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="attention_backend cpu needs dtype bfloat16 or float32"):
        EngineConfig(attention_backend="cpu", dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype int8 needs attention_backend"):
        EngineConfig(attention_backend="cpu", dtype="bfloat16", kv_cache_dtype="int8")


def test_without_a_compiler_auto_falls_back_and_cpu_says_why(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cpu_kernels, "PREBUILT", tmp_path / "none")  # not built at install
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels.tempfile, "tempdir", str(tmp_path / "tmp"))
    cpu_kernels._load.cache_clear()
    try:
        assert "could not build it" in (cpu_kernels.unavailable_reason() or "")
        assert resolve_backend("auto", "cpu", torch.bfloat16) == "torch"
        with pytest.raises(ValueError, match="attention_backend cpu cannot run here: could not"):
            resolve_backend("cpu", "cpu", torch.bfloat16)
    finally:
        cpu_kernels._load.cache_clear()


def test_a_compiler_without_amx_still_builds_the_attention_kernel(monkeypatch, tmp_path  # type: ignore[no-untyped-def]
                                                                  ) -> None:
    """A real compiler that refuses the AMX flags (as GCC < 11 does): the library is built
    without the AMX projections, the decode kernel runs, the projections stay oneDNN's."""
    compiler = tmp_path / "cc-without-amx"
    compiler.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -mamx*) echo "unknown '
                        'option $a" >&2; exit 1;; esac; done\nexec cc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels.tempfile, "tempdir", str(tmp_path / "tmp"))
    cpu_kernels._load.cache_clear()
    try:
        kernels = cpu_kernels.load()
        assert not kernels.amx
        assert not AmxLinear.usable(kernels, torch.zeros(64, 64, dtype=torch.bfloat16))
        seqs, heads, block_size = SCENARIOS["decode"]
        step = make_step(seqs, heads, block_size, torch.bfloat16, shared_prefix_blocks=0)
        assert_matches(run_kernel(step, 1), reference(step), torch.bfloat16)
    finally:
        cpu_kernels._load.cache_clear()


@pytest.fixture(scope="module")
def bf16_model() -> LoadedModel:
    return load_model(dtype="bfloat16", progress=False)


def test_the_engine_decodes_through_the_kernel(bf16_model: LoadedModel, prompts,  # type: ignore[no-untyped-def]
                                               references) -> None:
    config = EngineConfig(dtype="bfloat16", num_kv_blocks=600, max_num_batched_tokens=64,
                          speculative=SpeculativeConfig(method="ngram"))
    engine = LLMEngine(config, bf16_model)
    assert engine.runner.model.attention.name == "cpu"  # auto, bfloat16, this CPU
    assert engine.runner.decode_rows is None  # K/V read in place: no per-sequence rows
    model = engine.runner.model
    # Projections through our AMX kernel where the CPU has AMX (one thread: conftest.py).
    assert isinstance(model.head, AmxLinear) == cpu_kernels.load().amx
    assert isinstance(model.layers[0].gate_up, AmxLinear) == cpu_kernels.load().amx
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, greedy)
    assert engine.stats.spec_draft_tokens > 0  # verifying rows went through the kernel too
    # bfloat16 drifts from float32 (near-ties tip either way, with either backend); most
    # prompts agree over their first 8 tokens (measured: 6/8 here, 7/8 with the torch backend).
    agree = sum(out[:8] == ref.tokens[:8] for out, ref in zip(outputs, references, strict=True))
    assert agree >= 5, f"only {agree}/8 outputs agree with float32 over 8 tokens"
    assert "Paris" in engine.tokenizer.decode(outputs[1])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # With the kernels' helper thread: the same tokens (the same bits, whichever thread).
    helped = LLMEngine(dataclasses.replace(config, kernel_threads=2), bf16_model)
    attention, head = helped.runner.model.attention, helped.runner.model.head
    assert isinstance(attention, CpuAttention) and attention.threads == 2
    assert not cpu_kernels.load().amx or isinstance(head, AmxLinear) and head.threads == 2
    assert helped.generate(prompts, greedy) == outputs
    assert helped.block_manager.num_free_blocks == helped.block_manager.num_blocks
