"""The ``tandem`` command line.

Subcommands import what they run when they run, so ``tandem up`` and ``tandem chat`` do not pay
for the benchmark's dependencies (matplotlib, ...) nor the engine's (torch).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from tandem.router.config import POLICIES as ROUTING_POLICIES
from tandem.services.engine.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    SPEC_METHODS,
    WEIGHT_FORMATS,
)
from tandem.services.extras import MissingExtra, require
from tandem.services.kv_transfer.factory import TRANSPORTS
from tandem.services.serving.config import DEVICES, DTYPES
from tandem.services.version import version

LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a .gguf file, a Hugging Face directory or a hub id "
                             "org/name[@revision] (default: built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weight-format", default="dense", choices=list(WEIGHT_FORMATS),
                        help="int4: a GGUF's Q4_1 weights kept 4-bit (CPU, --dtype bfloat16)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="per-step token budget (the prefill chunk size)")
    _add_spec_args(parser, defaults=True)


def _add_spec_args(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """--spec, --spec-k, --draft-model; without defaults (tandem up) unset flags leave the
    config file's values alone."""
    parser.add_argument("--spec", choices=list(SPEC_METHODS), default="none" if defaults
                        else argparse.SUPPRESS,
                        help="speculative decoding: ngram (prompt lookup), draft (a small "
                             "model, see --draft-model), self (the model's first layers), none")
    parser.add_argument("--spec-k", type=int, default=4 if defaults else argparse.SUPPRESS,
                        help="draft tokens per step, at most (4)")
    parser.add_argument("--draft-model", default=None if defaults else argparse.SUPPRESS,
                        help="--spec draft: a .gguf file or Hugging Face directory sharing the "
                             "model's tokenizer")


def _generate(args: argparse.Namespace) -> int:
    from tandem.services.engine.config import EngineConfig, SpeculativeConfig
    from tandem.services.engine.llm_engine import LLMEngine
    from tandem.services.protocol.request import GenerationRequest, SamplingParams

    spec = SpeculativeConfig(method=args.spec, k=args.spec_k, draft_model=args.draft_model)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                    weight_format=args.weight_format,
                                    block_size=args.block_size,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    speculative=spec))
    tok = engine.tokenizer
    prompt = (tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
              else tok.encode(args.prompt))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    engine.add_request(GenerationRequest("cli", prompt, params))
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
    stats = engine.stats
    accepted = (f", {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} draft tokens accepted"
                if stats.spec_draft_tokens else "")
    print(f"\n[{len(prompt)} prompt tokens, {len(emitted)} generated in {elapsed:.2f}s"
          f"{accepted}]", file=sys.stderr)
    return 0


# `tandem up` flag -> AppConfig field; only flags given on the command line override --config.
_UP_FLAGS = {"model": "model", "dtype": "dtype", "device": "device",
             "attention_backend": "attention_backend", "cuda_graphs": "cuda_graphs",
             "prefill": "prefill_replicas",
             "decode": "decode_replicas", "gateways": "gateway_replicas",
             "colocated": "colocated", "host": "host",
             "port": "port", "grpc_port": "grpc_port", "redis_url": "redis_url",
             "kv_transport": "kv_transport", "kv_cache_dtype": "kv_cache_dtype",
             "weight_format": "weight_format",
             "host_kv_cache_gb": "host_kv_cache_gb", "block_size": "block_size",
             "routing_policy": "routing_policy",
             "max_local_prefill_tokens": "max_local_prefill_tokens",
             "threads": "threads_per_worker", "kernel_threads": "kernel_threads",
             "prefill_threads": "prefill_threads",
             "tensor_parallel_size": "tensor_parallel_size",
             "max_num_batched_tokens": "max_num_batched_tokens",
             "spec": "spec", "spec_k": "spec_k", "draft_model": "draft_model",
             "request_timeout": "request_timeout_s", "max_in_flight": "max_in_flight",
             "client_read_timeout": "client_read_timeout_s",
             "api_keys_file": "api_keys_file", "cluster_secret_file": "cluster_secret_file",
             "metrics_require_key": "metrics_require_key",
             "tenant_requests_per_minute": "tenant_requests_per_minute",
             "tenant_tokens_per_minute": "tenant_tokens_per_minute",
             "tls_cert_file": "tls_cert_file", "tls_key_file": "tls_key_file",
             "internal_tls_cert_file": "internal_tls_cert_file",
             "internal_tls_key_file": "internal_tls_key_file",
             "internal_tls_ca_file": "internal_tls_ca_file",
             "served_model_name": "served_model_name", "max_num_seqs": "max_num_seqs",
             "cors_allow_origins": "cors_allow_origins", "reasoning_parser": "reasoning_parser",
             "tool_call_parser": "tool_call_parser",
             "max_model_len": "max_model_len", "enable_prefix_caching": "enable_prefix_caching",
             "seed": "seed", "chat_template": "chat_template",
             "gpu_memory_utilization": "gpu_memory_utilization",
             "kv_cache_memory_gb": "kv_cache_memory_gb",
             "generation_config": "generation_config", "address": "ray_address",
             "gateway_resource": "gateway_resource", "prefill_resource": "prefill_resource",
             "decode_resource": "decode_resource", "worker_host": "worker_host"}


