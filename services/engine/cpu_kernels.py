"""Our C kernels for bfloat16 on a CPU (``csrc/``): built at install into the package
(kernel_build.py, run by setup.py), else with the machine's C compiler the first time a process
needs them and cached; loaded with ctypes. Their ABI is ``csrc/tandem.h``,
declared once: ``SIGNATURES`` and the ctypes structs here are checked against it (the structs'
sizes and offsets when the library loads; the argument lists by tests/engine/test_cpu_abi.py).

- ``decode_attention.c``: the ``cpu`` attention backend's decode kernel (attention/cpu_backend.py)
- ``fused_ops.c``: RMSNorm, silu(gate) * up, the rotary embedding of queries and keys, each in
  one pass (model.py), the store of a step's K/V into the paged cache (attention/cpu_backend.py)
  and the greedy argmax over float32 logits (sampler.py)
- ``linear.c``: bfloat16 projections on Intel AMX (cpu_kernels.AmxLinear), where the CPU has it
- ``prefill_attention.c``: the ``cpu`` backend's prefill attention, on AMX too
- ``layers.c``: a step's decoder layers in one call of the above (``cpu_layers.py``)
- ``pool.c``: the helper thread that takes part of a call (``threads`` 2)

They run on x86 CPUs with AVX-512 BF16 (Intel Cooper Lake and Sapphire Rapids on, AMD Zen 4 on);
the projections and prefill attention also need AMX (Sapphire Rapids on: ``Kernels.amx``), and a
compiler with AMX intrinsics (GCC 11, Clang 12 on; with an older one the rest is built without
them).
``unavailable_reason()`` says why they cannot run here (None: they can). Without a library built
at install for these sources, one is built once per source, compiler and flags into
``$XDG_CACHE_HOME/tandem/kernels`` (``~/.cache``; the temp directory when that is not
writable), a warning saying so. The compiler is ``$CC``, else ``cc``. The calls release
the GIL (ctypes) and run on the calling thread; with ``threads`` 2 (decode and prefill attention,
the projections, RMSNorm and the rotary embedding) the helper thread of ``pool.c`` takes part of
each call too.

Linear layers on the CPU through oneDNN with prepacked bfloat16 weights.

``F.linear`` hands oneDNN a plain row-major bfloat16 weight every call, which it re-blocks on
the fly; for the small token counts of decode steps that dominates (this machine's AMX Xeon, a
4096x576 projection: 0.74 ms at 1 token, 0.85 ms at 32, against 0.49 and 0.50 ms prepacked).
``Linear.of(..., pack=True)`` reorders a weight once into oneDNN's blocked layout (the same
numbers, another order in memory) and runs it through oneDNN's linear. Whole engine, one
thread, interleaved runs (medians of 3): bfloat16 decoding at batch 1 9.5 -> 12.7 tok/s, at
batch 32 147 -> 152. float32 is left to ``F.linear``: packed it lost at batch 1 (10.5 -> 8.7)
what it won at 32 (87 -> 101). Off the CPU, or without oneDNN, nothing is packed.

``AmxLinear`` runs a bfloat16 projection through our own AMX kernel instead (csrc/linear.c,
with the ``cpu`` attention backend's kernels, on a CPU with AMX, one engine thread): the weight
packed once as AMX tiles, streamed in order. The 120 projections of a SmolLM2 decode step
(212 MB), one thread, medians of 5 interleaved (loadtest figures in docs/loadtest.md): 18.0 ms
against oneDNN's 22.9 at 1 token, 20.6 against 27.1 at 32, even at 128, 14-15% slower from
256 tokens on (98 against 83 ms at 512: oneDNN blocks larger and keeps both operands nearer
the core; prefill chunks pay that). Rows are summed in one order whatever the batch
(oneDNN's order changes with it).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from tandem.services.engine.kernel_build import (
    AVX2_BUILDS,
    BUILDS,
    PREBUILT,
    build,
    compiler,
    library_name,
)

log = logging.getLogger(__name__)

AMX_FUNCTIONS = ("linear_bf16", "prefill_attention_bf16", "amx_enable", "layers_bf16")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma")
AMX_FLAGS = ("amx_tile", "amx_bf16")
# The AVX2 library's (kernel_build.AVX2_BUILDS): float32 decode attention.
F32_FUNCTIONS = ("decode_attention_f32",)
AVX2_FLAGS = ("avx2", "fma")
# The decode kernel's limits (csrc/decode_attention.c): head_dim a multiple of 32 up to 256, at most
# 64 query rows per KV head (group size x query rows per sequence), 1,024 over the KV heads.
MAX_HEAD_DIM = 256
MAX_ROWS_PER_KV_HEAD = 64
MAX_ROWS = 1024

_Library = TypeVar("_Library", "Kernels", "Float32Kernels")
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# Each exported kernel's argument types, as csrc/tandem.h declares it (each returns an int;
# tests/engine/test_cpu_abi.py reads the header and compares).
SIGNATURES: dict[str, list[type[Any]]] = {
    "decode_attention_bf16": [_P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                              _I64, _I64, _F32, _INT],
    "decode_attention_f32": [_P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                             _I64, _I64, _F32, _INT],
    "rms_norm_bf16": [_P, _I64, _P, _P, _I64, _I64, _F32, _INT],
    "silu_mul_bf16": [_P, _I64, _P, _I64, _I64],
    "rotary_bf16": [_P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _INT],
    "store_kv_bf16": [_P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64],
    "argmax_f32": [_P, _I64, _I64, _I64, _P],
    "linear_bf16": [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT, _INT, _INT],
    "prefill_attention_bf16": [_P, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64,
                               _I64, _I64, _I64, _F32, _INT],
    "amx_enable": [],
    "layers_bf16": [_P, _I64, _P],
}


# The structs csrc/tandem.h shares with the library, field for field (checked at load).
class LayerWeights(ctypes.Structure):
    _fields_ = [(name, _P) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias",
        "down", "down_bias")]


class DecodeRun(ctypes.Structure):
    _fields_ = [("start", _I64), ("num_seqs", _I64), ("query_len", _I64),
                ("table_stride", _I64), ("tables", _P), ("seq_lens", _P)]


class Step(ctypes.Structure):
    _fields_ = [
        ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
        ("intermediate", _I64), ("eps", _F32), ("scale", _F32),
        ("cache", _P), ("num_blocks", _I64), ("block_size", _I64), ("block_stride", _I64),
        ("layer_stride", _I64), ("kv_stride", _I64), ("tok_stride", _I64),
        ("cos", _P), ("sin", _P), ("num_positions", _I64),
        ("tokens", _I64), ("positions", _P), ("slot_blocks", _P), ("slot_offsets", _P),
        ("decodes", ctypes.POINTER(DecodeRun)), ("num_decode_runs", _I64),
        ("spans", _P), ("num_spans", _I64), ("prefill_table_stride", _I64),
        ("prefill_tables", _P),
        ("x", _P), ("h", _P), ("qkv", _P), ("q", _P), ("k", _P), ("attn", _P), ("act", _P),
        ("threads", _INT), ("linear_threads", _INT), ("attention_threads", _INT),
    ]


def struct_layout() -> list[int]:
    """What ``tandem_abi_layout`` must return: each struct's size, then its fields' offsets."""
    layout: list[int] = []
    for struct in (LayerWeights, DecodeRun, Step):
        layout.append(ctypes.sizeof(struct))
        layout += [getattr(struct, name).offset for name, _ in struct._fields_]
    return layout


class Kernels:
    """The built library's functions, on tensors (checked before each call)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.tandem_abi_layout.argtypes = [p, i64]
        lib.tandem_abi_layout.restype = i64
        expected = struct_layout()
        found = (ctypes.c_int64 * len(expected))()
        count = lib.tandem_abi_layout(found, len(expected))
        if count != len(expected) or list(found) != expected:
            raise OSError(f"{path.name} disagrees with cpu_kernels.py on csrc/tandem.h's "
                          f"structs (sizes and offsets {list(found)[:count]}, expected "
                          f"{expected})")
        built_amx = hasattr(lib, "linear_bf16")  # not when the compiler lacked AMX (BUILDS)
        for name, argtypes in SIGNATURES.items():
            if (built_amx or name not in AMX_FUNCTIONS) and name not in F32_FUNCTIONS:
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self._lib = lib
        self.path = path
        # The projections' kernel needs AMX in the CPU and Linux's leave to use its tiles.
        self.amx = built_amx and not _missing_cpu_flags(AMX_FLAGS) and lib.amx_enable() == 0

    def decode_attention(self, q: torch.Tensor, out: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                         query_len: int, scale: float, threads: int = 1) -> None:
        """Attention of ``n`` sequences decoding ``query_len`` rows each into ``out``.

        q, out: [n * query_len, Hq, D] bfloat16, contiguous (sequence i's rows from
        i * query_len on); keys, values: one layer's [num_blocks, block_size, Hkv, D] views of
        the paged cache; tables: [n, >= blocks] int32 with contiguous rows; seq_lens: [n]
        int32, each sequence's keys (its query rows the last)."""
        _ok(self._lib.decode_attention_bf16(*_decode_args(
            q, out, keys, values, tables, seq_lens, query_len, scale, threads, torch.bfloat16)))

    def prefill_attention(self, q: torch.Tensor, out: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, tables: torch.Tensor, spans: torch.Tensor,
                          scale: float, threads: int = 1) -> None:
        """Causal attention of prefill spans into ``out``, on AMX (needs ``amx``).

        q, out: [T, Hq, D] bfloat16, contiguous; keys, values: one layer's paged views as
        ``decode_attention`` takes them, the spans' K/V already stored; tables: [n, >= blocks]
        int32, contiguous rows; spans: [3, n] int64, each span's first row in q, its query
        rows (the last of its keys) and its keys."""
        num_blocks, block_size, num_kv_heads, head_dim = keys.shape
        if not (self.amx and q.is_contiguous() and out.is_contiguous()
                and tables.stride(1) == 1 and spans.is_contiguous()
                and keys.stride()[2:] == (head_dim, 1) and keys.stride() == values.stride()):
            raise ValueError("prefill kernel: no AMX, or a tensor with an unsupported layout")
        _check_bf16(q, out, keys, values)
        if tables.dtype != torch.int32 or spans.dtype != torch.int64:
            raise ValueError("prefill kernel: int32 tables and int64 spans")
        n = spans.shape[1]
        _ok(self._lib.prefill_attention_bf16(
            q.data_ptr(), out.data_ptr(), keys.data_ptr(), values.data_ptr(), tables.data_ptr(),
            tables.stride(0), spans[0].data_ptr(), spans[1].data_ptr(), spans[2].data_ptr(), n,
            num_kv_heads, q.shape[1] // num_kv_heads, head_dim, block_size, keys.stride(0),
            keys.stride(1), scale, threads))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int = 1
                 ) -> torch.Tensor:
        """model.rms_norm of [rows, dim] ``x`` (rows may be strided)."""
        rows, dim = _rows(x)
        _check_bf16(x, weight)
        out = torch.empty((rows, dim), dtype=x.dtype)
        _ok(self._lib.rms_norm_bf16(x.data_ptr(), x.stride(0), weight.contiguous().data_ptr(),
                                    out.data_ptr(), rows, dim, eps, threads))
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``F.silu(gate) * up`` of [rows, 2 * dim] ``gate_up`` (gate first)."""
        rows, width = _rows(gate_up)
        _check_bf16(gate_up)
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        _ok(self._lib.silu_mul_bf16(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows,
                                    width // 2))
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``x * cos[positions] + rotate_half(x) * sin[positions]`` of the queries [tokens,
        Hq, D] and keys [tokens, Hkv, D] (token rows may be strided, heads and D contiguous),
        cos/sin [positions, D], positions [tokens] int64 (each below cos's rows), all
        contiguous: (q, k)."""
        tokens, q_heads, head_dim = q.shape
        k_heads = k.shape[1]
        if not (q.stride()[1:] == (head_dim, 1) and k.stride()[1:] == (head_dim, 1)
                and k.shape[::2] == q.shape[::2] and cos.is_contiguous()
                and sin.shape == cos.shape and sin.is_contiguous()
                and cos.shape[1] == head_dim and positions.numel() == tokens
                and positions.dtype == torch.int64 and positions.is_contiguous()):
            raise ValueError("rotary kernel: a tensor has an unsupported layout")
        _check_bf16(q, k, cos, sin)
        q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype)
        k_out = torch.empty((tokens, k_heads, head_dim), dtype=k.dtype)
        _ok(self._lib.rotary_bf16(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                  q_out.data_ptr(), k_out.data_ptr(), cos.data_ptr(),
                                  sin.data_ptr(), cos.shape[0], positions.data_ptr(), tokens,
                                  q_heads, k_heads, head_dim, threads))
        return q_out, k_out

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """Token t's ``k[t]`` and ``v[t]`` ([tokens, Hkv, D], token rows may be strided) into
        one layer's paged views ``keys``/``values`` (as ``decode_attention`` takes them) at
        block ``blocks[t]``, offset ``offsets[t]`` (int64): the torch backend's store. A slot
        outside the cache raises before anything is written."""
        tokens, kv_heads, head_dim = k.shape
        if not (k.stride()[1:] == (head_dim, 1) and v.stride()[1:] == (head_dim, 1)
                and v.shape == k.shape and keys.shape[2:] == k.shape[1:]
                and keys.stride()[2:] == (head_dim, 1) and keys.stride() == values.stride()
                and blocks.dtype == offsets.dtype == torch.int64 and blocks.is_contiguous()
                and offsets.is_contiguous() and blocks.numel() == offsets.numel() == tokens):
            raise ValueError("store kernel: a tensor has an unsupported layout")
        _check_bf16(k, v, keys, values)
        _ok(self._lib.store_kv_bf16(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                    keys.data_ptr(), values.data_ptr(), blocks.data_ptr(),
                                    offsets.data_ptr(), tokens, kv_heads * head_dim,
                                    keys.shape[0], keys.shape[1], keys.stride(0),
                                    keys.stride(1)))

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows.max(dim=-1).indices`` of float32 [n, vocab] ``rows`` (contiguous vocab):
        the first of equal values, a NaN counting as largest."""
        n, vocab = _rows(rows)
        if rows.dtype != torch.float32 or not rows.is_cpu:
            raise ValueError("argmax kernel: float32 CPU rows")
        out = torch.empty(n, dtype=torch.int64)
        _ok(self._lib.argmax_f32(rows.data_ptr(), rows.stride(0), n, vocab, out.data_ptr()))
        return out

    def linear(self, x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None,
               swiglu: bool = False, threads: int = 1, residual: torch.Tensor | None = None
               ) -> torch.Tensor:
        """``x @ weight.T + bias`` of [rows, in] ``x`` (rows may be strided) with the weight
        as ``pack_linear``'s tiles; [rows, out] bfloat16. ``swiglu`` (tiles packed so): the
        weight is gate and up stacked, and the result [rows, out / 2] is ``F.silu(gate) * up``
        of their bfloat16 outputs. ``residual`` (contiguous [rows, out], not with swiglu):
        ``residual + projection`` written into ``residual`` and returned (torch's bits for
        ``residual + linear(x)``). Needs ``amx``."""
        rows, width = _rows(x)
        out_features = tiles.shape[0] * 16
        if not self.amx or tiles.shape[1] * 32 != width or not tiles.is_contiguous():
            raise ValueError("linear kernel: no AMX, or tiles that do not fit x")
        _check_bf16(x, tiles, *([] if bias is None else [bias]))
        if residual is None:
            out = torch.empty((rows, out_features // 2 if swiglu else out_features),
                              dtype=x.dtype)
        elif (swiglu or residual.shape != (rows, out_features) or not residual.is_contiguous()
              or residual.dtype != torch.bfloat16 or not residual.is_cpu):
            raise ValueError("linear kernel: a residual is a contiguous [rows, out] bfloat16 "
                             "tensor, not with swiglu")
        else:
            out = residual
        _ok(self._lib.linear_bf16(x.data_ptr(), x.stride(0), tiles.data_ptr(),
                                  None if bias is None else bias.contiguous().data_ptr(),
                                  out.data_ptr(), rows, out_features, width, int(swiglu),
                                  int(residual is not None), threads))
        return out

    def layers(self, weights: ctypes.Array[Any], num_layers: int, step: ctypes.Structure
               ) -> None:
        """A step's first ``num_layers`` decoder layers in one call (csrc/layers.c): the
        arguments as ``cpu_layers.CpuLayers`` builds and checks them. Needs ``amx``."""
        if not self.amx:
            raise ValueError("layers kernel: no AMX")
        _ok(self._lib.layers_bf16(ctypes.addressof(weights), num_layers,
                                  ctypes.addressof(step)))


class Float32Kernels:
    """The AVX2 library (``kernel_build.AVX2_BUILDS``): float32 decode attention, for the
    ``cpu`` backend on a float32 cache (csrc/decode_attention_f32.c)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        for name in F32_FUNCTIONS:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = SIGNATURES[name], ctypes.c_int
        self._lib = lib
        self.path = path

    def decode_attention(self, q: torch.Tensor, out: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                         query_len: int, scale: float, threads: int = 1) -> None:
        """As ``Kernels.decode_attention``, on float32 tensors."""
        _ok(self._lib.decode_attention_f32(*_decode_args(
            q, out, keys, values, tables, seq_lens, query_len, scale, threads, torch.float32)))


