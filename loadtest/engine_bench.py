"""Offline engine benchmark: Tandem's engine against transformers' batched generate, same run.

    python -m tandem.loadtest.engine_bench [--dtypes float32 bfloat16] [--num-requests 64]
        [--attention-backends torch cpu] ...

Reports output tokens/s for both and their ratio, decode step time at batch 1 and 32 against the
model forward alone (engine overhead), and prefill tokens/s for a 1,000-token prompt.

    python -m tandem.loadtest.engine_bench --weight-formats dense int4 [--batches 1 8 32] \
        [--rounds 5]

instead compares weight formats (bfloat16, the built-in model loaded once with int4, so dense
runs the very same weights, dequantized from the packs): decode tok/s per batch size, rounds
interleaved, medians, and each step's time in the head (lm_head) against the whole forward.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from tandem.loadtest import results
from tandem.services.engine.config import ATTENTION_BACKENDS, WEIGHT_FORMATS, EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel, load_model
from tandem.services.protocol.request import GenerationRequest, SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    output_len: int


def make_workload(num_requests: int, input_len: int, output_len: int, vocab: int,
                  seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(input_len * 9 // 10,
                                                                       input_len * 11 // 10))]
               for _ in range(num_requests)]
    return Workload(prompts, output_len)


def bench_engine(loaded: LoadedModel, dtype: str, work: Workload, max_batch: int,
                 attention_backend: str = "auto", kernel_threads: int = 1) -> float:
    engine = LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=max_batch,
                                    max_num_batched_tokens=512, num_kv_blocks=2048,
                                    enable_prefix_caching=False,
                                    attention_backend=attention_backend,
                                    kernel_threads=kernel_threads), loaded)
    params = SamplingParams(max_tokens=work.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(work.prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(work.prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o) == work.output_len for o in outputs)
    return sum(len(o) for o in outputs) / elapsed


def bench_transformers(loaded: LoadedModel, dtype: str, work: Workload, max_batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(loaded.source.parent), gguf_file=loaded.source.name,
        dtype=torch.float32).to(getattr(torch, dtype)).eval()
    pad = loaded.config.eos_token_ids[0]

    def run(prompts: list[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(prompts)

    run(work.prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    total = sum(run(work.prompts[i:i + max_batch], work.output_len)
                for i in range(0, len(work.prompts), max_batch))
    return total / (time.perf_counter() - start)


@dataclass
class StepTiming:
    batch: int
    step_ms: float
    forward_ms: float
    head_ms: float = 0.0  # of forward_ms: the final projection to the vocabulary

    @property
    def overhead_pct(self) -> float:
        return 100.0 * (self.step_ms - self.forward_ms) / self.step_ms


def bench_decode_step(loaded: LoadedModel, dtype: str, batch: int, context: int,
                      steps: int = 20, kv_cache_dtype: str = "auto",
                      weight_format: str = "dense", attention_backend: str = "auto",
                      kernel_threads: int = 1
                      ) -> StepTiming:
    """Time engine.step() in steady decode, and the model forward (and its head) inside it."""
    engine = LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=batch, num_kv_blocks=4096,
                                    max_num_batched_tokens=max(512, batch),
                                    kv_cache_dtype=kv_cache_dtype,
                                    weight_format=weight_format,
                                    attention_backend=attention_backend,
                                    kernel_threads=kernel_threads), loaded)
    work = make_workload(batch, context, 1, loaded.config.vocab_size, seed=batch)
    params = SamplingParams(max_tokens=steps + 200, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(work.prompts):
        engine.add_request(GenerationRequest(f"d{i}", prompt, params))
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):
        engine.step()
    model = engine.runner.model
    forward_times: list[float] = []
    original = model.forward

    def timed_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        result = original(*args, **kwargs)
        forward_times.append(time.perf_counter() - t)
        return result

    head_times: list[float] = []
    head = model.head

    def timed_head(x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        result = head(x)
        head_times.append(time.perf_counter() - t)
        return result

    model.forward = timed_forward  # type: ignore[method-assign]
    model.head = timed_head  # type: ignore[assignment]
    step_times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        step_times.append(time.perf_counter() - t)
        assert len(outs) == batch
    return StepTiming(batch, 1000 * statistics.median(step_times),
                      1000 * statistics.median(forward_times),
                      1000 * statistics.median(head_times))


def bench_prefill(loaded: LoadedModel, dtype: str, prompt_len: int = 1000,
                  attention_backend: str = "auto", kernel_threads: int = 1) -> float:
    engine = LLMEngine(EngineConfig(dtype=dtype, num_kv_blocks=512, max_num_batched_tokens=512,
                                    enable_prefix_caching=False,
                                    attention_backend=attention_backend,
                                    kernel_threads=kernel_threads), loaded)
    prompt = make_workload(1, prompt_len, 1, loaded.config.vocab_size).prompts[0][:prompt_len]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([prompt[:64]], params)  # warm-up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        engine.generate([prompt], params)
        times.append(time.perf_counter() - t)
    return len(prompt) / min(times)


def compare_weight_formats(formats: list[str], batches: list[int], rounds: int,
                           context: int) -> None:
    """Decode steps per weight format and batch size, interleaved rounds, medians."""
    loaded = load_model(None, "bfloat16", progress=False, weight_format="int4")
    runs: dict[tuple[int, str], list[StepTiming]] = {}
    for round_ in range(rounds):
        for batch in batches:
            for fmt in formats if round_ % 2 == 0 else formats[::-1]:
                timing = bench_decode_step(loaded, "bfloat16", batch, context,
                                           weight_format=fmt)
                runs.setdefault((batch, fmt), []).append(timing)
                print(f"round {round_} batch {batch} {fmt}: step {timing.step_ms:.1f} ms "
                      f"(forward {timing.forward_ms:.1f}, head {timing.head_ms:.1f})",
                      flush=True)
    print(f"\n| batch | {' | '.join(f'{f} tok/s (step, fwd, head ms)' for f in formats)} "
          f"| {formats[-1]} / {formats[0]} |")
    print(f"|---|{'---|' * len(formats)}---|")
    for batch in batches:
        cells, rates = [], []
        for fmt in formats:
            timings = runs[(batch, fmt)]
            step, fwd, head = (statistics.median(getattr(t, name) for t in timings)
                               for name in ("step_ms", "forward_ms", "head_ms"))
            rates.append(1000 * batch / step)
            cells.append(f"{rates[-1]:.1f} ({step:.1f}, {fwd:.1f}, {head:.1f})")
        print(f"| {batch} | {' | '.join(cells)} | {rates[-1] / rates[0]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kernel-threads", type=int, default=1, choices=(1, 2),
                        help="threads our AMX projections split over (with --threads 1)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--attention-backends", nargs="+", default=["auto"],
                        choices=ATTENTION_BACKENDS,
                        help="a row per dtype and backend (e.g. torch cpu: SDPA against our CPU "
                             "kernels in bfloat16); a pair the engine refuses is skipped, saying "
                             "why")
    parser.add_argument("--weight-formats", nargs="+", choices=WEIGHT_FORMATS,
                        help="compare these weight formats' decode steps instead (bfloat16)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32],
                        help="--weight-formats: decode batch sizes")
    parser.add_argument("--rounds", type=int, default=3, help="--weight-formats: rounds")
    results.add_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = results.command("python -m tandem.loadtest.engine_bench", sys.argv[1:])
    if args.weight_formats:
        print(f"threads={args.threads} context~{args.input_len} rounds={args.rounds}")
        compare_weight_formats(args.weight_formats, args.batches, args.rounds, args.input_len)
        return

    print(f"threads={args.threads} kernel_threads={args.kernel_threads} "
          f"requests={args.num_requests} input~{args.input_len} output={args.output_len} "
          f"max_batch={args.max_batch}\n")
    print("| dtype | attention | Tandem tok/s | transformers tok/s | ratio "
          "| step b=1 ms (fwd, overhead) | step b=32 ms (fwd, overhead) | prefill 1k tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        loaded = load_model(None, dtype, progress=False)
        work = make_workload(args.num_requests, args.input_len, args.output_len,
                             loaded.config.vocab_size)
        theirs = (float("nan") if args.skip_transformers
                  else bench_transformers(loaded, dtype, work, args.max_batch))
        for backend in args.attention_backends:
            try:
                ours = bench_engine(loaded, dtype, work, args.max_batch, backend,
                                    args.kernel_threads)
            except ValueError as e:
                print(f"| {dtype} | {backend} | refused: {e} |||||", flush=True)
                continue
            b1 = bench_decode_step(loaded, dtype, 1, args.input_len, attention_backend=backend,
                                   kernel_threads=args.kernel_threads)
            b32 = bench_decode_step(loaded, dtype, 32, args.input_len,
                                    attention_backend=backend,
                                    kernel_threads=args.kernel_threads)
            prefill = bench_prefill(loaded, dtype, attention_backend=backend,
                                    kernel_threads=args.kernel_threads)
            print(f"| {dtype} | {backend} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x "
                  f"| {b1.step_ms:.1f} ({b1.forward_ms:.1f}, {b1.overhead_pct:.1f}%) "
                  f"| {b32.step_ms:.1f} ({b32.forward_ms:.1f}, {b32.overhead_pct:.1f}%) "
                  f"| {prefill:.0f} |", flush=True)
            if args.record:
                setting = (f"{dtype}, {backend} attention, {args.threads} torch thread(s), "
                           f"kernel_threads {args.kernel_threads}")
                results.record([results.Result(
                    f"engine alone ({setting}): output tok/s ({args.num_requests} requests, "
                    f"~{args.input_len} in, {args.output_len} out, batch <= {args.max_batch}); "
                    f"decode step at batch 1 / 32; prefill of 1,000 tokens",
                    f"{ours:.0f} tok/s; {b1.step_ms:.1f} / {b32.step_ms:.1f} ms; "
                    f"{prefill:,.0f} tok/s", command)], args.record)


if __name__ == "__main__":
    main()
