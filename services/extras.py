"""Optional dependencies, as pyproject.toml's extras declare them: the error that names the
extra to install when a feature's module is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

# The top-level module -> the extra that installs it.
EXTRAS = {"matplotlib": "bench", "psutil": "bench", "kubernetes": "ops", "flash_attn": "gpu",
          "nixl_cu12": "cpu", "nixl_cu13": "gpu"}


class MissingExtra(ValueError):
    """A feature's optional dependency is not installed (a ValueError: the CLI prints it as
    one line and exits 2)."""


def missing(module: str, feature: str) -> MissingExtra:
    top = module.partition(".")[0]
    return MissingExtra(f"{feature} needs {top}, which is not installed: "
                        f"pip install 'tandem[{EXTRAS[top]}]'")


def require(module: str, feature: str) -> ModuleType:
    """``import module``, or ``MissingExtra`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] not in EXTRAS:
            raise
        raise missing(exc.name, feature) from None
