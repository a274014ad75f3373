"""Host-memory KV tier: time to first token of a revisited prefix, restored from host memory
against recomputed.

    python -m tandem.loadtest.host_kv_bench [--prefix 2048] [--runs 5] [--dtype bfloat16] ...

Two engines with the same small device KV cache (``--device-blocks``), one with a host pool.
Each run sends the ``--prefix``-token prompt (cached), then a filler prompt of as many tokens
that evicts it from the device, then the prompt again, and times that last request's first
token: the pool engine copies the prompt's blocks back from host memory, the other recomputes
them. Runs alternate between the engines; medians are reported (and the host-tier counters).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel, load_model
from tandem.services.protocol.request import GenerationRequest, SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def time_to_first_token(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    began = time.perf_counter()
    engine.add_request(GenerationRequest(request_id, prompt, FIRST_TOKEN))
    while not any(out.new_token_ids for out in engine.step()):
        pass
    elapsed = time.perf_counter() - began
    while engine.has_unfinished_requests():
        engine.step()
    engine.take_events()
    return elapsed


def make(loaded: LoadedModel, args: argparse.Namespace, host_kv_cache_gb: float) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype=args.dtype, num_kv_blocks=args.device_blocks,
                                  host_kv_cache_gb=host_kv_cache_gb,
                                  max_num_batched_tokens=args.chunk, device=args.device),
                     loaded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=".gguf or HF dir (default: built-in)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefix", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--device-blocks", type=int, default=130,
                        help="device KV blocks (block 16): the filler evicts all of the prompt")
    parser.add_argument("--host-gb", type=float, default=1.0)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.dtype, progress=False)
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    engines = {"host": make(loaded, args, args.host_gb), "recompute": make(loaded, args, 0.0)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for run in range(args.runs):
        prompt = [rng.randrange(vocab) for _ in range(args.prefix)]
        filler = [rng.randrange(vocab) for _ in range(args.prefix)]
        for name, engine in engines.items():  # alternating, so drift hits both alike
            time_to_first_token(engine, f"{run}-first", prompt)
            time_to_first_token(engine, f"{run}-filler", filler)
            hits = engine.stats.prefix_cache_hits
            times[name].append(time_to_first_token(engine, f"{run}-again", prompt))
            print(f"run {run} {name:9s}: TTFT {times[name][-1] * 1e3:8.1f} ms, "
                  f"{engine.stats.prefix_cache_hits - hits} prompt tokens hit", flush=True)
    stats = engines["host"].stats
    print(f"\n{loaded.config.model_id}, {args.dtype} on {args.device}, {args.threads} threads, "
          f"{args.prefix}-token prompt revisited, median of {args.runs} runs:")
    for name, values in times.items():
        print(f"  {name:9s}: TTFT {statistics.median(values) * 1e3:8.1f} ms")
    print(f"  host tier: {stats.host_kv_restored_blocks} blocks restored, "
          f"{stats.host_kv_offloaded_blocks} offloaded, {stats.host_kv_blocks}/"
          f"{stats.host_kv_capacity_blocks} held")


if __name__ == "__main__":
    main()
