"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import sys
import time


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a .gguf file or a Hugging Face directory (default: built-in "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="per-step token budget (the prefill chunk size)")


def _generate(args: argparse.Namespace) -> int:
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                    block_size=args.block_size,
                                    max_num_batched_tokens=args.max_num_batched_tokens))
    tok = engine.tokenizer
    prompt = (tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
              else tok.encode(args.prompt))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    engine.add_request("cli", prompt, params)
    start, emitted = time.perf_counter(), []
    printed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            emitted.extend(out.new_token_ids)
            text = tok.decode(emitted)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    elapsed = time.perf_counter() - start
    print(f"\n[{len(prompt)} prompt tokens, {len(emitted)} generated in {elapsed:.2f}s]",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt with an in-process engine")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    _add_engine_args(gen)
    gen.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
