"""The int8 KV cache (``kv_cache_dtype: int8``): its quantization, the torch and Triton backends
reading it, the prefix hash and config that keep it apart, and its error on the built-in model.

Bounds are set from measured values with margin (the measurements are printed; run with ``-s``).
The Triton kernels run under the interpreter on a CPU (small shapes), as in
test_attention_kernels.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from tandem.services.engine.attention import build_step_metadata  # noqa: E402
from tandem.services.engine.attention.torch_backend import TorchAttention  # noqa: E402
from tandem.services.engine.attention.triton_kernels import paged_attention, store_kv  # noqa: E402
from tandem.services.engine.config import EngineConfig  # noqa: E402
from tandem.services.engine.kv_cache import (  # noqa: E402
    KVCacheSpec,
    QuantizedKV,
    allocate_kv_cache,
    dequantize_int8,
    kv_storage,
    quantize_int8,
)
from tandem.services.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.services.engine.model import LlamaModel  # noqa: E402
from tandem.services.engine.model_loader import LoadedModel  # noqa: E402
from tandem.services.protocol.block_hash import HashSettings, hash_token_blocks  # noqa: E402
from tandem.services.protocol.request import (
    GenerationRequest,
    SamplingParams,  # noqa: E402
)
from tandem.services.serving.config import AppConfig, ConfigError  # noqa: E402
from tests.engine.helpers import run  # noqa: E402
from tests.engine.paged_layouts import (  # noqa: E402
    BUILTIN,
    DEVICE,
    LAYER,
    LLAMA3,
    MHA,
    TOLERANCE,
    Step,
    assert_matches,
    make_step,
    reference,
)

# Attention over an int8 cache of randn K/V against the same attention over the float cache:
# measured max |error| 0.021 (fp32), 0.025 (bf16) over these scenarios; bound with margin.
INT8_ATTENTION_ERROR = 0.04


def quantized(step: Step) -> tuple[QuantizedKV, Step]:
    """The step's cache as an int8 cache, and the step over that cache dequantized (what an
    int8 backend must compute, up to float rounding)."""
    num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = step.kv_cache.shape
    spec = KVCacheSpec(num_blocks, block_size, num_layers, num_kv_heads, head_dim, "float32",
                       "int8")
    cache = allocate_kv_cache(spec, DEVICE)
    assert isinstance(cache, QuantizedKV)
    values, scales = quantize_int8(step.kv_cache)
    cache.values.copy_(values)
    cache.scales.copy_(scales)
    return cache, dataclasses.replace(step, kv_cache=dequantize_int8(values, scales,
                                                                     step.kv_cache.dtype))


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.cpu().double() - expected).abs().max())


def test_round_trip_error_is_within_half_a_step_per_row() -> None:
    x = torch.randn(64, 3, 64, generator=torch.Generator().manual_seed(0)) * 5
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    x[1, 1, 7] = 300.0  # an outlier sets its row's step and nobody else's
    values, scales = quantize_int8(x)
    assert values.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.shape == (64, 3) and int(values.abs().max()) == 127
    back = dequantize_int8(values, scales, torch.float32)
    error = (back - x).abs()
    assert bool((error <= scales[..., None] / 2 * (1 + 1e-5)).all())  # round to nearest
    assert bool((back[0, 0] == 0).all()) and float(scales[0, 0]) == 0.0
    assert float(error[1, 0].max()) < 0.1 < float(error[1, 1].max())


def test_int8_blocks_hold_their_scales_and_nearly_twice_the_blocks_of_bf16(
        loaded_model: LoadedModel) -> None:
    model = loaded_model.config
    bf16 = KVCacheSpec.for_model(model, 16, "bfloat16", None, 1.0)
    int8 = KVCacheSpec.for_model(model, 16, "bfloat16", None, 1.0, "int8")
    # head_dim 64: a (slot, KV head) row is 64 int8 + a 4-byte scale = 68 bytes against 128.
    assert int8.bytes_per_block * 128 == bf16.bytes_per_block * 68
    assert int8.num_blocks == pytest.approx(bf16.num_blocks * 128 / 68, abs=1)
    cache = allocate_kv_cache(dataclasses.replace(int8, num_blocks=3))
    assert isinstance(cache, QuantizedKV)
    assert kv_storage(cache).shape == (3, int8.bytes_per_block)
    cache.scales[1].fill_(1.0)  # a block's scales sit in that block's bytes, nowhere else
    assert kv_storage(cache)[[0, 2]].eq(0).all() and kv_storage(cache)[1].ne(0).any()


def test_torch_store_and_triton_store_write_the_same_bytes() -> None:
    num_kv_heads, head_dim, block_size = BUILTIN[1], BUILTIN[2], 16
    spec = KVCacheSpec(5, block_size, 2, num_kv_heads, head_dim, "float32", "int8")
    new = torch.randn(7, 2, num_kv_heads, head_dim, generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([3, 17, 18, 40, 41, 5, 63])
    by_torch, by_triton = allocate_kv_cache(spec), allocate_kv_cache(spec, DEVICE)
    assert isinstance(by_torch, QuantizedKV) and isinstance(by_triton, QuantizedKV)
    by_torch.store(LAYER, new[:, 0], new[:, 1], slots // block_size, slots % block_size)
    store_kv(by_triton.values, LAYER, new[:, 0].to(DEVICE), new[:, 1].to(DEVICE),
             slots.to(DEVICE), by_triton.scales)
    assert kv_storage(by_triton).cpu().equal(kv_storage(by_torch))


# (query_len, seq_len) per sequence, head layout, block size, shared prefix blocks. The torch
# backend reads a fresh prefill's keys from the step, not the cache, so none here is fresh.
TORCH_SCENARIOS = {
    "decode": ([(1, 1), (1, 17), (1, 64), (1, 33)], BUILTIN, 16, 0),
    "single_decode": ([(1, 70), (5, 5 + 30)], BUILTIN, 16, 0),  # one decode: no mask
    "speculative": ([(4, 37), (4, 80)], LLAMA3, 16, 0),
    "prefill_chunk": ([(27, 27 + 43), (36, 36 + 30)], MHA, 8, 0),
    "shared_prefix": ([(1, 70), (4, 52), (20, 20 + 45)], BUILTIN, 16, 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", list(TORCH_SCENARIOS))
def test_torch_backend_reads_the_int8_cache(scenario: str, dtype: torch.dtype) -> None:
    seqs, heads, block_size, shared = TORCH_SCENARIOS[scenario]
    step = make_step(seqs, heads, block_size, dtype, shared_prefix_blocks=shared)
    cache, dequantized = quantized(step)
    backend = TorchAttention(heads[0] // heads[1])
    no_new = step.q.new_empty(0, heads[1], heads[2])
    # Leading short queries over cached keys decode (speculative rows: batched with a mask).
    metadata = step.metadata()
    decodes = [q == 1 or q <= 4 < n for q, n in seqs]
    metadata.num_decodes = decodes.index(False) if False in decodes else len(seqs)
    out = backend.forward(LAYER, step.q, no_new, no_new, cache,
                          backend.prepare(metadata)).view(step.q.shape)
    assert_matches(out, reference(dequantized), dtype)
    error = max_error(out, reference(step))
    print(f"torch {scenario} {dtype}: max |int8 - float cache| {error:.4f}")
    assert error < INT8_ATTENTION_ERROR + TOLERANCE[dtype]


TRITON_SCENARIOS = {
    "decode": ([(1, 1), (1, 17), (1, 64), (1, 100)], BUILTIN, 16, 0),
    "mixed": ([(1, 50), (1, 9), (33, 33 + 60), (12, 12)], LLAMA3, 32, 0),
    "shared_prefix": ([(1, 70), (4, 52), (20, 20 + 45)], BUILTIN, 16, 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", list(TRITON_SCENARIOS))
def test_triton_kernel_reads_the_int8_cache(scenario: str, dtype: torch.dtype) -> None:
    seqs, heads, block_size, shared = TRITON_SCENARIOS[scenario]
    step = make_step(seqs, heads, block_size, dtype, shared_prefix_blocks=shared)
    cache, dequantized = quantized(step)
    for num_splits in (1, 2):
        out = paged_attention(step.q, cache.values, LAYER, step.query_start, step.seq_lens,
                              step.block_tables, step.max_query_len, step.max_seq_len,
                              step.scale, num_splits=num_splits, scales=cache.scales)
        assert_matches(out, reference(dequantized), dtype)
        error = max_error(out, reference(step))
        print(f"triton {scenario} {dtype} splits {num_splits}: max |int8 - float cache| "
              f"{error:.4f}")
        assert error < INT8_ATTENTION_ERROR + TOLERANCE[dtype]


def test_prefix_hashes_differ_by_kv_dtype(make_engine) -> None:  # type: ignore[no-untyped-def]
    tokens = list(range(100, 164))
    auto, int8 = (HashSettings(16, "m"), HashSettings(16, "m", kv_cache_dtype="int8"))
    for salt in (None, "tenant"):
        auto_hashes = hash_token_blocks(tokens, 16, auto.extra_keys(salt))
        int8_hashes = hash_token_blocks(tokens, 16, int8.extra_keys(salt))
        assert not set(auto_hashes) & set(int8_hashes)
    assert auto.extra_keys("s") == ("m", "s")  # auto's hashes are what they were
    # An engine hashes as the router does with its settings (protocol/block_hash.py: PromptHasher).
    engine: LLMEngine = make_engine(kv_cache_dtype="int8", num_kv_blocks=64)
    engine.add_request(GenerationRequest("r", tokens, SamplingParams(max_tokens=1)))
    seq = engine.scheduler.requests["r"]
    settings = HashSettings(16, engine.model_config.model_id, kv_cache_dtype="int8")
    assert seq.extra_keys == settings.extra_keys()


def test_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype int8 needs attention_backend"):
        EngineConfig(kv_cache_dtype="int8", attention_backend="flash_attn", block_size=256,
                     dtype="bfloat16")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, int8, got 'int4'"):
        AppConfig(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="kv_cache_dtype int8 needs attention_backend"):
        AppConfig(kv_cache_dtype="int8", attention_backend="flash_attn", block_size=256)


def test_up_flag_reaches_the_engines(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.services.cli import _add_up_parser, up_settings

    parser = argparse.ArgumentParser(prog="tandem")
    _add_up_parser(parser.add_subparsers())
    settings = up_settings(parser.parse_args(["up", "--kv-cache-dtype", "int8"]))
    config = AppConfig.from_dict(settings, "command line")
    assert config.engine_config(decodes=True).kv_cache_dtype == "int8"
    assert config.engine_config(decodes=False).kv_cache_dtype == "int8"
    assert AppConfig.from_dict(up_settings(parser.parse_args(["up"])), "-").kv_cache_dtype == (
        "auto")
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype: invalid choice: 'fp8'" in capsys.readouterr().err


# -- the error report on the built-in model ---------------------------------------------------

CONTEXTS = (512, 2048, 4096)  # the built-in model's context is 8192 tokens
DECODE_STEPS = 6
# Against the float32 cache, on the built-in model (float32 weights, torch backend, Python's
# help topics as the text), 7 logits rows per context: measured mean |logit error| 0.10 / 0.06 /
# 0.07, max 0.45 / 0.44 / 0.55 at 512 / 2k / 4k, top-1 agreement (teacher-forced: both caches
# see the same tokens) 7/7 at each.
# Bounds with margin:
MEAN_ERROR_BOUND = 0.2
MAX_ERROR_BOUND = 1.5
MIN_AGREEMENT = 0.7


def _document(loaded: LoadedModel, length: int) -> list[int]:
    """A long English text that does not change with this repository: Python's own help
    topics (the stdlib's pydoc_data), in name order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    tokens = loaded.tokenizer.encode(text[:40_000])
    assert len(tokens) >= length, f"the text has only {len(tokens)} tokens"
    return tokens[:length]


def _logits_by_context(loaded: LoadedModel, kv_dtype: str) -> dict[int, torch.Tensor]:
    """Logits [1 + DECODE_STEPS, vocab] at each context length: the prompt's last row, then
    DECODE_STEPS decodes of the text's next tokens. The contexts share their prefix blocks
    (each prefills only past the previous one), as prefix caching would."""
    config, block_size = loaded.config, 16
    tokens = _document(loaded, CONTEXTS[-1] + DECODE_STEPS)
    model = LlamaModel(config, loaded.weights, TorchAttention(config.num_heads
                                                              // config.num_kv_heads),
                       max_positions=len(tokens))
    decode_blocks = -(-DECODE_STEPS // block_size) + 1
    num_blocks = CONTEXTS[-1] // block_size + len(CONTEXTS) * decode_blocks
    spec = KVCacheSpec(num_blocks, block_size, config.num_layers, config.num_kv_heads,
                       config.head_dim, "float32", kv_dtype)
    cache = allocate_kv_cache(spec)
    prompt_blocks = list(range(CONTEXTS[-1] // block_size))
    spare = iter(range(len(prompt_blocks), num_blocks))

    def forward(start: int, end: int, table: list[int], rows: list[int]) -> torch.Tensor:
        step = build_step_metadata([end - start], [end], [table], int(end - start == 1),
                                   block_size, "cpu")
        return model(torch.tensor(tokens[start:end]), torch.arange(start, end), cache,
                     model.attention.prepare(step), torch.tensor(rows))

    found: dict[int, torch.Tensor] = {}
    done = 0
    with torch.inference_mode():
        for context in CONTEXTS:
            table = prompt_blocks[:context // block_size]
            rows = [forward(done, context, table, [context - done - 1])]
            done = context
            # This context's decodes write into blocks of its own (the next context's prompt
            # blocks hold the text from here on).
            table = table + [next(spare) for _ in range(decode_blocks)]
            for position in range(context, context + DECODE_STEPS):
                rows.append(forward(position, position + 1, table, [0]))
            found[context] = torch.cat(rows)
    return found


def test_int8_error_by_context_length(loaded_model: LoadedModel, make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    exact = _logits_by_context(loaded_model, "auto")
    int8 = _logits_by_context(loaded_model, "int8")
    print("\ncontext | mean |logit err| | max |logit err| | top-1 agreement")
    for context in CONTEXTS:
        error = (int8[context] - exact[context]).abs()
        agreement = float((int8[context].argmax(-1) == exact[context].argmax(-1)).float().mean())
        print(f"{context:7d} | {float(error.mean()):16.4f} | {float(error.max()):15.4f} | "
              f"{agreement:.2f} of {len(error)}")
        assert float(error.mean()) < MEAN_ERROR_BOUND
        assert float(error.max()) < MAX_ERROR_BOUND
        assert agreement >= MIN_AGREEMENT

    # Free-running greedy agreement with the float32 cache: reported, not asserted (a near tie
    # may flip a token, and the outputs part from there).
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for prompt in prompts[:2]:
        outputs = [run(make_engine(kv_cache_dtype=kv, num_kv_blocks=64), prompt, params)
                   for kv in ("auto", "int8")]
        same = next((i for i, (a, b) in enumerate(zip(*outputs, strict=True)) if a != b),
                    len(outputs[0]))
        print(f"greedy: first {same} of {len(outputs[0])} tokens equal to the float32 cache's")
