"""The engine's GPU path on one device: numerics against the torch reference, then timings.

    make gpu-check                            # = python3 -m tandem.loadtest.gpu_check
    TRITON_INTERPRET=1 python -m tandem.loadtest.gpu_check --tiny --out DIR   # on a CPU

Needs only torch and Triton (no Ray, NIXL or flash-attn; nothing downloaded or carried): a
model of Llama-3-8B's shape with random bfloat16 weights (``--tiny``: a 2-layer toy in
float32). Each check is one JSON line, printed and appended to ``--out``/gpu_check.jsonl as
it finishes (a crash keeps what ran); the last lines are one verdict per target. Sections:

- ``kernels``: each backend's attention (store + kernel; triton, triton over an int8 cache,
  flash_attn where installed) against the torch backend's on random paged steps over a
  random cache: decodes, draft rows, a prefill chunk over cached context, a mixed step,
  split-KV; the int8 store's bytes equal to ``quantize_int8``'s.
- ``sampler``: the device's noise equals the CPU's bit for bit; a seeded request draws the
  same tokens alone and in a batch of 32.
- ``recompiles``: kernel variants Triton compiles over eager steps of every batch size from 1
  to 64 after the first (0 expected).
- ``agreement``: greedy tokens of the torch and triton backends, and of CUDA graphs.
- ``decode``: one decode step at batch 1, 16, 64 with 1k and 8k contexts over a random cache:
  triton eager, triton through the engine's CUDA graphs (``DecodeGraphs.run``, its input
  copies included), torch eager, against the HBM floor measured in the same run (the bytes a
  step must read at the bandwidth of a device-to-device copy).
- ``prefill``: tokens/s of a 2k and an 8k prompt through the model per backend; one layer's
  attention, the paged kernel against SDPA's flash kernel on contiguous tensors.
- ``sweep`` (``--sections ... sweep``): the attention kernel's tile choices and split counts
  timed side by side.
- ``projections`` (asked for): each projection's weight times 1 and 16 rows, cuBLAS against
  our Triton kernel (``engine/triton_linear.py``) at its default tile and a sweep of tiles, in
  GB/s of weight read; then decode steps through CUDA graphs with every projection ours.
- ``profile`` (asked for): torch.profiler's kernel table of batch-1 decode steps, eager and
  graphed (``--out``/profile_*.txt).

Targets (issue 42; benchmark figures, not tests): decode <= 1.15x the floor at batch 1 and
64; prefill attention >= 0.8x SDPA's flash kernel; every numeric check ok.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F

from tandem.services.engine import triton_linear
from tandem.services.engine.attention import (
    StepMetadata,
    build_step_metadata,
    get_attention_backend,
    triton_kernels,
    triton_ops,
)
from tandem.services.engine.attention.triton_kernels import LaunchConfig, paged_attention, store_kv
from tandem.services.engine.config import ModelConfig
from tandem.services.engine.cuda_graphs import DecodeGraphs, cuda_graph_capture, eager_capture
from tandem.services.engine.kv_cache import KVCache, QuantizedKV, quantize_int8
from tandem.services.engine.model import LlamaModel
from tandem.services.engine.sampler import exponential_noise, sample
from tandem.services.protocol.request import SamplingParams

PROG = "python3 -m tandem.loadtest.gpu_check"
LLAMA3_8B = ModelConfig("llama-3-8b-shaped", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=16384, tie_word_embeddings=False,
                        eos_token_ids=(128001,))
TINY = ModelConfig("tiny", vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                   rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                   eos_token_ids=(2,))
DECODE_TARGET = 1.15  # a decode step's time over the HBM floor, at most
PREFILL_TARGET = 0.8  # the paged kernel's speed over SDPA's flash kernel, at least


@dataclass(frozen=True)
class Plan:
    config: ModelConfig
    dtype: torch.dtype
    device: str
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prompts: tuple[int, ...]
    iters: int
    copy_bytes: int

    @property
    def tiny(self) -> bool:
        return self.config.model_id == TINY.model_id


def make_plan(tiny: bool) -> Plan:
    if tiny:
        return Plan(TINY, torch.float32, "cpu", 16, (1, 2), (32, 64), (48,), 2, 1 << 24)
    return Plan(LLAMA3_8B, torch.bfloat16, "cuda", 16, (1, 16, 64), (1024, 8192),
                (2048, 8192), 20, 4 << 30)


class Report:
    """Each row a JSON line, on stdout and appended to the file as soon as it is made."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.rows: list[dict[str, Any]] = []

    def add(self, section: str, **fields: Any) -> dict[str, Any]:
        row = {"section": section, **fields}
        self.rows.append(row)
        line = json.dumps(row, default=str)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()
        return row

    def section(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["section"] == name]


# -- the model and its inputs ------------------------------------------------------------------

