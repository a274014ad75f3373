"""Our Triton kernels as an H100/H200 (sm_90) would build them, on a machine without a GPU.

``compile_launches("package.module:function")`` runs that function (no arguments) in a fresh
Python with ``TRITON_INTERPRET=0`` (its module must set the interpreter up with setdefault),
where every Triton launch is compiled for sm_90 instead of run: the function calls our
launchers on CPU tensors of the shapes to check, and each distinct kernel variant they would
launch comes back with its registers, shared memory and spills (read with the ``cuobjdump``
that Triton's wheel ships). Nothing is executed, so only the launch arguments matter, not the
tensors' values.

``SpecializationRecorder`` counts the variants Triton would compile for the launches made while
it is installed (under the interpreter too): each launch's specialization key as Triton's own
binder computes it for sm_90 (integer values of 1 and multiples of 16, pointer alignment,
constexprs, launch options). Serving must not add variants as batches change.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

H100_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use on sm_90
_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Usage:
    kernel: str
    registers: int
    shared_bytes: int  # what the launch asks for (Triton's dynamic shared memory)
    local_bytes: int  # per-thread local memory: register spills and stack arrays
    num_warps: int
    num_stages: int
    constants: dict[str, Any]


def compile_launches(entry: str, timeout_s: float = 600) -> list[Usage]:
    """One ``Usage`` per distinct kernel variant the function ``entry`` launches."""
    # "0", not unset: a test module that sets the interpreter up uses setdefault.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "tests.engine.sm90", entry], env=env,
                          capture_output=True, text=True, timeout=timeout_s, cwd=_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {entry} for sm_90 failed:\n{done.stderr[-4000:]}")
    return [Usage(**row) for row in json.loads(done.stdout.splitlines()[-1])]


def _sm90():  # type: ignore[no-untyped-def]
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    return target, make_backend(target)


def _jit_function(kernel: Any) -> Any:
    """The compilable ``JITFunction`` behind ``kernel`` (an interpreted one under the
    interpreter), with the same specialization settings."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)


def _binder(kernel: Any, backend: Any) -> Any:
    from triton.runtime.jit import create_function_from_signature

    jit = _jit_function(kernel)
    return jit, create_function_from_signature(jit.signature, jit.params, backend)


class SpecializationRecorder:
    """Records, per kernel, the distinct sm_90 specialization keys of its launches."""

    def __init__(self) -> None:
        # kernel name -> {(specialization, options)}; constexprs are ("constexpr", value)
        self.keys: dict[str, set[tuple[Any, ...]]] = defaultdict(set)
        self.launches: dict[str, int] = defaultdict(int)
        _, self._backend = _sm90()

    def tile_choices(self, kernel: str) -> set[tuple[Any, ...]]:
        """The distinct constexpr settings among ``kernel``'s recorded keys."""
        return {tuple(e for e in specialization if e[0] == "constexpr")
                for specialization, _ in self.keys[kernel]}

    @contextmanager
    def watching(self, *kernels: Any) -> Iterator[SpecializationRecorder]:
        hooks = []
        for kernel in kernels:
            _, binder = _binder(kernel, self._backend)
            name = kernel.fn.__name__

            def hook(*args: Any, _binder: Any = binder, _name: str = name, **kwargs: Any) -> None:
                _, specialization, options = _binder(*args, **kwargs)
                self.keys[_name].add((tuple(map(tuple, specialization)),
                                      tuple(sorted(options.items()))))
                self.launches[_name] += 1

            kernel.add_pre_run_hook(hook)
            hooks.append((kernel, hook))
        try:
            yield self
        finally:
            for kernel, hook in hooks:
                kernel.pre_run_hooks.remove(hook)


def _compile_everything(entry: str) -> list[dict[str, Any]]:
    """Run ``entry`` with every JITFunction launch compiled for sm_90 instead of run."""
    from triton.compiler import ASTSource, compile
    from triton.runtime.jit import JITFunction

    target, backend = _sm90()
    cuobjdump = Path(importlib.import_module("triton").__file__).parent / (
        "backends/nvidia/bin/cuobjdump")
    seen: dict[str, dict[str, Any]] = {}

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        jit, binder = _binder(self, backend)
        kwargs.setdefault("debug", False)
        bound, specialization, options = binder(*args, **kwargs)
        key = repr((self.fn.__name__, specialization, sorted(options.items())))
        if key in seen:
            return
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound,
                                                               specialization, options)
        compiled = compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                           options=options.__dict__)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            report = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)],
                                    capture_output=True, text=True, check=True).stdout
        usage = dict(field.split(":", 1) for line in report.splitlines() if "REG:" in line
                     for field in line.split())
        names = [p.name for p in jit.params]
        seen[key] = dataclasses.asdict(Usage(
            kernel=self.fn.__name__, registers=int(usage["REG"]),
            shared_bytes=int(compiled.metadata.shared), local_bytes=int(usage["LOCAL"]),
            num_warps=options.num_warps, num_stages=options.num_stages,
            constants={names[path[0]]: value for path, value in constexprs.items()
                       if not isinstance(value, type)}))

    JITFunction.run = run  # type: ignore[method-assign]
    module, _, function = entry.partition(":")
    getattr(importlib.import_module(module), function)()
    return list(seen.values())


if __name__ == "__main__":
    print(json.dumps(_compile_everything(sys.argv[1]), default=str))
