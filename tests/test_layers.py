"""The import structure, read from the sources (every import, in functions too): no cycles,
and each layer imports only downwards.

    protocol  <- engine <- (kv_transfer, prefill, decode, control, serving, ...)
    protocol  <- router <- serving, gateway
    services, router  never import  loadtest (benchmarks sit on top)

``tandem.services.protocol`` is the floor: the messages every layer shares, importing nothing
of ours. The engine knows no Ray and nothing above it; the router no torch and no engine.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("services", "router", "loadtest")


def _modules() -> dict[str, Path]:
    found = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(["tandem", *parts])] = path
    return found


MODULES = _modules()


def _imported_names(module: str, path: Path) -> Iterator[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _ours(name: str) -> str | None:
    """The module of ours ``name`` names (a name inside a module: that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


IMPORTS = {m: set(_imported_names(m, p)) for m, p in MODULES.items()}
EDGES = {m: {o for o in map(_ours, names) if o and o != m} for m, names in IMPORTS.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in EDGES:
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_the_tree() -> None:
    assert len(MODULES) > 150
    assert "tandem.services.engine.model" in EDGES["tandem.services.engine.llm_engine"]


def test_no_import_cycles() -> None:
    assert _cycles() == []


# (layer, what it may import of ours, third-party packages it must not import)
RULES = [
    ("tandem.services.protocol", ("tandem.services.protocol",), ("torch", "ray", "numpy")),
    ("tandem.services.engine", ("tandem.services.engine", "tandem.services.protocol"),
     ("ray", "fastapi", "grpc", "redis")),
    ("tandem.router", ("tandem.router", "tandem.services.protocol"), ("torch", "ray")),
    ("tandem.services", ("tandem.services", "tandem.router"), ()),
]


@pytest.mark.parametrize(("layer", "allowed", "banned"), RULES, ids=[r[0] for r in RULES])
def test_imports_run_down_the_layers(layer: str, allowed: tuple[str, ...],
                                     banned: tuple[str, ...]) -> None:
    def within(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    members = [m for m in MODULES if within(m, (layer,))]
    assert members
    upward = sorted((m, o) for m in members for o in EDGES[m] if not within(o, allowed))
    assert upward == []
    third_party = sorted((m, n) for m in members for n in IMPORTS[m]
                         if n.partition(".")[0] in banned)
    assert third_party == []