def random_model(plan: Plan, backend: str) -> LlamaModel:
    c, gen = plan.config, torch.Generator(plan.device).manual_seed(0)

    def w(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=plan.device) * scale).to(plan.dtype)

    weights = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size),
               "model.norm.weight": w(c.hidden_size, scale=0.0) + 1}
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = w(c.vocab_size, c.hidden_size)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": w(c.hidden_size, scale=0.0) + 1,
                    p + "post_attention_layernorm.weight": w(c.hidden_size, scale=0.0) + 1,
                    p + "self_attn.q_proj.weight": w(q, c.hidden_size),
                    p + "self_attn.k_proj.weight": w(kv, c.hidden_size),
                    p + "self_attn.v_proj.weight": w(kv, c.hidden_size),
                    p + "self_attn.o_proj.weight": w(c.hidden_size, q),
                    p + "mlp.gate_proj.weight": w(c.intermediate_size, c.hidden_size),
                    p + "mlp.up_proj.weight": w(c.intermediate_size, c.hidden_size),
                    p + "mlp.down_proj.weight": w(c.hidden_size, c.intermediate_size)}
    return LlamaModel(c, weights, backend_of(plan, backend), c.max_position_embeddings,
                      plan.device)


def backend_of(plan: Plan, name: str) -> Any:
    c = plan.config
    return get_attention_backend(name, plan.device, c.num_heads, c.num_kv_heads, c.head_dim)


def with_backend(model: LlamaModel, plan: Plan, backend: str) -> LlamaModel:
    """The same weights behind another attention backend."""
    return model.with_attention(backend_of(plan, backend))


def step_read_bytes(model: LlamaModel, kv_tokens: int, plan: Plan) -> int:
    """What a decode step must read: every weight once (the embedding only by row) and the
    KV of every cached token."""
    layers = sum(layer.weight_bytes() for layer in model.layers)
    head = model.lm_head.numel() * model.lm_head.element_size()
    c = plan.config
    kv = kv_tokens * c.num_layers * 2 * c.num_kv_heads * c.head_dim * model.embed.element_size()
    return layers + head + kv


