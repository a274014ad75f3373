"""What structured output costs the engine: output tokens/s with a JSON schema against without.

    python -m tandem.loadtest.structured_bench [--batches 1 32] [--rounds 3] [--dtype float32]

The same short prompts, every request exactly ``--output-len`` tokens: without a constraint
(``ignore_eos``), and held to a JSON schema whose one string field must be longer than the
output can be (so the grammar never lets it end early). Runs alternate, round by round, and the
medians and their ratio are printed: the machine's drift spreads over both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import load_model
from tandem.services.protocol.request import SamplingParams, StructuredOutput

LONG_TEXT = {"type": "object", "additionalProperties": False, "required": ["text"],
             "properties": {"text": {"type": "string", "minLength": 4000}}}


def timed(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Output tokens per second of one batch run to the end."""
    began = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - began
    tokens = sum(map(len, outputs))
    assert all(len(o) == params.max_tokens for o in outputs), "a request ended early"
    return tokens / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.loadtest.structured_bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(None, args.dtype, progress=False)
    engine = LLMEngine(EngineConfig(dtype=args.dtype, num_kv_blocks=2048,
                                    max_num_seqs=max(args.batches)), loaded)
    plain = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    schema = SamplingParams(max_tokens=args.output_len, temperature=0.0,
                            structured_output=StructuredOutput("json", json.dumps(LONG_TEXT)))
    print(f"{args.dtype}, {args.threads} thread(s), {args.output_len} tokens per request, "
          f"medians of {args.rounds} alternating rounds")
    for batch in args.batches:
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content":
                                                  f"Write story number {i} as JSON."}])
                   for i in range(batch)]
        timed(engine, prompts[:1], schema)  # builds the grammar tokenizer once, warms up
        runs: dict[str, list[float]] = {"plain": [], "json schema": []}
        for _ in range(args.rounds):
            runs["plain"].append(timed(engine, prompts, plain))
            runs["json schema"].append(timed(engine, prompts, schema))
        base, constrained = (statistics.median(runs[k]) for k in ("plain", "json schema"))
        print(f"batch {batch:>3}: plain {base:7.1f} tok/s, json schema {constrained:7.1f} tok/s"
              f" ({constrained / base:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
