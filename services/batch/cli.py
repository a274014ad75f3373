"""``tandem batch``: an OpenAI batch file through an in-process engine or a running cluster.

See docs/api.md, "Offline batches".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from tqdm import tqdm

from tandem.services.batch import batch_file, runner
from tandem.services.cli import _add_client_args, _add_engine_args

if TYPE_CHECKING:  # torch is imported only for an in-process engine
    from tandem.services.engine.async_engine import AsyncEngine

# Requests in flight against --base-url: a default cluster's admission bound (one decode batch
# of max_num_seqs); beyond it the gateway answers 429, which is retried.
DEFAULT_REMOTE_CONCURRENCY = 32
# In-process: twice the engine's batch, so a finished sequence's place is taken at the next step.
LOCAL_CONCURRENCY_PER_SEQ = 2
CONNECT_TIMEOUT_S = 10.0
# The longest wait for a running cluster's answer to one request (above the gateway's own
# request deadline, 600 s by default, which ends a request that runs too long with a clear
# status): a server that hung is not waited on forever; the request is tried again.
DEFAULT_TIMEOUT_S = 660.0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``batch`` to the CLI's subcommands; its handler is ``args.func``."""
    parser = sub.add_parser(
        "batch", help="run an OpenAI batch file (JSONL) at full throughput, resumable",
        description="Answer every request of an OpenAI batch input file and append one output "
                    "line per request as it finishes; run again to resume. See "
                    "docs/api.md, \"Offline batches\".")
    parser.add_argument("--input", required=True, type=Path, metavar="JSONL",
                        help="requests: {custom_id, method, url, body} per line")
    parser.add_argument("--output", required=True, type=Path, metavar="JSONL",
                        help="results, one line per request in the order they finish; lines "
                             "already there are kept and their requests not sent again")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--restart", action="store_true",
                       help="empty the output first and answer every request")
    again.add_argument("--retry-failed", action="store_true",
                       help="send again the requests whose line records an error (no answer "
                            "after the retries: a 5xx, a timeout, a lost connection); the new "
                            "line, appended, is the request's result")
    parser.add_argument("--concurrency", type=int, default=None, metavar="N",
                        help=f"requests in flight (default: {LOCAL_CONCURRENCY_PER_SEQ} x "
                             f"--max-num-seqs in-process, {DEFAULT_REMOTE_CONCURRENCY} with "
                             f"--base-url)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (the model's loading, the requests')")
    parser.add_argument("--base-url", default=None, metavar="URL",
                        help="a running server's HTTP URL (default: an engine in this process)")
    _add_client_args(parser, "--base-url with API keys")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"with --base-url: the longest wait for one answer, in seconds "
                             f"({DEFAULT_TIMEOUT_S:g}); then the request is tried again")
    _add_engine_args(parser)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="in-process engine's device (cpu)")
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="in-process engine's running batch size (32)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Exit 0 once every request has its output line and none failed in this run; 1 if some
    failed (their lines are written: a 4xx is not sent again on resume, an error only with
    --retry-failed) or the server went away (run it again to go on); 2 for a bad input or
    output file, an output another run holds, or a server that does not answer or refuses
    the key (before any request); 130 when interrupted (run it again to go on)."""
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout:g}")
    requests = batch_file.read_requests(args.input)
    if args.base_url is not None:
        asyncio.run(runner.check_server(_remote_client(args)))
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(batch_file.Output(args.output))  # locked until the end
        answered: set[str] = set()
        errors: set[str] = set()
        if args.restart:
            out.empty()
        else:
            answered, errors = batch_file.read_done(args.output,
                                                    {r.custom_id for r in requests})
        done = answered if args.retry_failed else answered | errors
        todo = runner.in_prefix_order(requests, done)
        if not todo:  # nothing to send: no engine to load
            print(f"tandem batch: all {len(requests)} requests already answered in "
                  f"{args.output}" + (f" ({len(errors)} with an error line: --retry-failed "
                                      f"sends them again)" if errors else ""), file=sys.stderr)
            return 0
        engine: AsyncEngine | None = None
        if args.base_url is None:
            engine = _local_engine(args)
            stack.callback(engine.shutdown)
            client = _local_client(engine)
            concurrency = args.concurrency or LOCAL_CONCURRENCY_PER_SEQ * args.max_num_seqs
        else:
            client = _remote_client(args)
            concurrency = args.concurrency or DEFAULT_REMOTE_CONCURRENCY
        progress = stack.enter_context(tqdm(total=len(requests), initial=len(done), unit="req",
                                            desc="batch", file=sys.stderr,
                                            disable=args.no_progress))

        async def answer_all() -> runner.Summary:
            try:
                async with client:
                    return await runner.run(todo, client, out.write, concurrency, progress)
            finally:  # interrupted too: the engine's last callbacks still find this loop open
                if engine is not None:
                    engine.shutdown()

        try:
            summary = asyncio.run(answer_all())
        except KeyboardInterrupt:
            progress.close()
            print(f"tandem batch: interrupted; the answered requests are in {args.output}: "
                  f"run the same command again to go on", file=sys.stderr)
            return 130
        except runner.ServerGone as exc:
            progress.close()
            print(f"tandem batch: stopped, the server is gone: {exc}; the answered requests "
                  f"are in {args.output}: run the same command again to go on (with "
                  f"--retry-failed, those that got no answer are sent again too)",
                  file=sys.stderr)
            return 1
    retry = (f"; --retry-failed sends the {summary.errors} without an answer again"
             if summary.errors else "")
    print(f"tandem batch: {summary.line()}; {len(done)} answered before{retry}", file=sys.stderr)
    return 1 if summary.failed else 0


def _remote_client(args: argparse.Namespace) -> httpx.AsyncClient:
    from tandem.services.serving.up_stats import bearer, ca_context

    return httpx.AsyncClient(base_url=args.base_url.rstrip("/").removesuffix("/v1"),
                             headers=bearer(args.api_key or None),
                             verify=ca_context(args.cacert) or True,
                             timeout=httpx.Timeout(args.timeout, connect=CONNECT_TIMEOUT_S))


def _local_engine(args: argparse.Namespace) -> AsyncEngine:
    """The in-process engine, as `tandem generate` builds it, running."""
    from tandem.services.engine.async_engine import AsyncEngine
    from tandem.services.engine.config import EngineConfig, SpeculativeConfig
    from tandem.services.engine.llm_engine import LLMEngine
    from tandem.services.engine.model_loader import load_model

    spec = SpeculativeConfig(method=args.spec, k=args.spec_k, draft_model=args.draft_model)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    num_threads=args.threads, block_size=args.block_size,
                                    max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    speculative=spec),
                       load_model(args.model, args.dtype, progress=not args.no_progress))
    return AsyncEngine(engine)


def _local_client(engine: AsyncEngine) -> httpx.AsyncClient:
    """An HTTP client of the gateway's own ASGI app over the engine: the colocated
    `tandem up` gateway with no server around it."""
    from tandem.services.engine.tokenizer_loader import load_model_metadata
    from tandem.services.gateway import EngineBackend, Gateway, GatewayConfig, create_http_app

    llm = engine.llm
    meta = load_model_metadata(llm.config.model)  # the request defaults the online gateway uses
    gateway = Gateway(EngineBackend(engine), llm.tokenizer,
                      GatewayConfig(sampling_defaults=meta.sampling_defaults))
    # A 500 is an answer to record, not an exception to raise in the client.
    transport = httpx.ASGITransport(app=create_http_app(gateway), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://tandem-batch", timeout=None)
