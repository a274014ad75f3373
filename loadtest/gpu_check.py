"""The engine's GPU path on one device: correctness against the torch backend, then timings.

    python -m loadtest.gpu_check --out results/gpu_check         # an H200 (not yet run on one)
    TRITON_INTERPRET=1 python -m loadtest.gpu_check --tiny       # the same code on a CPU (CI)

Needs only torch and Triton (no Ray, NIXL or flash-attn; nothing downloaded): a model of
Llama-3-8B's shape with random bfloat16 weights (``--tiny``: a 2-layer toy in float32).
Sections, printed and written to ``--out``/gpu_check.json:

- ``kernels``: the triton backend's attention (store + paged kernel) against the torch
  backend's on random paged steps: decodes, speculative rows, a prefill chunk over cached
  context, a mixed step, split-KV.
- ``sampler``: the sampler's noise on the device equals the CPU's bit for bit; a seeded
  request draws the same tokens alone and in a batch of 32.
- ``decode``: one decode step's time at batch 1, 16, 64 with 1k and 8k contexts for the triton
  backend (eager, and through the engine's CUDA graphs: ``DecodeGraphs.run``, its input
  copies included) and the torch backend, against the HBM floor measured
  in the same run (the bytes a step must read, at the bandwidth of a device-to-device copy).
- ``prefill``: tokens/s of a 2k and an 8k prompt through the model with each backend, and the
  paged kernel against SDPA (flash) on contiguous tensors for one layer's attention.
- ``agreement``: greedy tokens of both backends over a few decode steps.

Targets (issue 15; benchmark figures, not tests): decode <= 1.15x the floor at batch 1 and
64; prefill >= 0.8x contiguous flash SDPA.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.engine.attention import StepMetadata, build_step_metadata, get_attention_backend
from services.engine.config import ModelConfig
from services.engine.cuda_graphs import DecodeGraphs, cuda_graph_capture, eager_capture
from services.engine.model import LlamaModel
from services.engine.sampler import exponential_noise, sample
from services.engine.sampling_params import SamplingParams

PROG = "python -m loadtest.gpu_check"
LLAMA3_8B = ModelConfig("llama-3-8b-shaped", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=16384, tie_word_embeddings=False,
                        eos_token_ids=(128001,))
TINY = ModelConfig("tiny", vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                   rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                   eos_token_ids=(2,))


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
    graphs: bool


def make_plan(tiny: bool) -> Plan:
    if tiny:
        return Plan(TINY, torch.float32, "cpu", 16, (1, 2), (32, 64), (48,), 2, 1 << 24, True)
    return Plan(LLAMA3_8B, torch.bfloat16, "cuda", 16, (1, 16, 64), (1024, 8192),
                (2048, 8192), 20, 4 << 30, True)


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
    attention = get_attention_backend(backend, plan.device, c.num_heads, c.num_kv_heads,
                                      c.head_dim)
    return LlamaModel(c, weights, attention, c.max_position_embeddings, plan.device)


def with_backend(model: LlamaModel, plan: Plan, backend: str) -> LlamaModel:
    """The same weights behind another attention backend."""
    c = plan.config
    other = LlamaModel.__new__(LlamaModel)
    other.__dict__ = dict(model.__dict__)
    other.attention = get_attention_backend(backend, plan.device, c.num_heads, c.num_kv_heads,
                                            c.head_dim)
    return other


def step_read_bytes(model: LlamaModel, kv_tokens: int, plan: Plan) -> int:
    """What a decode step must read: every weight once (the embedding only by row) and the
    KV of every cached token."""
    layers = sum(layer.weight_bytes() for layer in model.layers)
    head = model.lm_head.numel() * model.lm_head.element_size()
    c = plan.config
    kv = kv_tokens * c.num_layers * 2 * c.num_kv_heads * c.head_dim * model.embed.element_size()
    return layers + head + kv


def kv_cache(plan: Plan, num_blocks: int) -> torch.Tensor:
    c = plan.config
    return torch.zeros(num_blocks, c.num_layers, 2, plan.block_size, c.num_kv_heads, c.head_dim,
                       dtype=plan.dtype, device=plan.device)


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


def forward(model: LlamaModel, inputs: Inputs, cache: torch.Tensor
            ) -> Callable[[], torch.Tensor]:
    """One step of ``model`` on ``inputs`` (the backend's plan made once, as the runner does)."""
    plan = model.attention.prepare(inputs.step)
    return functools.partial(model, inputs.input_ids, inputs.positions, cache, plan,
                             inputs.logits_rows)


def blocks_for(plan: Plan, seqs: list[tuple[int, int]]) -> int:
    return sum(-(-n // plan.block_size) for _, n in seqs)


# -- timing ------------------------------------------------------------------------------------

def timed_ms(fn: Callable[[], Any], plan: Plan) -> float:
    """Median milliseconds of ``fn`` over ``plan.iters`` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(plan.iters):
        if plan.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
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


# -- sections ----------------------------------------------------------------------------------

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


def check_kernels(plan: Plan) -> dict[str, Any]:
    """Each case through both backends on the same random cache and q/k/v."""
    c = plan.config
    torch_backend = get_attention_backend("torch", plan.device, c.num_heads, c.num_kv_heads,
                                          c.head_dim)
    triton_backend = get_attention_backend("triton", plan.device, c.num_heads, c.num_kv_heads,
                                           c.head_dim)
    tolerance = 1e-4 if plan.dtype == torch.float32 else 3e-2
    results: dict[str, Any] = {}
    gen = torch.Generator(plan.device).manual_seed(1)
    for name, (seqs, decodes) in (TINY_KERNEL_CASES if plan.config is TINY
                                  else KERNEL_CASES).items():
        inputs = uniform_step(plan, seqs, decodes)
        cache = torch.randn(blocks_for(plan, seqs), 1, 2, plan.block_size, c.num_kv_heads,
                            c.head_dim, generator=gen, device=plan.device).to(plan.dtype)
        tokens = inputs.input_ids.numel()
        q, k, v = (torch.randn(tokens, h, c.head_dim, generator=gen, device=plan.device)
                   .to(plan.dtype) for h in (c.num_heads, c.num_kv_heads, c.num_kv_heads))
        expected_cache = cache.clone()
        expected = torch_backend.forward(0, q, k, v, expected_cache,
                                         torch_backend.prepare(inputs.step))
        got = triton_backend.forward(0, q, k, v, cache, triton_backend.prepare(inputs.step))
        error = (got.float() - expected.float()).abs().max().item()
        results[name] = {"max_abs_error": error, "cache_equal": bool(torch.equal(cache,
                                                                                 expected_cache)),
                         "ok": error <= tolerance and torch.equal(cache, expected_cache)}
    # Split-KV against one pass, on the longest decode case.
    from services.engine.attention.triton_kernels import paged_attention
    seqs = [(1, 40), (1, 64)] if plan.config is TINY else [(1, 4000), (1, 8000)]
    inputs = uniform_step(plan, seqs, len(seqs))
    cache = torch.randn(blocks_for(plan, seqs), 1, 2, plan.block_size, c.num_kv_heads,
                        c.head_dim, generator=gen, device=plan.device).to(plan.dtype)
    q = torch.randn(len(seqs), c.num_heads, c.head_dim, generator=gen,
                    device=plan.device).to(plan.dtype)
    s = inputs.step
    outs = [paged_attention(q, cache, 0, s.query_start, s.seq_lens, s.block_tables,
                            s.max_query_len, s.max_seq_len, c.head_dim ** -0.5, num_splits=n)
            for n in (1, 4)]
    error = (outs[0].float() - outs[1].float()).abs().max().item()
    results["split_kv"] = {"max_abs_error": error, "ok": error <= tolerance}
    return results


def check_sampler(plan: Plan) -> dict[str, Any]:
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
    return {"noise_equals_cpu": same_noise, "batch_equals_alone": batched == alone,
            "ok": same_noise and batched == alone}


def decode_timings(plan: Plan, model: LlamaModel, bandwidth: float) -> list[dict[str, Any]]:
    models = {"triton": model, "torch": with_backend(model, plan, "torch")}
    most = max(plan.batches) * (max(plan.contexts) + 1)
    cache = kv_cache(plan, -(-most // plan.block_size) + max(plan.batches))
    rows = []
    for batch in plan.batches:
        for context in plan.contexts:
            seqs = [(1, context + 1)] * batch
            blocks = -(-(context + 1) // plan.block_size)
            inputs = uniform_step(plan, seqs, batch)
            floor_ms = step_read_bytes(model, batch * (context + 1), plan) / bandwidth * 1e3
            row: dict[str, Any] = {"batch": batch, "context": context,
                                   "floor_ms": round(floor_ms, 3)}
            for name, m in models.items():
                run = forward(m, inputs, cache)
                row[f"{name}_ms"] = round(timed_ms(run, plan), 3)
                if name == "triton" and plan.graphs:  # the engine's own graph path
                    graphs = DecodeGraphs(m, cache, plan.block_size, batch, context + 1,
                                          plan.device, capture=(
                                              cuda_graph_capture if plan.device == "cuda"
                                              else eager_capture))  # --tiny: the bookkeeping
                    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(batch)]
                    replay = functools.partial(graphs.run, [5] * batch, [context + 1] * batch,
                                               tables)
                    row["triton_graph_ms"] = round(timed_ms(replay, plan), 3)
            for key in [k for k in row if k.endswith("_ms") and k != "floor_ms"]:
                row[key.replace("_ms", "_x_floor")] = round(row[key] / floor_ms, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def prefill_timings(plan: Plan, model: LlamaModel) -> list[dict[str, Any]]:
    models = {"triton": model, "torch": with_backend(model, plan, "torch")}
    c = plan.config
    rows = []
    for n in plan.prompts:
        cache = kv_cache(plan, -(-n // plan.block_size))
        inputs = uniform_step(plan, [(n, n)], 0)
        row: dict[str, Any] = {"prompt_tokens": n}
        for name, m in models.items():
            row[f"{name}_tokens_per_s"] = round(n / (timed_ms(forward(m, inputs, cache),
                                                              plan) / 1e3))
        # One layer's attention: the paged kernel over the cache vs SDPA on contiguous q/k/v.
        from services.engine.attention.triton_kernels import paged_attention
        gen = torch.Generator(plan.device).manual_seed(3)
        q = torch.randn(n, c.num_heads, c.head_dim, generator=gen, device=plan.device).to(
            plan.dtype)
        k, v = (torch.randn(n, c.num_kv_heads, c.head_dim, generator=gen,
                            device=plan.device).to(plan.dtype) for _ in range(2))
        s, scale = inputs.step, c.head_dim ** -0.5
        paged_ms = timed_ms(functools.partial(paged_attention, q, cache, 0, s.query_start,
                                              s.seq_lens, s.block_tables, n, n, scale), plan)
        q4, k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
        sdpa_ms = timed_ms(functools.partial(F.scaled_dot_product_attention, q4, k4, v4,
                                             is_causal=True, enable_gqa=True), plan)
        row |= {"paged_attention_ms": round(paged_ms, 3), "sdpa_contiguous_ms": round(sdpa_ms, 3),
                "paged_vs_sdpa_speed": round(sdpa_ms / paged_ms, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def greedy_agreement(plan: Plan, model: LlamaModel, steps: int = 8) -> dict[str, Any]:
    """Greedy tokens after a 64-token prompt, each backend on its own cache."""
    tokens: dict[str, list[int]] = {}
    for name in ("torch", "triton"):
        m = with_backend(model, plan, name)
        cache = kv_cache(plan, -(-(64 + steps) // plan.block_size))
        ids = [(11 * i + 5) % plan.config.vocab_size for i in range(64)]
        out: list[int] = []
        query = ids
        for _ in range(steps):
            n = len(ids) + len(out)
            inputs = uniform_step(plan, [(len(query), n)], 1 if len(query) == 1 else 0)
            inputs.input_ids = torch.tensor(query, device=plan.device)
            logits = m(inputs.input_ids, inputs.positions, cache,
                       m.attention.prepare(inputs.step), inputs.logits_rows)
            out.append(int(logits[-1].argmax()))
            query = out[-1:]
        tokens[name] = out
    equal = sum(a == b for a, b in zip(tokens["torch"], tokens["triton"], strict=True))
    return {"steps": steps, "equal": equal, "tokens": tokens}


def run(plan: Plan) -> dict[str, Any]:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "device": plan.device,
            "name": torch.cuda.get_device_name() if plan.device == "cuda" else "cpu",
            "model": plan.config.model_id, "dtype": str(plan.dtype)}
    print(json.dumps(info), flush=True)
    results: dict[str, Any] = {"info": info, "kernels": check_kernels(plan),
                               "sampler": check_sampler(plan)}
    print(json.dumps({"kernels": results["kernels"], "sampler": results["sampler"]}), flush=True)
    bandwidth = copy_bandwidth(plan)
    results["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    model = random_model(plan, "triton")
    results["agreement"] = greedy_agreement(plan, model)
    results["decode"] = decode_timings(plan, model, bandwidth)
    results["prefill"] = prefill_timings(plan, model)
    results["ok"] = (all(r["ok"] for r in results["kernels"].values())
                     and results["sampler"]["ok"])
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="a toy model on the CPU (needs TRITON_INTERPRET=1): the script's own test")
    p.add_argument("--out", type=Path, default=Path("results/gpu_check"))
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--tiny runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA device here (use --tiny with TRITON_INTERPRET=1 on a CPU)")
    torch.manual_seed(0)
    with torch.inference_mode():
        results = run(make_plan(args.tiny))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({"ok": results["ok"], "out": str(args.out / "gpu_check.json")}))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
