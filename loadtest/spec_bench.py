"""Speculative decoding benchmark: decode speed with and without each proposer, same run.

    python -m tandem.loadtest.spec_bench [--methods none ngram self draft] [--batches 1 16 32]
        [--workloads repetitive chat] [--output-len 128] [--threads 2] [--out DIR]

Workloads: ``repetitive`` (repeat or lightly edit a passage given in the prompt, continue code
whose earlier part is in the prompt: output copies from the context) and ``chat`` (open-ended
questions). Every configuration runs the same greedy requests (outputs are identical by
construction; the run checks it). At each batch size the requests run in waves of that many.
Reports decode tokens/s (output tokens after the first, over the time after the first token),
TPOT, the acceptance rate and mean accepted tokens per verification, and the ratio to plain
decoding (``none``) measured in the same run (with ``--rounds``, each configuration runs that
many times in rotating order, and the ratio is the median of per-round ratios). ``adaptive``
(default on) is the load-adaptive policy; ``--fixed-k`` also runs each proposer with a fixed k,
to show what adapting saves.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.services.engine.config import EngineConfig, SpeculativeConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel, load_model
from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.protocol.request import GenerationRequest, SamplingParams

_SOURCE_MODULES = ["argparse", "csv", "json", "shlex", "string", "textwrap"]


def _passages() -> list[str]:
    """Deterministic text that ships with Python: the start of a few stdlib modules."""
    return [inspect.getsource(importlib.import_module(m))[:1200] for m in _SOURCE_MODULES]


def repetitive_prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    passages = _passages()
    docs = [p.split('"""')[1].strip()[:600] if p.count('"""') >= 2 else p[:600]
            for p in passages]
    asks = [
        lambda i: tok.encode_chat([{"role": "user", "content": "Repeat this text exactly:\n\n"
                                    + docs[i % len(docs)]}]),
        lambda i: tok.encode_chat([{"role": "user", "content":
                                    "Rename the variable `s` to `text` in this code and give "
                                    "the whole code back:\n\n" + passages[i % len(passages)]}]),
        lambda i: tok.encode(passages[i % len(passages)]
                             + "\n\n# The same code again, unchanged:\n\n"
                             + passages[i % len(passages)][:200]),
    ]
    return [asks[i % len(asks)](i) for i in range(n)]


def chat_prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    topics = ["a lighthouse keeper", "the history of tea", "how rainbows form",
              "a robot learning to paint", "why the sky is blue", "a day on Mars",
              "the life of a honeybee", "how bridges stay up"]
    return [tok.encode_chat([{"role": "user", "content": f"Tell me about {topics[i % 8]}."
                              + " Be detailed." * (i // 8)}]) for i in range(n)]


WORKLOADS = {"repetitive": repetitive_prompts, "chat": chat_prompts}


@dataclass
class Result:
    workload: str
    batch: int
    method: str
    adaptive: bool
    decode_tok_s: float
    tpot_ms: float
    acceptance: float | None
    mean_accepted: float | None  # accepted draft tokens per verification
    outputs: list[list[int]]


def run(loaded: LoadedModel, prompts: list[list[int]], batch: int, method: str, k: int,
        adaptive: bool, output_len: int, draft: LoadedModel | None) -> Result:
    spec = SpeculativeConfig(method=method, k=k, adaptive=adaptive)
    engine = LLMEngine(EngineConfig(max_num_seqs=batch, num_kv_blocks=4096,
                                    max_num_batched_tokens=2048, enable_prefix_caching=False,
                                    speculative=spec), loaded,
                       draft=draft if method == "draft" else None)
    params = SamplingParams(max_tokens=output_len, temperature=0.0)
    engine.generate([prompts[0][:32]], SamplingParams(max_tokens=4, temperature=0.0))  # warm
    before = engine.stats
    outputs: list[list[int]] = []
    decode_tokens, decode_seconds, tpots = 0, 0.0, []
    for wave in range(0, len(prompts), batch):
        ids = [f"w{wave}-{i}" for i in range(len(prompts[wave:wave + batch]))]
        for request_id, prompt in zip(ids, prompts[wave:wave + batch], strict=True):
            engine.add_request(GenerationRequest(request_id, prompt, params))
        got: dict[str, list[int]] = {i: [] for i in ids}
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                got[out.request_id].extend(out.new_token_ids)
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
        wave_start = min(first.values())
        decode_seconds += max(last.values()) - wave_start
        for i in ids:
            outputs.append(got[i])
            decode_tokens += len(got[i]) - 1
            if len(got[i]) > 1:
                tpots.append((last[i] - first[i]) / (len(got[i]) - 1))
    stats = engine.stats
    drafts = stats.spec_draft_tokens - before.spec_draft_tokens
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    steps = stats.spec_steps - before.spec_steps
    return Result("", batch, method, adaptive, decode_tokens / decode_seconds,
                  1000 * statistics.mean(tpots), accepted / drafts if drafts else None,
                  accepted / steps if steps else None, outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["none", "ngram", "self"],
                        choices=["none", "ngram", "self", "draft"])
    parser.add_argument("--draft-model", default=None,
                        help="for --methods draft (default: the built-in model itself, an "
                             "upper bound on acceptance at the full cost of a second model)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 32])
    parser.add_argument("--requests-per-batch", type=int, default=None,
                        help="requests per configuration (default: max(4, batch))")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--fixed-k", action="store_true",
                        help="also run every proposer with the adaptive policy off")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, in rotating order; "
                             "the ratio is the median of per-round ratios (the box is noisy)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(progress=False)
    draft = load_model(args.draft_model, progress=False) if "draft" in args.methods else None
    variants = [(m, True) for m in args.methods]
    if args.fixed_k:
        variants += [(m, False) for m in args.methods if m != "none"]

    results: list[Result] = []
    print(f"threads={args.threads} k={args.k} output_len={args.output_len}\n")
    print("| workload | batch | method | decode tok/s | vs none | TPOT ms | acceptance "
          "| accepted/step |")
    print("|---|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        for batch in args.batches:
            n = args.requests_per_batch or max(4, batch)
            prompts = WORKLOADS[workload](loaded.tokenizer, n)
            runs: dict[tuple[str, bool], list[Result]] = {v: [] for v in variants}
            for round_index in range(args.rounds):
                shift = round_index % len(variants)
                for method, adaptive in variants[shift:] + variants[:shift]:
                    r = run(loaded, prompts, batch, method, args.k, adaptive, args.output_len,
                            draft)
                    r.workload = workload
                    runs[method, adaptive].append(r)
                    results.append(r)
            baseline = runs.get(("none", True))
            for (method, adaptive), rs in runs.items():
                if baseline:
                    assert all(r.outputs == baseline[0].outputs for r in rs), (
                        f"{method} changed the output")
                ratios = [r.decode_tok_s / b.decode_tok_s for r, b in zip(rs, baseline or [],
                                                                            strict=False)]
                ratio = statistics.median(ratios) if ratios else float("nan")
                label = method + ("" if adaptive or method == "none" else " (fixed k)")
                accs = [r.acceptance for r in rs if r.acceptance is not None]
                steps = [r.mean_accepted for r in rs if r.mean_accepted is not None]
                acc = f"{statistics.mean(accs):.2f}" if accs else "-"
                per_step = f"{statistics.mean(steps):.2f}" if steps else "-"
                tok_s = statistics.median(r.decode_tok_s for r in rs)
                tpot = statistics.median(r.tpot_ms for r in rs)
                spread = (f" ({min(ratios):.2f}-{max(ratios):.2f})"
                          if len(ratios) > 1 else "")
                print(f"| {workload} | {batch} | {label} | {tok_s:.1f} | {ratio:.2f}x{spread} "
                      f"| {tpot:.1f} | {acc} | {per_step} |", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in results]
        (args.out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
