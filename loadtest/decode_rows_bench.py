"""Decode step time with the torch backend's decode rows against gathering every step.

    python -m tandem.loadtest.decode_rows_bench [--dtype bfloat16] [--batches 1 8 32]
        [--contexts 250 1000] [--rounds 8]

For each batch size and context length, two engines on the same weights hold the same
decoding batch, one reading its K/V from rows kept between steps (the default), one gathering
the blocks every step (``runner.decode_rows = None``). Their steps are timed in alternating
rounds of 5 (this machine's speed drifts over minutes), and the medians and their ratio are
printed. One torch thread, as a worker runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel, load_model
from tandem.services.protocol.request import GenerationRequest, SamplingParams

STEPS_PER_ROUND = 5


def decoding_engine(loaded: LoadedModel, dtype: str, batch: int, context: int,
                    rows: bool) -> LLMEngine:
    """An engine whose ``batch`` sequences have prefilled ``context`` tokens and decode."""
    blocks = batch * -(-(context + 400) // 16)
    engine = LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=batch, num_kv_blocks=blocks,
                                    enable_prefix_caching=False), loaded)
    if not rows:
        engine.runner.decode_rows = None
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [100 + (i + j) % 1000 for j in range(context)]
        engine.add_request(GenerationRequest(f"r{i}", prompt, params))
    while engine.scheduler.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode step fills the rows
    return engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[250, 1000])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    loaded = load_model(dtype=args.dtype, progress=False)
    print("| batch | context | rows ms/step | gather ms/step | rows / gather |")
    print("|---|---|---|---|---|")
    for context in args.contexts:
        for batch in args.batches:
            engines = {rows: decoding_engine(loaded, args.dtype, batch, context, rows)
                       for rows in (True, False)}
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for rows, engine in engines.items():
                    began = time.perf_counter()
                    for _ in range(STEPS_PER_ROUND):
                        engine.step()
                    times[rows].append((time.perf_counter() - began) / STEPS_PER_ROUND * 1e3)
            with_rows, gathering = (statistics.median(times[r]) for r in (True, False))
            print(f"| {batch} | {context} | {with_rows:.1f} | {gathering:.1f} | "
                  f"{with_rows / gathering:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
