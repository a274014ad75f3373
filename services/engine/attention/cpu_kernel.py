"""The C decode-attention kernel of the ``cpu`` backend (``csrc/decode_attention.c``): built
with the machine's C compiler the first time a process needs it, cached, loaded with ctypes.

It runs on x86 CPUs with AVX-512 BF16 (Intel Cooper Lake and Sapphire Rapids on, AMD Zen 4 on)
and reads a bfloat16 paged cache. ``unavailable_reason()`` says why it cannot run here (None:
it can); it builds the library once per source and compiler flags into
``$XDG_CACHE_HOME/tandem/kernels`` (``~/.cache``; the temp directory when that is not writable),
writing to a temporary file renamed into place, so processes building at once do not clash.
The compiler is ``$CC``, else ``cc``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fPIC",
          "-shared")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma")
BUILD_TIMEOUT_S = 120.0
# The kernel's limits (csrc/decode_attention.c): head_dim a multiple of 32 up to 256, at most
# 64 query rows per KV head (group size x query rows per sequence), 1,024 over the KV heads.
MAX_HEAD_DIM = 256
MAX_ROWS_PER_KV_HEAD = 64
MAX_ROWS = 1024


class DecodeKernel:
    """``decode_attention_bf16`` of the built library."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        fn = lib.decode_attention_bf16
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, p, p, p, p, i64, p, i64, i64, i64, i64, i64, i64, i64, i64,
                       ctypes.c_float]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.path = path

    def __call__(self, q: torch.Tensor, out: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_len: int, scale: float) -> None:
        """Attention of ``n`` sequences decoding ``query_len`` rows each into ``out``.

        q, out: [n * query_len, Hq, D] bfloat16, contiguous (sequence i's rows from
        i * query_len on); keys, values: one layer's [num_blocks, block_size, Hkv, D] views of
        the paged cache; tables: [n, >= blocks] int32 with contiguous rows; seq_lens: [n]
        int32, each sequence's keys (its query rows the last)."""
        num_blocks, block_size, num_kv_heads, head_dim = keys.shape
        n = seq_lens.numel()
        if not (q.is_contiguous() and out.is_contiguous() and tables.stride(1) == 1
                and seq_lens.is_contiguous() and keys.stride()[2:] == (head_dim, 1)
                and keys.stride() == values.stride()):
            raise ValueError("decode kernel: a tensor has an unsupported layout")
        if q.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16:
            raise ValueError("decode kernel: bfloat16 only")
        if tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise ValueError("decode kernel: int32 tables and lengths")
        group = q.shape[1] // num_kv_heads
        rc = self._fn(q.data_ptr(), out.data_ptr(), keys.data_ptr(), values.data_ptr(),
                      tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), n, query_len,
                      num_kv_heads, group, head_dim, block_size, keys.stride(0),
                      keys.stride(1), scale)
        if rc != 0:
            raise RuntimeError(f"decode kernel failed ({'out of memory' if rc == -1 else rc})")


def supports(num_kv_heads: int, head_dim: int, group: int, query_len: int) -> bool:
    """Whether the kernel takes this shape (else the caller uses SDPA)."""
    rows = group * query_len
    return (head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM and rows <= MAX_ROWS_PER_KV_HEAD
            and num_kv_heads * rows <= MAX_ROWS)


@functools.cache
def _load() -> DecodeKernel | str:
    missing = _missing_cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler (cc, or $CC) to build it"
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *CFLAGS)).encode())
    name = f"decode_attention-{digest.hexdigest()[:16]}.so"
    errors = []
    for directory in _cache_dirs():
        path = directory / name
        try:
            if not path.exists():
                _build(compiler, directory, path)
            return DecodeKernel(path)
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{directory}: {e}")
    return "could not build it: " + "; ".join(errors)


def load() -> DecodeKernel:
    """The kernel; ValueError saying why when it cannot run here."""
    kernel = _load()
    if isinstance(kernel, str):
        raise ValueError(kernel)
    return kernel


def unavailable_reason() -> str | None:
    """Why the kernel cannot run in this process (None: it can); builds it the first time."""
    kernel = _load()
    return kernel if isinstance(kernel, str) else None


def _missing_cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(CPU_FLAGS)
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return [flag for flag in CPU_FLAGS if flag not in flags]


def _cache_dirs() -> list[Path]:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return [Path(base) / "tandem" / "kernels",
            Path(tempfile.gettempdir()) / f"tandem-kernels-{os.getuid()}"]


def _build(compiler: str, directory: Path, path: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", tmp], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise OSError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the cpu decode-attention kernel in %.1f s: %s", time.monotonic() - started,
             path)
