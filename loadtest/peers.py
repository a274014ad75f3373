"""Peer servers for side-by-side runs: vLLM's OpenAI server (its CPU backend, from its own venv).

``VllmServer`` starts vLLM's OpenAI API server on a Hugging Face directory
(``loadtest.export_hf`` writes one from our loader, so both servers serve the same weights and
tokenizer) on a free loopback port, waits for ``/health``, and stops its whole process group.
It has the interface the experiments' launcher needs (``http_url``, ``stop()``), like
``TandemUp``.

vLLM is not a dependency of Tandem: install it in a venv of its own (docs/loadtest.md) and
pass that venv's Python (``--vllm``).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.tandem_up import LaunchError, free_port, stop_group


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
        started = time.monotonic()
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            text=True, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        while time.monotonic() - started < self.ready_timeout_s:
            if self.process.poll() is not None:
                break
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    self.http_url, self.ready_s = url, time.monotonic() - started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise LaunchError(f"vLLM did not become healthy within {self.ready_timeout_s:.0f} s "
                          f"({' '.join(argv)}); log {self.log_path}:\n{tail}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        return stop_group(self.process, timeout_s)
