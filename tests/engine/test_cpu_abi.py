"""The C kernels' ABI, declared once in csrc/tandem.h: the ctypes argument lists of
cpu_kernels.SIGNATURES match the header's prototypes, every source includes it, and a library
whose structs disagree with the ctypes ones is refused when it loads (not run with a wrong
layout)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tandem.services.engine import cpu_kernels, kernel_build

HEADER = kernel_build.CSRC / "tandem.h"
C_TYPES = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "int": ctypes.c_int}


def prototypes() -> dict[str, list[type]]:
    """Each ``int name(args);`` of the header as ctypes argument types (any pointer: void*)."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    found = {}
    for name, args in re.findall(r"^int (\w+)\(([^)]*)\);", text, re.M | re.S):
        types = []
        for arg in " ".join(args.split()).split(","):
            arg = arg.strip()
            if arg in ("void", ""):
                continue
            types.append(ctypes.c_void_p if "*" in arg
                         else C_TYPES[arg.removeprefix("const ").rsplit(" ", 1)[0]])
        found[name] = types
    return found


def test_signatures_match_the_header() -> None:
    assert prototypes() == cpu_kernels.SIGNATURES


def test_every_source_includes_the_header() -> None:
    sources = [*kernel_build.SOURCES, *kernel_build.AMX_SOURCES]
    lacking = [s.name for s in sources if s.name != "pool.c"
               and '#include "tandem.h"' not in s.read_text()]
    assert lacking == []


def test_a_library_with_another_struct_layout_is_refused(tmp_path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here to build the library with")
    src = tmp_path / "csrc"
    shutil.copytree(kernel_build.CSRC, src)
    header = src / "tandem.h"
    text = header.read_text()
    moved = text.replace("    float eps, scale;\n", "    double eps, scale;\n")  # wider fields
    assert moved != text
    for version, expect_ok in ((text, True), (moved, False)):
        header.write_text(version)
        library = tmp_path / f"abi-{expect_ok}.so"
        subprocess.run([compiler, "-shared", "-fPIC", str(src / "abi.c"), "-o", str(library)],
                       check=True, timeout=60)
        lib = ctypes.CDLL(str(library))
        lib.tandem_abi_layout.restype = ctypes.c_int64
        out = (ctypes.c_int64 * 256)()
        n = lib.tandem_abi_layout(out, 256)
        assert (list(out)[:n] == cpu_kernels.struct_layout()) is expect_ok
    with pytest.raises(OSError, match="disagrees with cpu_kernels.py on csrc/tandem.h"):
        cpu_kernels.Kernels(library)  # the moved layout, as the loader would meet it


def test_a_failed_build_is_one_warning_and_the_engine_names_its_backend(tmp_path: Path
                                                                       ) -> None:
    """No library built at install (an empty TANDEM_KERNELS_DIR) and a compiler that fails (a
    real process exiting 1): the engine serves bfloat16 on torch, says so in one warning line
    naming why, and reports the backend it runs."""
    import os
    import sys

    code = ("import logging; logging.basicConfig(level=logging.WARNING); "
            "from tandem.services.engine.llm_engine import LLMEngine; "
            "from tandem.services.engine.config import EngineConfig; "
            "e = LLMEngine(EngineConfig(dtype='bfloat16', num_kv_blocks=16, max_model_len=256)); "
            "print('BACKEND', e.attention_backend)")
    (tmp_path / "none").mkdir()
    env = {**os.environ, "CC": "/bin/false", "XDG_CACHE_HOME": str(tmp_path),
           "TANDEM_KERNELS_DIR": str(tmp_path / "none"),
           "TMPDIR": str(tmp_path), "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    assert done.stdout.splitlines()[-1] == "BACKEND torch"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, done.stderr
    # The reason: the failed build, or on a CPU without AVX-512 BF16 (checked first) that.
    missing = cpu_kernels._missing_cpu_flags()
    reason = (f"this CPU lacks {', '.join(missing)}" if missing
              else "could not build it")
    assert f"attention backend torch, not our CPU kernels: {reason}" in warnings[0]
    assert missing or "/bin/false exited 1" in warnings[0]