def random_cache(plan: Plan, num_blocks: int, layers: int | None = None,
                 quantized: bool = False, seed: int = 1) -> KVCache:
    """A cache of random K/V (never zeros: they would hide unwritten or misread entries and can
    run faster than real data); int8: random values and positive scales."""
    c, gen = plan.config, torch.Generator(plan.device).manual_seed(seed)
    shape = (num_blocks, c.num_layers if layers is None else layers, 2, plan.block_size,
             c.num_kv_heads, c.head_dim)
    if not quantized:
        cache = torch.empty(shape, dtype=plan.dtype, device=plan.device)
        for block in cache.split(max(1, (1 << 30) // cache[0].nbytes)):  # 1 GB at a time
            block.copy_(torch.randn(block.shape, generator=gen, device=plan.device))
        return cache
    values = torch.randint(-127, 128, shape, generator=gen, device=plan.device,
                           dtype=torch.int8)
    scales = torch.rand(shape[:-1], generator=gen, device=plan.device) * 0.02 + 1e-3
    return QuantizedKV(values.view(num_blocks, -1), values, scales)


@dataclass
class Inputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    step: StepMetadata
    logits_rows: torch.Tensor


def uniform_step(plan: Plan, seqs: list[tuple[int, int]], num_decodes: int) -> Inputs:
    """Sequence s has query length q and seq_len n (``seqs[s] = (q, n)``) over its own
    consecutive blocks; tokens are arbitrary ids."""
    tables, first, rows = [], 0, []
    for _, n in seqs:
        blocks = -(-n // plan.block_size)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    positions = [p for q, n in seqs for p in range(n - q, n)]
    end = 0
    for q, _ in seqs:
        end += q
        rows.append(end - 1)
    device = plan.device
    step = build_step_metadata([q for q, _ in seqs], [n for _, n in seqs], tables, num_decodes,
                               plan.block_size, device)
    ids = torch.tensor([(7 * p + 3) % plan.config.vocab_size for p in positions], device=device)
    return Inputs(ids, torch.tensor(positions, device=device), step,
                  torch.tensor(rows, device=device))


def forward(model: LlamaModel, inputs: Inputs, cache: KVCache) -> Callable[[], torch.Tensor]:
    """One step of ``model`` on ``inputs`` (the backend's plan made once, as the runner does)."""
    plan = model.attention.prepare(inputs.step)
    return functools.partial(model, inputs.input_ids, inputs.positions, cache, plan,
                             inputs.logits_rows)


def _capture(plan: Plan) -> Any:
    """CUDA graphs on a GPU; on a CPU (--tiny) the step run eagerly on the graph's buffers."""
    return cuda_graph_capture if plan.device == "cuda" else eager_capture


def blocks_for(plan: Plan, seqs: list[tuple[int, int]]) -> int:
    return sum(-(-n // plan.block_size) for _, n in seqs)


# -- timing ------------------------------------------------------------------------------------

def timed_ms(fn: Callable[[], Any], plan: Plan, repeats: int = 5) -> float:
    """Median milliseconds of ``fn`` over ``plan.iters`` rounds after two warm-ups; a round
    times ``repeats`` calls back to back and divides, so a short kernel is not timed with the
    gap its launch from Python leaves before it (a device that waits on the host)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(plan.iters):
        if plan.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / repeats)
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def copy_bandwidth(plan: Plan) -> float:
    """Bytes/s the memory moves in a device-to-device copy (each byte read once, written once)."""
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), plan)
    return 2 * plan.copy_bytes / (ms / 1e3)


# -- numerics ----------------------------------------------------------------------------------

KERNEL_CASES = {  # (query_len, seq_len) per sequence; how many lead as decodes
    "decode": ([(1, 1), (1, 17), (1, 300), (1, 1000)], 4),
    "speculative": ([(4, 40), (4, 333)], 2),
    "prefill_chunk": ([(100, 612)], 0),
    "mixed": ([(1, 77), (1, 500), (64, 64), (33, 300)], 2),
}
TINY_KERNEL_CASES = {
    "decode": ([(1, 1), (1, 17), (1, 40)], 3),
    "mixed": ([(1, 20), (2, 30), (12, 12), (9, 25)], 2),
}


def attention_backends(plan: Plan) -> Iterator[tuple[str, str, bool, str | None]]:
    """(label, backend, int8 cache, why it cannot run here) for each backend to check."""
    yield "triton", "triton", False, None
    yield "triton_int8", "triton", True, None
    flash = importlib.util.find_spec("flash_attn") is not None
    yield ("flash_attn", "flash_attn", False,
           None if flash and plan.block_size % 256 == 0 else
           "flash_attn is not installed" if not flash else "needs blocks of 256 tokens")


def check_kernels(plan: Plan, report: Report) -> None:
    """Each case through each backend and the torch backend on the same random cache and
    q/k/v: outputs within the dtype's tolerance, caches written alike."""
    c = plan.config
    tolerance = 1e-4 if plan.dtype == torch.float32 else 3e-2
    gen = torch.Generator(plan.device).manual_seed(1)
    reference = backend_of(plan, "torch")
    for label, name, quantized, problem in attention_backends(plan):
        if problem is not None:
            report.add("kernels", backend=label, skipped=problem)
            continue
        backend = backend_of(plan, name)
        for case, (seqs, decodes) in (TINY_KERNEL_CASES if plan.tiny else KERNEL_CASES).items():
            inputs = uniform_step(plan, seqs, decodes)
            cache = random_cache(plan, blocks_for(plan, seqs), layers=1, quantized=quantized,
                                 seed=len(report.rows))
            tokens = inputs.input_ids.numel()
            q, k, v = (torch.randn(tokens, h, c.head_dim, generator=gen, device=plan.device)
                       .to(plan.dtype) for h in (c.num_heads, c.num_kv_heads, c.num_kv_heads))
            expected_cache = _clone(cache)
            expected = reference.forward(0, q, k, v, expected_cache,
                                         reference.prepare(inputs.step))
            got = backend.forward(0, q, k, v, cache, backend.prepare(inputs.step))
            error = (got.float() - expected.float()).abs().max().item()
            same_cache = _equal(cache, expected_cache)
            report.add("kernels", backend=label, case=case, max_abs_error=error,
                       cache_equal=same_cache, ok=error <= tolerance and same_cache)
    # Split-KV against one pass, on long decodes.
    seqs = [(1, 40), (1, 64)] if plan.tiny else [(1, 4000), (1, 8000)]
    inputs = uniform_step(plan, seqs, len(seqs))
    cache = random_cache(plan, blocks_for(plan, seqs), layers=1)
    q = torch.randn(len(seqs), c.num_heads, c.head_dim, generator=gen,
                    device=plan.device).to(plan.dtype)
    s = inputs.step
    outs = [paged_attention(q, cache, 0, s.query_start, s.seq_lens, s.block_tables,
                            s.max_query_len, s.max_seq_len, c.head_dim ** -0.5, num_splits=n)
            for n in (1, 4)]
    error = (outs[0].float() - outs[1].float()).abs().max().item()
    report.add("kernels", backend="triton", case="split_kv", max_abs_error=error,
               ok=error <= tolerance)
    # The int8 store rounds as quantize_int8 does, byte for byte (the GPU's float32 division
    # differs from torch's unless the kernel asks for IEEE rounding).
    tokens = 4096 if not plan.tiny else 64
    k, v = (torch.randn(tokens, c.num_kv_heads, c.head_dim, generator=gen,
                        device=plan.device).to(plan.dtype) for _ in range(2))
    quantized = random_cache(plan, -(-tokens // plan.block_size), layers=1, quantized=True)
    assert isinstance(quantized, QuantizedKV)
    slots = torch.arange(tokens, device=plan.device)
    store_kv(quantized.values, 0, k, v, slots, quantized.scales)
    mismatched = 0
    for kv, x in enumerate((k, v)):
        values, scales = quantize_int8(x)
        stored = quantized.values[:, 0, kv].reshape(tokens, *values.shape[1:])
        stored_scales = quantized.scales[:, 0, kv].reshape(tokens, -1)
        mismatched += int((stored != values).sum()) + int((stored_scales != scales).sum())
    report.add("kernels", backend="triton", case="int8_store_bytes", mismatched=mismatched,
               ok=mismatched == 0)


def _clone(cache: KVCache) -> KVCache:
    if isinstance(cache, QuantizedKV):
        values, scales = cache.values.clone(), cache.scales.clone()
        return QuantizedKV(values.view(values.shape[0], -1), values, scales)
    return cache.clone()


def _equal(a: KVCache, b: KVCache) -> bool:
    if isinstance(a, QuantizedKV) and isinstance(b, QuantizedKV):
        return torch.equal(a.values, b.values) and torch.equal(a.scales, b.scales)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return torch.equal(a, b)


def check_sampler(plan: Plan, report: Report) -> None:
    vocab = plan.config.vocab_size
    same_noise = all(torch.equal(exponential_noise(seed, pos, vocab, device=plan.device).cpu(),
                                 exponential_noise(seed, pos, vocab))
                     for seed, pos in ((0, 0), (12345, 7), (2**62 + 11, 4095)))
    gen = torch.Generator(plan.device).manual_seed(2)
    logits = torch.randn(32, vocab, generator=gen, device=plan.device) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50 * (i % 3), seed=100 + i)
              if i % 4 else SamplingParams(temperature=0.0) for i in range(32)]
    positions = list(range(32))
    batched = sample(logits, params, positions)
    alone = [sample(logits[i:i + 1], [params[i]], [positions[i]])[0] for i in range(32)]
    report.add("sampler", noise_equals_cpu=same_noise, batch_equals_alone=batched == alone,
               ok=same_noise and batched == alone)


def check_recompiles(plan: Plan, report: Report, model: LlamaModel) -> None:
    """Kernel variants compiled over eager decode steps of 1..64 sequences of different
    lengths, after one step of each kind has compiled what serving needs."""
    if plan.device != "cuda":
        report.add("recompiles", skipped="the interpreter compiles nothing", ok=True)
        return
    kernels = [triton_kernels._paged_attention_kernel, triton_kernels._store_kv_kernel,
               triton_kernels._reduce_splits_kernel, triton_ops._rms_norm_kernel,
               triton_ops._rotary_store_kernel, triton_ops._silu_mul_kernel]

    def variants() -> int:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    cache = random_cache(plan, 64 * 40 + 8)
    forward(model, uniform_step(plan, [(1, 33)], 1), cache)()  # the first decode step
    before, began = variants(), time.perf_counter()
    for batch in range(1, 65):
        seqs = [(1, 17 + (7 * i + batch) % 600) for i in range(batch)]
        forward(model, uniform_step(plan, seqs, batch), cache)()
    torch.cuda.synchronize()
    added = variants() - before
    report.add("recompiles", steps=64, variants_added=added,
               seconds=round(time.perf_counter() - began, 2), ok=added == 0)


def check_agreement(plan: Plan, report: Report, model: LlamaModel, steps: int = 8) -> None:
    """Greedy tokens after a 64-token prompt: torch and triton backends, and the engine's
    decode graphs, each on its own cache. A variant that fails is reported by name."""
    tokens: dict[str, list[int]] = {}
    prompt = [(11 * i + 5) % plan.config.vocab_size for i in range(64)]
    blocks = -(-(64 + steps) // plan.block_size)
    try:  # the engine's own start-up check of its graphs
        graphs = DecodeGraphs(model, random_cache(plan, blocks), plan.block_size, 4,
                              len(prompt) + steps, plan.device, capture=_capture(plan))
        problem = graphs.self_check(list(range(blocks)))
    except Exception as exc:
        problem = repr(exc)[:300]
    report.add("agreement", variant="graph_self_check", problem=problem, ok=problem is None)
    for name in ("torch", "triton", "triton_graph"):
        try:
            tokens[name] = _greedy(plan, model, name, prompt, blocks, steps)
        except Exception as exc:
            report.add("agreement", variant=name, error=repr(exc)[:300], ok=False)
            return
    graph_equal = tokens["triton_graph"] == tokens["triton"]
    equal = sum(a == b for a, b in zip(tokens["torch"], tokens["triton"], strict=True))
    # bfloat16 backends may part at a near tie; the graph replays the eager kernels exactly.
    report.add("agreement", steps=steps, torch_triton_equal=equal, graph_equals_eager=graph_equal,
               tokens=tokens, ok=graph_equal and (equal == steps or plan.dtype != torch.float32))


def _greedy(plan: Plan, model: LlamaModel, name: str, prompt: list[int], blocks: int,
            steps: int) -> list[int]:
    m = with_backend(model, plan, "torch" if name == "torch" else "triton")
    cache = random_cache(plan, blocks)
    graphs = (DecodeGraphs(m, cache, plan.block_size, 1, len(prompt) + steps, plan.device,
                           capture=_capture(plan)) if name == "triton_graph" else None)
    inputs = uniform_step(plan, [(len(prompt), len(prompt))], 0)
    inputs.input_ids = torch.tensor(prompt, device=plan.device)
    out = [int(forward(m, inputs, cache)()[-1].argmax())]
    for _ in range(steps - 1):
        n = len(prompt) + len(out)
        if graphs is not None:
            logits = graphs.run(out[-1:], [n], [list(range(-(-n // plan.block_size)))])
        else:
            inputs = uniform_step(plan, [(1, n)], 1)
            inputs.input_ids = torch.tensor(out[-1:], device=plan.device)
            logits = forward(m, inputs, cache)()
        out.append(int(logits[-1].argmax()))
    return out


# -- timings -----------------------------------------------------------------------------------

def decode_timings(plan: Plan, report: Report, model: LlamaModel, bandwidth: float) -> None:
    models = {"triton": model, "torch": with_backend(model, plan, "torch")}
    most = max(plan.batches) * (max(plan.contexts) + 1)
    cache = random_cache(plan, -(-most // plan.block_size) + max(plan.batches))
    for batch in plan.batches:
        projections_ms = round(timed_ms(_capture(plan)(_projections(model, batch)), plan), 3)
        for context in plan.contexts:
            seqs = [(1, context + 1)] * batch
            blocks = -(-(context + 1) // plan.block_size)
            inputs = uniform_step(plan, seqs, batch)
            floor_ms = step_read_bytes(model, batch * (context + 1), plan) / bandwidth * 1e3
            # The step's projections alone, as a graph: what the GEMMs leave the rest.
            row: dict[str, Any] = {"batch": batch, "context": context,
                                   "floor_ms": round(floor_ms, 3),
                                   "projections_graph_ms": projections_ms}
            for name, m in models.items():
                row[f"{name}_ms"] = round(timed_ms(forward(m, inputs, cache), plan), 3)
            graphs = DecodeGraphs(model, cache, plan.block_size, batch, context + 1, plan.device,
                                  capture=_capture(plan))
            tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(batch)]
            replay = functools.partial(graphs.run, [5] * batch, [context + 1] * batch, tables)
            row["triton_graph_ms"] = round(timed_ms(replay, plan), 3)
            for key in [k for k in row if k.endswith("_ms") and k != "floor_ms"
                        and not k.startswith("projections")]:
                row[key.replace("_ms", "_x_floor")] = round(row[key] / floor_ms, 3)
            report.add("decode", **row)
            del graphs
            if plan.device == "cuda":
                torch.cuda.empty_cache()


def _projections(model: LlamaModel, batch: int) -> Callable[[], torch.Tensor]:
    """Every projection of a decode step of ``batch`` tokens, the head included, on random
    rows (the model's other work left out)."""
    c = model.config
    h = torch.randn(batch, c.hidden_size, device=model.embed.device).to(model.embed.dtype)
    act = torch.randn(batch, model.layers[0].down.weight.shape[1],
                      device=h.device).to(h.dtype)
    attn = torch.randn(batch, model.layers[0].o.weight.shape[1], device=h.device).to(h.dtype)

    def run() -> torch.Tensor:
        for layer in model.layers:
            layer.qkv(h)
            layer.o(attn)
            layer.gate_up(h)
            layer.down(act)
        return model.head(h)

    return run


def prefill_timings(plan: Plan, report: Report, model: LlamaModel) -> None:
    models = {"triton": model, "torch": with_backend(model, plan, "torch")}
    for n in plan.prompts:
        cache = random_cache(plan, -(-n // plan.block_size))
        inputs = uniform_step(plan, [(n, n)], 0)
        row: dict[str, Any] = {"prompt_tokens": n}
        for name, m in models.items():
            row[f"{name}_tokens_per_s"] = round(n / (timed_ms(forward(m, inputs, cache),
                                                              plan) / 1e3))
        paged_ms, sdpa_ms = prefill_attention_ms(plan, n, cache)
        row |= {"paged_attention_ms": round(paged_ms, 3), "sdpa_flash_ms": round(sdpa_ms, 3),
                "paged_vs_sdpa_speed": round(sdpa_ms / paged_ms, 3)}
        report.add("prefill", **row)


def prefill_attention_ms(plan: Plan, n: int, cache: KVCache,
                         config: LaunchConfig | None = None) -> tuple[float, float]:
    """One layer's attention over an ``n``-token prompt: our paged kernel over ``cache``, and
    SDPA's flash kernel on contiguous q/k/v (K/V heads repeated for it beforehand)."""
    c = plan.config
    gen = torch.Generator(plan.device).manual_seed(3)
    q = torch.randn(n, c.num_heads, c.head_dim, generator=gen, device=plan.device).to(plan.dtype)
    inputs = uniform_step(plan, [(n, n)], 0)
    s, scale = inputs.step, c.head_dim ** -0.5
    assert isinstance(cache, torch.Tensor)
    paged_ms = timed_ms(functools.partial(paged_attention, q, cache, 0, s.query_start,
                                          s.seq_lens, s.block_tables, n, n, scale,
                                          config=config), plan)
    group = c.num_heads // c.num_kv_heads
    k, v = (torch.randn(n, c.num_kv_heads, c.head_dim, generator=gen, device=plan.device)
            .to(plan.dtype).repeat_interleave(group, 1) for _ in range(2))
    q4, k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
    sdpa = functools.partial(F.scaled_dot_product_attention, q4, k4, v4, is_causal=True)
    if plan.device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa()
        return paged_ms, timed_ms(flash, plan)
    return paged_ms, timed_ms(sdpa, plan)


def sweep(plan: Plan, report: Report) -> None:
    """The attention kernel's tile choices side by side: decode at batch 1 and 64 over 8k
    keys (against the KV bytes at the copy bandwidth) and an 8k prefill (against SDPA)."""
    c = plan.config
    group = c.num_heads // c.num_kv_heads
    context = max(plan.contexts)
    decode_configs = [LaunchConfig(16, n, w, s) for n, w, s in (
        (32, 2, 3), (64, 4, 3), (64, 2, 4), (128, 4, 4))]
    prefill_configs = [LaunchConfig(m, n, w, s) for m, n, w, s in (
        (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2))]
    if plan.tiny:
        decode_configs, prefill_configs = decode_configs[:2], prefill_configs[:2]
    default = triton_kernels.launch_config(group, 1, c.head_dim, plan.dtype.itemsize)
    for batch in (1, max(plan.batches)):
        seqs = [(1, context + 1)] * batch
        s = uniform_step(plan, seqs, batch).step
        cache = random_cache(plan, blocks_for(plan, seqs), layers=1)
        q = torch.randn(batch, c.num_heads, c.head_dim, device=plan.device).to(plan.dtype)
        splits = triton_kernels.choose_num_splits(batch, c.num_kv_heads, 1, context + 1)
        kv_bytes = batch * (context + 1) * 2 * c.num_kv_heads * c.head_dim * plan.dtype.itemsize
        for config in decode_configs:
            try:
                ms = timed_ms(functools.partial(
                    paged_attention, q, cache, 0, s.query_start, s.seq_lens, s.block_tables,
                    1, context + 1, c.head_dim ** -0.5, num_splits=splits, config=config), plan)
            except Exception as exc:  # a variant past the chip's limits: say so, go on
                report.add("sweep", kind="decode", batch=batch, config=config.__dict__,
                           error=repr(exc)[:200])
                continue
            report.add("sweep", kind="decode", batch=batch, splits=splits,
                       config=config.__dict__, default=config == default, ms=round(ms, 4),
                       kv_gb_s=round(kv_bytes / ms / 1e6, 1))
        for other in (4, 8, 16, 32, 64) if batch == 1 else ():  # the split count, by hand
            ms = timed_ms(functools.partial(
                paged_attention, q, cache, 0, s.query_start, s.seq_lens, s.block_tables,
                1, context + 1, c.head_dim ** -0.5, num_splits=other), plan)
            report.add("sweep", kind="decode_splits", batch=batch, splits=other,
                       default=other == splits, ms=round(ms, 4),
                       kv_gb_s=round(kv_bytes / ms / 1e6, 1))
    n = max(plan.prompts)
    cache = random_cache(plan, -(-n // plan.block_size), layers=1)
    default = triton_kernels.launch_config(group, n, c.head_dim, plan.dtype.itemsize)
    for config in prefill_configs:
        try:
            paged_ms, sdpa_ms = prefill_attention_ms(plan, n, cache, config)
        except Exception as exc:
            report.add("sweep", kind="prefill", config=config.__dict__, error=repr(exc)[:200])
            continue
        report.add("sweep", kind="prefill", prompt_tokens=n, config=config.__dict__,
                   default=config == default, ms=round(paged_ms, 3),
                   vs_sdpa=round(sdpa_ms / paged_ms, 3))


# -- projections: our Triton kernel for a few rows against cuBLAS --------------------------------

L2_BYTES = 256 << 20  # more than any GPU's L2: a timing cycles through this much weight
PROJECTION_CONFIGS = {  # rows bucket -> the tile choices the sweep times
    1: [triton_linear.LaunchConfig(n, k, w, 3) for n in (16, 32, 64) for k in (256, 512)
        for w in (4, 8)],
    16: [triton_linear.LaunchConfig(n, k, 4, s) for n in (16, 32, 64) for k in (64, 128)
         for s in (3, 4)],
}


def projection_weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    layer = model.layers[0]
    return {"qkv": layer.qkv.weight, "o": layer.o.weight, "gate_up": layer.gate_up.weight,
            "down": layer.down.weight, "head": model.lm_head}


def check_projections(plan: Plan, report: Report, model: LlamaModel) -> None:
    """Each projection's weight times 1 and 16 rows: cuBLAS (F.linear) against our kernel
    (triton_linear) at its default tile and at each tile of the sweep, in GB/s of weight read
    (a timing cycles through copies of the weight larger than the L2 together). Numerics: our
    error against a float32 product at most twice cuBLAS's. The best tile per shape goes into
    ``triton_linear.TUNED`` for the decode figures after."""
    configs = {r: cs[:2] for r, cs in PROJECTION_CONFIGS.items()} if plan.tiny \
        else PROJECTION_CONFIGS
    gen = torch.Generator(plan.device).manual_seed(3)
    for rows in (1, 16):
        for name, weight in projection_weights(model).items():
            n, k = weight.shape
            extra = 0 if plan.tiny else min(7, -(-L2_BYTES // weight.nbytes) - 1)
            copies = [weight] + [torch.randn(weight.shape, generator=gen, device=plan.device)
                                 .mul_(0.02).to(weight.dtype) for _ in range(extra)]
            x = torch.randn(rows, k, generator=gen, device=plan.device).to(weight.dtype)
            reference = x.float() @ weight.float().T
            scale = reference.abs().max().item()

            def error(out: torch.Tensor, ref: torch.Tensor = reference, s: float = scale
                      ) -> float:
                return (out.float() - ref).abs().max().item() / s

            def per_call_ms(op: Callable[[torch.Tensor], torch.Tensor],
                            ws: list[torch.Tensor] = copies) -> float:
                graph = _capture(plan)(lambda: [op(w) for w in ws][-1])
                return timed_ms(graph, plan) / len(ws)

            row: dict[str, Any] = {"rows": rows, "projection": name, "n": n, "k": k,
                                   "weight_mb": round(weight.nbytes / 2**20, 1)}
            row["err_cublas"] = error(F.linear(x, weight))
            row["err_triton"] = error(triton_linear.linear(x, weight))
            row["cublas_ms"] = round(per_call_ms(functools.partial(F.linear, x)), 4)
            row["triton_default_ms"] = round(per_call_ms(
                functools.partial(triton_linear.linear, x)), 4)
            best = (row["triton_default_ms"], triton_linear.launch_config(rows, n, k))
            for config in configs[rows]:
                try:
                    err = error(triton_linear.linear(x, weight, config=config))
                    ms = per_call_ms(functools.partial(triton_linear.linear, x, config=config))
                except Exception as exc:  # a tile past the chip's limits: say so, go on
                    report.add("projections_sweep", rows=rows, projection=name,
                               config=config.__dict__, error=repr(exc)[:200])
                    continue
                if err > max(2 * row["err_cublas"], 1e-6):  # a wrong tile is never the best
                    report.add("projections_sweep", rows=rows, projection=name,
                               config=config.__dict__, err=err, ok=False)
                    continue
                best = min(best, (ms, config), key=lambda b: b[0])
            triton_linear.TUNED[(triton_linear.rows_bucket(rows), n, k)] = best[1]
            row |= {"triton_best_ms": round(best[0], 4), "best_config": best[1].__dict__,
                    "cublas_gb_s": round(weight.nbytes / row["cublas_ms"] / 1e6, 1),
                    "triton_best_gb_s": round(weight.nbytes / best[0] / 1e6, 1),
                    "best_vs_cublas_speed": round(row["cublas_ms"] / best[0], 3),
                    "ok": row["err_triton"] <= max(2 * row["err_cublas"], 1e-6)}
            report.add("projections", **row)
            del copies
    triton_model = with_triton_projections(model)
    bandwidth = report.section("bandwidth")[-1]["copy_gb_s"] * 1e9
    most = 16 * (max(plan.contexts) + 1)
    cache = random_cache(plan, -(-most // plan.block_size) + 16)
    for batch in (1, 16) if not plan.tiny else (1,):
        for context in plan.contexts:
            blocks = -(-(context + 1) // plan.block_size)
            floor_ms = step_read_bytes(model, batch * (context + 1), plan) / bandwidth * 1e3
            graphs = DecodeGraphs(triton_model, cache, plan.block_size, batch, context + 1,
                                  plan.device, capture=_capture(plan))
            tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(batch)]
            ms = timed_ms(functools.partial(graphs.run, [5] * batch, [context + 1] * batch,
                                            tables), plan)
            report.add("decode_triton_projections", batch=batch, context=context,
                       floor_ms=round(floor_ms, 3), projections_graph_ms=round(timed_ms(
                           _capture(plan)(_projections(triton_model, batch)), plan), 3),
                       triton_graph_ms=round(ms, 3), triton_graph_x_floor=round(ms / floor_ms, 3))
            del graphs


def with_triton_projections(model: LlamaModel) -> LlamaModel:
    """The same weights, every projection through ``triton_linear`` (up to 16 rows)."""
    def swap(p: Any) -> triton_linear.TritonLinear:
        return triton_linear.TritonLinear.of(p.weight, p.bias)

    other = copy.copy(model)
    other.layers = [dataclasses.replace(layer, qkv=swap(layer.qkv), o=swap(layer.o),
                                        gate_up=swap(layer.gate_up), down=swap(layer.down))
                    for layer in model.layers]
    other.head = swap(model.head)
    return other


def profile_decode(plan: Plan, report: Report, model: LlamaModel, out: Path) -> None:
    """Where a batch-1 decode step's device time goes: torch.profiler's kernel table of three
    steps, eager and through a CUDA graph (written to ``out``/profile_*.txt; the top kernels
    reported)."""
    from torch.profiler import ProfilerActivity, profile

    context = min(plan.contexts)
    cache = random_cache(plan, -(-(context + 1) // plan.block_size))
    inputs = uniform_step(plan, [(1, context + 1)], 1)
    graphs = DecodeGraphs(model, cache, plan.block_size, 1, context + 1, plan.device,
                          capture=_capture(plan))
    table = [list(range(-(-(context + 1) // plan.block_size)))]
    runs = {"eager": forward(model, inputs, cache),
            "graph": functools.partial(graphs.run, [5], [context + 1], table)}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.device == "cuda"
                                           else [])
    for label, fn in runs.items():
        for _ in range(2):
            fn()
        with profile(activities=activities) as prof:
            for _ in range(3):
                fn()
            if plan.device == "cuda":
                torch.cuda.synchronize()
        averages = prof.key_averages()
        key = "device_time_total" if plan.device == "cuda" else "cpu_time_total"
        text = averages.table(sort_by=key, row_limit=40)
        (out / f"profile_{label}.txt").write_text(text)
        kernels = [e for e in averages if str(getattr(e, "device_type", "")).endswith("CUDA")]
        kernels = kernels or list(averages)  # on a CPU: the ops
        top = sorted(kernels, key=lambda e: -getattr(e, key))[:12]
        report.add("profile", run=label, steps=3,
                   kernel_us_per_step=round(sum(getattr(e, key) for e in kernels) / 3, 1),
                   launches_per_step=round(sum(e.count for e in kernels) / 3, 1),
                   top=[{"name": e.key[:60], "calls": e.count, "us": round(getattr(e, key), 1)}
                        for e in top])


# -- verdicts ----------------------------------------------------------------------------------

def verdicts(plan: Plan, report: Report) -> bool:
    """One line per target; True when every one is met."""
    lines: list[tuple[str, bool]] = []
    checks = [r for r in report.rows if r["section"] in ("kernels", "sampler", "recompiles",
                                                         "agreement", "projections") and "ok" in r]
    failed = [r for r in checks if not r["ok"]]
    lines.append((f"numerics: {len(checks) - len(failed)} of {len(checks)} checks ok"
                  + (f" (failed: {[r.get('case', r['section']) for r in failed]})"
                     if failed else ""), not failed))
    for row in report.section("decode"):
        if row["batch"] in (1, max(plan.batches)):
            x = row["triton_graph_x_floor"]
            lines.append((f"decode batch {row['batch']} context {row['context']}: {x}x the HBM "
                          f"floor with CUDA graphs ({row['triton_graph_ms']} ms, floor "
                          f"{row['floor_ms']} ms, the projections alone "
                          f"{row['projections_graph_ms']} ms; target <= {DECODE_TARGET}x)",
                          x <= DECODE_TARGET))
    for row in report.section("prefill"):
        x = row["paged_vs_sdpa_speed"]
        lines.append((f"prefill {row['prompt_tokens']} tokens: attention at {x}x SDPA flash's "
                      f"speed ({row['paged_attention_ms']} vs {row['sdpa_flash_ms']} ms; "
                      f"target >= {PREFILL_TARGET}x)", x >= PREFILL_TARGET))
    for text, met in lines:
        report.add("verdict", met=met, text=text)
    for text, met in lines:
        print(f"VERDICT {'MET ' if met else 'MISSED'} {text}", flush=True)
    return all(met for _, met in lines)


SECTIONS = ("kernels", "sampler", "sweep", "recompiles", "decode", "prefill", "agreement",
            "projections", "profile")
OPTIONAL = ("sweep", "projections", "profile")  # tile sweeps and the profiler's tables


def run(plan: Plan, report: Report, sections: set[str], out: Path) -> bool:
    """The sections asked for, then the verdicts; True when every numeric check passed (the
    timings are figures: the verdicts say which targets were met)."""
    import triton

    report.add("info", torch=torch.__version__, triton=triton.__version__, device=plan.device,
               name=torch.cuda.get_device_name() if plan.device == "cuda" else "cpu",
               model=plan.config.model_id, layers=plan.config.num_layers, dtype=str(plan.dtype))
    if "kernels" in sections:
        check_kernels(plan, report)
    if "sampler" in sections:
        check_sampler(plan, report)
    bandwidth = copy_bandwidth(plan)
    report.add("bandwidth", copy_gb_s=round(bandwidth / 1e9, 1))
    if "sweep" in sections:
        sweep(plan, report)
    model = random_model(plan, "triton")
    if "recompiles" in sections:
        check_recompiles(plan, report, model)
    if "decode" in sections:
        decode_timings(plan, report, model, bandwidth)
    if "prefill" in sections:
        prefill_timings(plan, report, model)
    if "projections" in sections:
        check_projections(plan, report, model)
    if "profile" in sections:
        profile_decode(plan, report, model, out)
    if "agreement" in sections:  # last: a device fault there leaves every figure above
        check_agreement(plan, report, model)
    verdicts(plan, report)
    return all(r["ok"] for r in report.rows if "ok" in r)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="a toy model on the CPU (needs TRITON_INTERPRET=1): the script's own test")
    p.add_argument("--sections", nargs="+", choices=SECTIONS,
                   default=[x for x in SECTIONS if x not in OPTIONAL],
                   help="what to run (default: all but sweep, projections and profile)")
    p.add_argument("--layers", type=int, default=None,
                   help="the model's layers (default: all 32; fewer for a quick look)")
    p.add_argument("--out", type=Path, default=Path("results/gpu_check"),
                   help="folder for gpu_check.jsonl (appended to)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--tiny runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA device here (use --tiny with TRITON_INTERPRET=1 on a CPU)")
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.jsonl"
    with path.open("a") as file, torch.inference_mode():
        plan = make_plan(args.tiny)
        if args.layers is not None:
            plan = dataclasses.replace(plan, config=dataclasses.replace(
                plan.config, num_layers=args.layers))
        ok = run(plan, Report(file), set(args.sections), args.out)
    print(json.dumps({"ok": ok, "out": str(path)}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