def _add_up_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = sub.add_parser("up", help="start a local Ray Serve cluster and serve the model",
                        argument_default=argparse.SUPPRESS)
    up.add_argument("--model", help="a .gguf file, a Hugging Face directory or a hub id "
                                    "org/name[@revision] (default: "
                                    "built-in SmolLM2-135M-Instruct)")
    _add_up_arguments(up)
    # `vllm serve MODEL [flags]`'s shape: the model first, then the same flags as `up`.
    serve = sub.add_parser("serve", help="`tandem up` with the model first, as `vllm serve "
                                         "MODEL` takes it (vLLM's flag names where Tandem has "
                                         "the setting; any other flag is refused)",
                           argument_default=argparse.SUPPRESS)
    serve.add_argument("model", help="a .gguf file, a Hugging Face directory or a hub id "
                                     "org/name[@revision]")
    _add_up_arguments(serve)


def _add_up_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument("--config", help="YAML file of AppConfig settings (flags override it)")
    up.add_argument("--served-model-name", metavar="NAME", nargs="+",
                    help="the model's name in the API, or several: a request may name any, "
                         "responses carry the first (default: the model's own id)")
    up.add_argument("--reasoning-parser", metavar="PARSER",
                    help="chat replies' <think>...</think> apart as reasoning_content: auto "
                         "(default: where the model's vocabulary has the tags), think (or "
                         "vLLM's deepseek_r1, qwen3), none")
    up.add_argument("--tool-call-parser", metavar="PARSER",
                    help="how replies under tool_choice auto write tool calls: auto (default: "
                         "the chat template's format, else hermes), hermes, mistral, "
                         "llama3_json, pythonic, qwen3_coder (vLLM's llama4_json, "
                         "llama4_pythonic, qwen3_xml too)")
    up.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="accepted, as vLLM's command lines give it: tool_choice auto is always "
                         "served here")
    up.add_argument("--cors-allow-origins", metavar="ORIGIN", nargs="+",
                    help="origins whose browser pages may call the HTTP API (CORS), e.g. "
                         "https://app.example.com; '*': any (default: none)")
    up.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    help="reuse the KV of prompt prefixes computed before (default on)")
    up.add_argument("--seed", type=int,
                    help="sampled requests without a seed get seeds drawn from this one: a "
                         "fresh server gives the same requests the same outputs (default: "
                         "random seeds)")
    up.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                    help="the chat template, a file or the Jinja text itself (default: the "
                         "model's)")
    up.add_argument("--generation-config", metavar="auto|vllm|FOLDER",
                    help="request defaults (temperature, top_p, ...): auto, the model's "
                         "generation_config.json (default); vllm, none; or a folder's")
    up.add_argument("--max-num-seqs", type=int, metavar="N",
                    help="sequences an engine runs at once (32)")
    up.add_argument("--max-model-len", type=int, metavar="N",
                    help="the longest prompt + output, in tokens (default: the model's; an "
                         "engine whose KV cache cannot hold one such sequence refuses to "
                         "start, saying what it holds)")
    up.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                    help="the share of a GPU's memory an engine takes: weights, its largest "
                         "step, then KV blocks for the rest (0.9)")
    up.add_argument("--kv-cache-memory-gb", type=float, metavar="GB",
                    help="KV cache per engine rank (default: 1 on a CPU; on a GPU, what "
                         "--gpu-memory-utilization leaves)")
    up.add_argument("--dtype", choices=list(DTYPES),
                    help="auto (default): bfloat16 on a GPU and on a CPU where our kernels run "
                         "(AVX-512 BF16), else float32; the ready line says which and why")
    up.add_argument("--device", choices=list(DEVICES),
                    help="where engines run (auto: cuda when a worker sees a GPU)")
    up.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS),
                    help="paged attention: triton kernels (CUDA), torch SDPA, cpu (our C "
                         "kernels: bfloat16 on x86 with AVX-512 BF16), or flash_attn (the "
                         "flash-attn package, CUDA; block size 256) (auto: triton on a GPU; on "
                         "a CPU, cpu for bfloat16 where it runs, else torch)")
    up.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                    help="replay decode steps as CUDA graphs (on a GPU with triton attention; "
                         "default on)")
    up.add_argument("--prefill", type=int, metavar="N", help="prefill worker replicas (1)")
    up.add_argument("--decode", type=int, metavar="M", help="decode worker replicas (1)")
    up.add_argument("--gateways", type=int, metavar="G",
                    help="gateway replicas (1), one per node declaring --gateway-resource; "
                         "more than one needs --redis-url")
    up.add_argument("--colocated", action="store_true",
                    help="one engine in the gateway does prefill and decode (the default on "
                         "a CPU machine of fewer than 5 CPUs, where a prefill and a decode "
                         "engine cannot get 2 threads each; --prefill/--decode split anyway)")
    up.add_argument("--address", metavar="ADDR",
                    help="deploy into this running Ray cluster (`ray start --head`'s "
                         "host:port, or auto) instead of starting a private one; on exit only "
                         "Tandem's application is deleted")
    for role in ("gateway", "prefill", "decode"):
        up.add_argument(f"--{role}-resource", metavar="NAME",
                        help=f"run the {role} replicas only on Ray nodes that declare this "
                             f"custom resource (ray start --resources='{{\"NAME\": 1}}')")
    up.add_argument("--host", help="HTTP and gRPC listen address (127.0.0.1)")
    up.add_argument("--worker-host", help="where workers' control and KV ports listen "
                                          "(127.0.0.1; 0.0.0.0: each node's own address)")
    up.add_argument("--port", type=int, help="HTTP port (8000)")
    up.add_argument("--grpc-port", type=int, help="gRPC port (50051)")
    up.add_argument("--redis-url", help="prefix index over Redis Streams (default: in-process)")
    up.add_argument("--kv-transport", choices=list(TRANSPORTS),
                    help="how KV blocks move between workers (auto: NIXL when it loads)")
    up.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES),
                    help="KV cache: auto (the model's dtype) or int8 (a scale per token and KV "
                         "head; ~1.9x the blocks of bfloat16; not with flash_attn)")
    up.add_argument("--weight-format", choices=list(WEIGHT_FORMATS),
                    help="dense (default) or int4: a GGUF's Q4_1 weights kept 4-bit for "
                         "decode steps of a few tokens (CPU, --dtype bfloat16; faster at low "
                         "concurrency)")
    up.add_argument("--host-kv-cache-gb", type=float, metavar="GB",
                    help="host-memory KV tier per engine: evicted prefix-cache blocks kept in "
                         "this much host RAM and copied back on a hit (default 0: off)")
    up.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N",
                    help="ranks per engine (prefill, decode, colocated): heads and MLP "
                         "split over N processes, a GPU each on CUDA (default 1)")
    up.add_argument("--routing-policy", choices=ROUTING_POLICIES,
                    help="prefill choice: prefix (cache affinity + load, default) or "
                         "round_robin (in turn; a baseline)")
    up.add_argument("--max-local-prefill-tokens", type=int, metavar="N",
                    help="a prompt cached on a decode worker but for at most N tokens (a "
                         "session's next turn) is prefilled there, skipping the prefill worker "
                         "(0: only when all its full blocks are cached there)")
    up.add_argument("--block-size", type=int,
                    help="tokens per KV block (16; 256 with --attention-backend flash_attn)")
    up.add_argument("--threads", type=int,
                    help="torch threads per engine (default: (CPUs - 1) / engines, at least 1)")
    up.add_argument("--kernel-threads", type=int, choices=(1, 2),
                    help="threads our CPU kernels split over per engine (default: 2 where an "
                         "engine has one torch thread and the CPUs give each engine two)")
    up.add_argument("--prefill-threads", type=int, metavar="N",
                    help="torch threads per engine in steps that compute 32+ prompt tokens "
                         "(default: 2 for a float32 engine of one torch thread with two CPUs, "
                         "else --threads)")
    up.add_argument("--max-num-batched-tokens", type=int,
                    help="per-step token budget (the prefill chunk size)")
    up.add_argument("--request-timeout", type=float, metavar="S",
                    help="the longest a request may take, in seconds (600); then 504")
    up.add_argument("--max-in-flight", type=int, metavar="N",
                    help="requests admitted at once; beyond it 429 + Retry-After "
                         "(default: decode replicas x max_num_seqs, one decode batch)")
    up.add_argument("--client-read-timeout", type=float, metavar="S",
                    help="a streaming client that reads nothing this long is cut: request "
                         "aborted, connection dropped (60)")
    up.add_argument("--api-key", action="append", metavar="TENANT:KEY",
                    help="an API key and its tenant (repeat for more; TANDEM_API_KEYS takes "
                         "them comma-separated); requests then need `Authorization: Bearer`")
    up.add_argument("--api-keys-file", metavar="PATH", help="a file of `tenant:key` lines")
    up.add_argument("--cluster-secret-file", metavar="PATH",
                    help="the secret (>= 32 characters) that keys the tenants' cache salts and "
                         "authenticates the workers' traffic (default: a new one per run)")
    up.add_argument("--metrics-require-key", action="store_true",
                    help="/metrics needs an API key too")
    up.add_argument("--tenant-requests-per-minute", type=int, metavar="N",
                    help="per tenant; beyond it 429 + Retry-After")
    up.add_argument("--tenant-tokens-per-minute", type=int, metavar="N",
                    help="prompt + max_tokens per tenant; beyond it 429 + Retry-After")
    up.add_argument("--tls-cert-file", metavar="PEM",
                    help="serve HTTPS and gRPC over TLS only, with this certificate (then any "
                         "intermediates); needs --tls-key-file")
    up.add_argument("--tls-key-file", metavar="PEM", help="the certificate's private key "
                                                          "(unencrypted)")
    up.add_argument("--internal-tls-cert-file", metavar="PEM",
                    help="KV bytes between workers over mutual TLS (the TCP transport), with "
                         "this certificate; needs --internal-tls-key-file and "
                         "--internal-tls-ca-file")
    up.add_argument("--internal-tls-key-file", metavar="PEM",
                    help="the internal certificate's private key (unencrypted)")
    up.add_argument("--internal-tls-ca-file", metavar="PEM",
                    help="the CA whose certificates workers accept from each other")
    up.add_argument("--log-level", choices=LOG_LEVELS,
                    help="Tandem's logs on stderr (info); Ray's and Serve's stay at warning "
                         "unless debug")
    up.add_argument("--stats-interval", type=float, metavar="S",
                    help="a stats line on stderr every S seconds in which something changed "
                         "(10; 0: none)")
    _add_version(up)
    _add_spec_args(up, defaults=False)
    up.set_defaults(func=_up)


