"""Optional dependencies: pyproject's extras hold what services/extras.py says they do, and a
command whose extra is missing says which extra to install (one line, exit 2)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandem.services.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# The distribution that installs each module, where its name differs.
DISTRIBUTIONS = {"flash_attn": "flash-attn", "nixl_cu12": "nixl-cu12", "nixl_cu13": "nixl-cu13"}


@pytest.mark.parametrize(("module", "extra"), sorted(EXTRAS.items()))
def test_each_extra_installs_its_modules(module: str, extra: str) -> None:
    requirements = PROJECT["optional-dependencies"][extra]
    distribution = DISTRIBUTIONS.get(module, module)
    assert any(r.split("=")[0].split(">")[0].split("[")[0] == distribution
               for r in requirements), requirements
    assert not any(r.startswith(distribution) for r in PROJECT["dependencies"])


def _tandem_without(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``tandem ARGV`` in a process where ``module`` cannot be imported."""
    code = (f"import sys; sys.modules[{module!r}] = None; "
            f"from tandem.services.cli import main; sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_bench_without_matplotlib_names_the_extra() -> None:
    done = _tandem_without("matplotlib", "bench", "--help")
    assert done.returncode == 2
    assert done.stderr.strip() == ("tandem: error: tandem bench needs matplotlib, which is not "
                                   "installed: pip install 'tandem[bench]'")


def test_bench_with_its_extra_runs() -> None:
    done = _tandem_without("nothing_of_ours", "bench", "--help")
    assert done.returncode == 0 and "usage: tandem bench" in done.stdout
