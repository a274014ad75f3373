"""int8 KV cache against the model's dtype: capacity and decode speed on this machine.

    python -m tandem.loadtest.kv_int8_bench [--memory-gb 1 16] [--context 2048] [--batch 8] ...

Capacity: KV blocks in ``kv_cache_memory_gb`` as the engine sizes them (``KVCacheSpec``), and
the sequences of ``--context`` tokens that fit at once. Decode: the median ``engine.step()``
time in steady decode of ``--batch`` sequences at ``--decode-context`` tokens, as output
tokens/s (``engine_bench.bench_decode_step``), for each KV dtype.
"""

from __future__ import annotations

import argparse

import torch

from tandem.loadtest.engine_bench import StepTiming, bench_decode_step
from tandem.services.engine.config import KV_CACHE_DTYPES
from tandem.services.engine.kv_cache import KVCacheSpec
from tandem.services.engine.model_loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=".gguf or HF dir (default: built-in)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--memory-gb", type=float, nargs="+", default=[1.0, 16.0])
    parser.add_argument("--context", type=int, default=2048, help="capacity: tokens/sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.dtype, progress=False)
    blocks_per_seq = -(-args.context // args.block_size)

    print(f"capacity ({loaded.config.model_id}, dtype {args.dtype}, block {args.block_size}, "
          f"{args.context}-token sequences)")
    print("kv_cache_memory_gb | kv_cache_dtype | bytes/block | blocks | sequences at once")
    for memory_gb in args.memory_gb:
        for kv_dtype in KV_CACHE_DTYPES:
            spec = KVCacheSpec.for_model(loaded.config, args.block_size, args.dtype, None,
                                         memory_gb, kv_dtype)
            print(f"{memory_gb:18g} | {kv_dtype:14s} | {spec.bytes_per_block:11d} | "
                  f"{spec.num_blocks:6d} | {spec.num_blocks // blocks_per_seq}")

    # Runs alternate between the dtypes and the fastest run of each is kept: on a shared
    # machine a neighbour's load only ever slows a run down.
    best: dict[str, StepTiming] = {}
    for _ in range(args.repeats):
        for kv_dtype in KV_CACHE_DTYPES:
            timing = bench_decode_step(loaded, args.dtype, args.batch, args.decode_context,
                                       args.steps, kv_dtype)
            if kv_dtype not in best or timing.step_ms < best[kv_dtype].step_ms:
                best[kv_dtype] = timing
    print(f"\ndecode: batch {args.batch}, context {args.decode_context}, {args.threads} threads, "
          f"best of {args.repeats} runs (median step of {args.steps} each)")
    print("kv_cache_dtype | step ms | forward ms | output tokens/s")
    for kv_dtype, timing in best.items():
        print(f"{kv_dtype:14s} | {timing.step_ms:7.1f} | {timing.forward_ms:10.1f} | "
              f"{1000 * args.batch / timing.step_ms:.1f}")


if __name__ == "__main__":
    main()