def _add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"tandem {version()}")


def up_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`tandem up`'s AppConfig settings: the --config file's, overridden by the flags given."""
    from tandem.services.serving.config import read_yaml_settings

    flags = {field: getattr(args, flag) for flag, field in _UP_FLAGS.items()
             if hasattr(args, flag)}
    source = getattr(args, "config", None)
    return {**(read_yaml_settings(source) if source else {}), **flags}


def _up(args: argparse.Namespace) -> int:
    from tandem.services.serving import up
    from tandem.services.serving.config import AppConfig

    keys = [*getattr(args, "api_key", []),
            *(k for k in os.environ.get("TANDEM_API_KEYS", "").split(",") if k.strip())]
    source = getattr(args, "config", None)
    settings, shape_reason = up.default_shape(up_settings(args))
    with up.secret_files(settings, keys) as settings:
        config = AppConfig.from_dict(settings, source or "command line")
        config.server_tls()  # a bad TLS file fails here, not in the replica Ray starts
        config.internal_tls()
        try:
            return up.run(config, log_level=getattr(args, "log_level", "info"),
                          stats_interval_s=getattr(args, "stats_interval", 10.0),
                          shape_reason=shape_reason)
        except up.StartupError as exc:
            print(f"tandem: error: {exc}", file=sys.stderr, flush=True)
            return 1


def settings_reference() -> str:
    """Every AppConfig setting as a Markdown table: its YAML key (and Helm ``app.`` key), its
    default, its ``tandem up`` flag and its comment in services/serving/config.py, the one place
    each is declared. docs/settings.md is this output (tests/serving/test_settings.py)."""
    import dataclasses

    from tandem.services.serving.config import AppConfig, setting_comments

    flags = {field: "--" + flag.replace("_", "-") for flag, field in _UP_FLAGS.items()}
    comments = setting_comments()
    rows = ["| setting | default | `tandem up` flag | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(AppConfig):
        default = field.default
        shown = "none" if default is None else str(default).lower() if isinstance(
            default, bool) else str(default)
        flag = f"`{flags[field.name]}`" if field.name in flags else ""
        meaning = comments.get(field.name, "").replace("|", "\\|")
        rows.append(f"| `{field.name}` | `{shown}` | {flag} | {meaning} |")
    return "\n".join(rows) + "\n"


def _settings(args: argparse.Namespace) -> int:
    print(settings_reference(), end="")
    return 0


def _add_fetch_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fetch = sub.add_parser("fetch", help="download a Hugging Face model id into the hub cache "
                                         "(HF_HOME; the token from HF_TOKEN) and print its "
                                         "local snapshot's path (the chart's init container)")
    fetch.add_argument("model", help="org/name[@revision] (a branch, tag or commit)")
    fetch.set_defaults(func=_fetch)


def _fetch(args: argparse.Namespace) -> int:
    """The snapshot `--model org/name[@revision]` resolves to, downloaded unless
    HF_HUB_OFFLINE is set. huggingface_hub reads the token (HF_TOKEN) itself: never here."""
    from tandem.services.engine.tokenizer_loader import hub_snapshot, is_hub_id

    if not is_hub_id(args.model):
        raise ValueError(f"{args.model!r} is not a Hugging Face model id, org/name[@revision]")
    print(hub_snapshot(args.model), flush=True)
    return 0


def _add_chat_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    chat = sub.add_parser("chat", help="chat with a running server, streaming replies")
    chat.add_argument("prompt", nargs="?", help="ask once and exit (default: interactive)")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--system", default=None, help="a system message")
    chat.add_argument("--timeout", type=float, default=60.0, metavar="S",
                      help="the longest wait for the reply or its next chunk, in seconds (60)")
    _add_client_args(chat, "when the server has API keys")
    chat.set_defaults(func=_chat)


def _add_client_args(parser: argparse.ArgumentParser, key_needed: str) -> None:
    """What a client of a running server needs: an API key and, for https, whom to trust."""
    parser.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), metavar="KEY",
                        help=f"sent as Bearer ({key_needed}; default: $TANDEM_API_KEY)")
    parser.add_argument("--cacert", metavar="PEM",
                        help="trust this CA (or the served certificate) for an https URL")


def _chat(args: argparse.Namespace) -> int:
    import httpx

    from tandem.services.serving import chat

    try:
        return chat.run(args.url, args.max_tokens, args.temperature, args.system, args.prompt,
                        api_key=args.api_key or None, cacert=args.cacert,
                        timeout_s=args.timeout)
    except (httpx.HTTPError, RuntimeError, TimeoutError) as exc:
        print(f"tandem chat: {exc}", file=sys.stderr)
        return 1


def _add_status_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    status = sub.add_parser("status", help="a running cluster at a glance: the gateway's health "
                                           "and load, one row per worker (from its /health, "
                                           "/v1/models and /metrics)")
    status.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP URL")
    _add_client_args(status, "for --metrics-require-key")
    status.add_argument("--json", action="store_true", help="the same data as JSON")
    status.add_argument("--timeout", type=float, default=5.0, metavar="S",
                        help="per request, in seconds (5)")
    status.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from tandem.services.serving import status

    return status.run(args.url, args.api_key or None, args.cacert, args.timeout, args.json)


# Subcommands whose modules are imported only when they run (each module's add_parser(sub)
# defines its arguments); otherwise listed in `tandem --help` by name and help alone.
LAZY_COMMANDS = {
    "bench": ("tandem.loadtest.bench.cli",
              "load-test an OpenAI-compatible server or Tandem's gRPC API"),
    "plan": ("tandem.services.planner.cli",
             "size prefill and decode workers from SLOs and live metrics; apply to a RayService"),
    "doctor": ("tandem.services.doctor.cli",
               "answer the six serving questions from a cluster's live metrics, rank the levers"),
    "batch": ("tandem.services.batch.cli",
              "run an OpenAI batch file (JSONL) at full throughput, resumable"),
}


def _add_lazy_parsers(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
                      argv: list[str]) -> None:
    for name, (module, help_text) in LAZY_COMMANDS.items():
        if argv[:1] == [name]:
            require(module, f"tandem {name}").add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving")
    _add_version(parser)
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
    _add_up_parser(sub)
    settings = sub.add_parser("settings", help="every setting of `tandem up` and its YAML file: "
                              "default, flag, meaning (a Markdown table)")
    settings.set_defaults(func=_settings)
    _add_fetch_parser(sub)
    _add_chat_parser(sub)
    _add_status_parser(sub)
    try:
        _add_lazy_parsers(sub, argv)
    except MissingExtra as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
