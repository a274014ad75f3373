"""Tensor parallelism: decode step time with two ranks against one, and the staging scatter.

    python -m tandem.loadtest.tp_bench [--batches 1 32] [--runs 5] [--steps 16] [--dtype float32]

Two engines on the same weights, one with ``tensor_parallel_size`` 2 (``--threads`` torch
threads per rank, so 2 ranks x 1 thread use two cores, against 1 rank x 1 thread). Each run
admits a batch of short prompts, prefills them, then times ``--steps`` decode steps (every
sequence one token); runs alternate between the engines, and the medians of the runs' median
step times are reported with their ratio. Then the scatter an import commit does on a
two-rank decode worker (canonical staging blocks -> both ranks' heads): ``--scatter-blocks``
blocks, timed ``--runs`` times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import load_model
from tandem.services.handoff.staging import TransferArea
from tandem.services.protocol.request import GenerationRequest, SamplingParams

PROMPT_TOKENS = 32


def decode_step_s(engine: LLMEngine, batch: int, steps: int, run: int) -> float:
    """The median time of ``steps`` decode steps of ``batch`` sequences."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [(run * 7919 + i * 104729 + t * 31) % vocab for t in range(PROMPT_TOKENS)]
        engine.add_request(GenerationRequest(f"{run}-{i}", prompt, params))
    engine.step()  # every prompt in one step (batch x 32 tokens within the chunk)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    while engine.has_unfinished_requests():
        engine.step()
    engine.take_events()
    return statistics.median(times)


def scatter_s(engine: LLMEngine, area: TransferArea, num_blocks: int) -> float:
    assert engine.tp is not None
    began = time.perf_counter()
    engine.tp.scatter(area.cache, list(range(num_blocks)), engine.kv_cache,
                      list(range(num_blocks)))
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--scatter-blocks", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, args.dtype, progress=False)
    common = {"dtype": args.dtype, "num_kv_blocks": 1024, "num_threads": args.threads,
              "max_num_batched_tokens": 2048, "max_num_seqs": max(args.batches)}
    engines = {tp: LLMEngine(EngineConfig(**common, tensor_parallel_size=tp), loaded)
               for tp in (1, 2)}
    try:
        for batch in args.batches:
            found: dict[int, list[float]] = {1: [], 2: []}
            for run in range(args.runs):
                for tp, engine in engines.items():
                    found[tp].append(decode_step_s(engine, batch, args.steps, run))
            one, two = (statistics.median(found[tp]) * 1e3 for tp in (1, 2))
            print(f"batch {batch:3d}: decode step {one:7.2f} ms on 1 rank, {two:7.2f} ms on 2 "
                  f"ranks: {one / two:.2f}x (medians of {args.runs} runs of {args.steps} "
                  f"steps; runs {[round(t * 1e3, 1) for t in found[1]]} / "
                  f"{[round(t * 1e3, 1) for t in found[2]]})")
        two_ranks = engines[2]
        area = TransferArea(two_ranks)
        n = min(args.scatter_blocks, area.num_staging)
        block_bytes = two_ranks.kv_spec.bytes_per_block
        times = [scatter_s(two_ranks, area, n) for _ in range(args.runs)]
        median = statistics.median(times)
        print(f"scatter of {n} staging blocks ({n * block_bytes / 2**20:.1f} MiB, canonical): "
              f"{median * 1e3:.2f} ms median ({median * 1e3 / n:.3f} ms a block, "
              f"{n * block_bytes / median / 2**30:.2f} GiB/s); runs "
              f"{[round(t * 1e3, 2) for t in times]}")
    finally:
        engines[2].close()


if __name__ == "__main__":
    main()
