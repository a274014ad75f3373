"""Building our C kernels (``csrc/``) into one shared library: what is compiled, with which flags,
under which name. Standard library only, so that setup.py runs it at install, without torch
(``python -m tandem.services.engine.kernel_build DIR`` does the same by hand).

The library's name carries a digest of its sources, headers, compiler and flags: a library
built at install (``PREBUILT``, inside the package, shipped in the image) is used only while it
matches the sources beside it; otherwise cpu_kernels.py builds one into a cache directory the
first time a process needs it. The flags name instruction sets, not ``-march=native``: a library
built on one machine runs on any CPU that has them (cpu_kernels.py checks the CPU first).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# Built at install (setup.py) when it could be; TANDEM_KERNELS_DIR: another folder (an image
# that keeps it elsewhere, or an empty one to build on first use).
PREBUILT = Path(os.environ.get("TANDEM_KERNELS_DIR") or Path(__file__).parent / "_kernels")
SOURCES = (CSRC / "decode_attention.c", CSRC / "fused_ops.c", CSRC / "pool.c", CSRC / "abi.c")
AMX_SOURCES = (CSRC / "linear.c", CSRC / "prefill_attention.c", CSRC / "layers.c")
HEADERS = (CSRC / "tandem.h", CSRC / "simd.h", CSRC / "pool.h", CSRC / "amx.h")
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fPIC",
          "-shared")
AMX_CFLAGS = ("-mamx-tile", "-mamx-bf16")
# What is built, the first that builds: everything, then (a compiler without AMX intrinsics:
# GCC < 11, Clang < 12) everything but the AMX projections.
BUILDS = ((SOURCES + AMX_SOURCES, CFLAGS + AMX_CFLAGS), (SOURCES, CFLAGS))
# A second library for CPUs with AVX2 and FMA (every x86 CPU of the last decade): the float32
# decode attention that CPUs without AVX-512 BF16 serve with (their `dtype: auto`).
AVX2_SOURCES = (CSRC / "decode_attention_f32.c", CSRC / "pool.c")
AVX2_CFLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")
AVX2_BUILDS = ((AVX2_SOURCES, AVX2_CFLAGS),)
# Each library's file-name prefix and what is built for it.
LIBRARIES = {"tandem-cpu": BUILDS, "tandem-avx2": AVX2_BUILDS}
BUILD_TIMEOUT_S = 120.0


def compiler() -> str | None:
    """``$CC``, else ``cc``, else ``gcc``; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_name(sources: tuple[Path, ...], flags: tuple[str, ...], cc: str = "",
                 prefix: str = "tandem-cpu") -> str:
    """The library's file name: a digest of its sources, headers and flags, and of the compiler
    for one built on first use (a new compiler may build more); none for the one built at
    install, which is looked up without a compiler (an image need not have one)."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in (*sources, *HEADERS))
                            + " ".join((cc, *flags)).encode())
    return f"{prefix}-{digest.hexdigest()[:16]}.so"


def build(cc: str, sources: tuple[Path, ...], flags: tuple[str, ...], path: Path) -> None:
    """Compile into ``path`` (a temporary file renamed into place: processes building at once
    do not clash); OSError with the compiler's message if it fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                              check=False)
        if done.returncode != 0:
            raise OSError(f"{cc} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU kernels in %.1f s: %s", time.monotonic() - started, path)


def build_into(directory: Path, prefix: str = "tandem-cpu") -> Path:
    """The first of the library's builds (``LIBRARIES[prefix]``) that compiles, into
    ``directory`` (its older builds there removed); OSError saying why none did."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (cc, or $CC)")
    errors = []
    for sources, flags in LIBRARIES[prefix]:
        path = directory / library_name(sources, flags, prefix=prefix)
        try:
            build(cc, sources, flags, path)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
            continue
        for old in directory.glob(f"{prefix}-*.so"):
            if old != path:
                old.unlink()
        return path
    raise OSError("; ".join(errors))

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PREBUILT
    for name in LIBRARIES:
        print(build_into(target, name))