def _decode_args(q: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, query_len: int, scale: float,
                 threads: int, dtype: torch.dtype) -> tuple[Any, ...]:
    """A decode kernel's arguments, the tensors checked (``Kernels.decode_attention``)."""
    num_blocks, block_size, num_kv_heads, head_dim = keys.shape
    if not (q.is_contiguous() and out.is_contiguous() and tables.stride(1) == 1
            and seq_lens.is_contiguous() and keys.stride()[2:] == (head_dim, 1)
            and keys.stride() == values.stride()):
        raise ValueError("decode kernel: a tensor has an unsupported layout")
    for t in (q, out, keys, values):
        if t.dtype != dtype or not t.is_cpu:
            raise ValueError(f"decode kernel: {str(dtype).removeprefix('torch.')} CPU tensors")
    if tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("decode kernel: int32 tables and lengths")
    group = q.shape[1] // num_kv_heads
    return (q.data_ptr(), out.data_ptr(), keys.data_ptr(), values.data_ptr(), tables.data_ptr(),
            tables.stride(0), seq_lens.data_ptr(), seq_lens.numel(), query_len, num_kv_heads,
            group, head_dim, block_size, keys.stride(0), keys.stride(1), scale, threads)


def pack_linear(weight: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """A [out, in] weight as the linear kernel's AMX tiles: [out/16, in/32, 16, 16, 2], tile
    (i, j) row p holding, for each of outputs 16i.., the inputs 32j + 2p and 32j + 2p + 1.
    ``swiglu``: the weight is gate and up stacked, their blocks of 16 outputs interleaved (gate
    block j, then up block j) for ``linear(..., swiglu=True)``."""
    out_features, in_features = weight.shape
    if not supports_linear(out_features, in_features, swiglu):
        raise ValueError(f"linear kernel: a {out_features}x{in_features} weight (outputs a "
                         f"multiple of {32 if swiglu else 16}, inputs of 32)")
    if swiglu:
        weight = (weight.reshape(2, out_features // 32, 16, in_features).transpose(0, 1)
                  .reshape(out_features, in_features))
    return (weight.reshape(out_features // 16, 16, in_features // 32, 16, 2)
            .permute(0, 2, 3, 1, 4).contiguous())


def supports_linear(out_features: int, in_features: int, swiglu: bool = False) -> bool:
    return out_features % (32 if swiglu else 16) == 0 and in_features % 32 == 0


def _rows(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("kernel: a [rows, dim] tensor with contiguous rows")
    return x.shape[0], x.shape[1]


def _check_bf16(*tensors: torch.Tensor) -> None:
    for t in tensors:  # a loop of attribute reads: ~0.2 us a tensor (a step makes ~300 calls)
        if t.dtype != torch.bfloat16 or not t.is_cpu:
            raise ValueError("kernel: bfloat16 CPU tensors only")


def _ok(rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"kernel failed ({'out of memory' if rc == -1 else rc})")


def supports_prefill(head_dim: int) -> bool:
    """Whether the prefill kernel takes this head size (it also needs ``Kernels.amx``)."""
    return head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM


def supports_decode(num_kv_heads: int, head_dim: int, group: int, query_len: int,
                    float32: bool = False) -> bool:
    """Whether the decode kernel (``float32``: the AVX2 one) takes this shape (else the caller
    uses SDPA)."""
    rows = group * query_len
    if float32:  # csrc/decode_attention_f32.c: head_dim a multiple of 8 up to 256
        return head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM and rows <= MAX_ROWS_PER_KV_HEAD
    return (head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM and rows <= MAX_ROWS_PER_KV_HEAD
            and num_kv_heads * rows <= MAX_ROWS)


@functools.cache
def _load() -> Kernels | str:
    missing = _missing_cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return _open("tandem-cpu", BUILDS, Kernels)


@functools.cache
def _load_f32() -> Float32Kernels | str:
    missing = _missing_cpu_flags(AVX2_FLAGS)
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return _open("tandem-avx2", AVX2_BUILDS, Float32Kernels)


def _open(prefix: str, builds: tuple[tuple[tuple[Path, ...], tuple[str, ...]], ...],
          opener: Callable[[Path], _Library]) -> _Library | str:
    """The library built at install, else the first of ``builds`` built now (or before) into
    a cache directory; why not, as a string."""
    for sources, flags in builds:  # built at install: no compiler needed
        prebuilt = PREBUILT / library_name(sources, flags, prefix=prefix)
        if prebuilt.exists():
            try:
                return opener(prebuilt)
            except OSError as e:
                log.warning("the CPU kernels built at install do not load (%s); building them", e)
    cc = compiler()
    if cc is None:
        return "it was not built at install and there is no C compiler (cc, or $CC) to build it"
    errors = []
    for sources, flags in builds:
        name = library_name(sources, flags, cc, prefix)
        for directory in _cache_dirs():
            path = directory / name
            try:
                if not path.exists():
                    log.info("the CPU kernels were not built at install (pip install builds "
                             "them); building them now into %s", directory)
                    build(cc, sources, flags, path)
                return opener(path)
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{directory}: {e}")
    return "could not build it: " + "; ".join(errors)


def load() -> Kernels:
    """The kernels; ValueError saying why when they cannot run here."""
    kernel = _load()
    if isinstance(kernel, str):
        raise ValueError(kernel)
    return kernel


def loaded() -> Kernels | None:
    """The kernels if this process has loaded them already (never builds them): for code that
    uses them where they are at hand (the sampler's argmax) without building them for it."""
    if _load.cache_info().currsize == 0:
        return None
    kernel = _load()
    return None if isinstance(kernel, str) else kernel


def load_f32() -> Float32Kernels:
    """The float32 decode kernel; ValueError saying why when it cannot run here."""
    kernel = _load_f32()
    if isinstance(kernel, str):
        raise ValueError(f"the float32 kernel cannot run here: {kernel}")
    return kernel


def f32_unavailable_reason() -> str | None:
    """Why the float32 decode kernel cannot run in this process (None: it can); builds it the
    first time."""
    kernel = _load_f32()
    return kernel if isinstance(kernel, str) else None


def unavailable_reason() -> str | None:
    """Why the kernels cannot run in this process (None: they can); builds them the first
    time."""
    kernel = _load()
    return kernel if isinstance(kernel, str) else None


def _missing_cpu_flags(wanted: tuple[str, ...] = CPU_FLAGS) -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(wanted)
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return [flag for flag in wanted if flag not in flags]


def _cache_dirs() -> list[Path]:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return [Path(base) / "tandem" / "kernels",
            Path(tempfile.gettempdir()) / f"tandem-kernels-{os.getuid()}"]


# A token count the packed layout is tuned for (decode batches); any count works.
PACK_BATCH_HINT = 32


def packing_available(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack and run bfloat16 weights here (its bfloat16 path needs
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU runs ``F.linear``)."""
    mkldnn = torch.ops.mkldnn
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype == torch.bfloat16 and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported")
            and bool(mkldnn._is_mkldnn_bf16_supported()))


@dataclass(frozen=True)
class Linear:
    """``x @ weight.T + bias``, with the weight packed for oneDNN when ``packed``."""

    weight: torch.Tensor  # [out, in]; a oneDNN-ordered copy when packed
    bias: torch.Tensor | None
    packed: bool

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
           pack: bool = False) -> Linear:
        if not pack:
            return cls(weight, bias, False)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
        return cls(packed, bias, True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias,
                                                  "none", [], "")


@dataclass(frozen=True)
class AmxLinear:
    """``x @ weight.T + bias`` through our AMX kernel, the weight held as its tiles; with
    ``swiglu`` (a gate and up projection stacked), ``F.silu(gate) * up`` of the two in the
    same pass, the [tokens, 2 x intermediate] projection never written."""

    weight: torch.Tensor  # pack_linear's tiles of the [out, in] weight
    bias: torch.Tensor | None
    kernels: Kernels
    swiglu: bool = False
    threads: int = 1  # 2: a helper thread takes part of each call (csrc/linear.c)

    @classmethod
    def usable(cls, kernels: Kernels | None, weight: torch.Tensor, swiglu: bool = False
               ) -> bool:
        """Whether ``weight`` can run here: bfloat16 on a CPU with AMX, one torch thread (the
        kernel runs on the calling thread; oneDNN uses them all), a shape the tiles take."""
        return (kernels is not None and kernels.amx and weight.dtype == torch.bfloat16
                and weight.device.type == "cpu" and torch.get_num_threads() == 1
                and supports_linear(*weight.shape, swiglu=swiglu))

    @classmethod
    def of(cls, kernels: Kernels, weight: torch.Tensor, bias: torch.Tensor | None = None,
           swiglu: bool = False, threads: int = 1) -> AmxLinear:
        return cls(pack_linear(weight, swiglu), bias, kernels, swiglu, threads)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual`` ([tokens, out], 2-D ``x``): ``residual + self(x)`` written into it."""
        if x.dim() == 2:
            return self.kernels.linear(x, self.weight, self.bias, self.swiglu, self.threads,
                                       residual)
        if residual is not None:
            raise ValueError("a residual takes a 2-D input")
        y = self.kernels.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias,
                                self.swiglu, self.threads)
        return y.view(*x.shape[:-1], y.shape[-1])
