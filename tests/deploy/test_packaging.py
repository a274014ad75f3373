"""What ``pip install .`` puts into site-packages: one import root, ``tandem`` (services/,
router/ and loadtest/ under it), the C kernels' sources with the engine, the ``tandem``
command; nothing of ours at the top level besides."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_install_holds_tandem_alone(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: the build writes its folders beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("services", "router", "loadtest"):
        shutil.copytree(ROOT / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, cwd=tmp_path, timeout=300)
    tops = {p.name for p in target.iterdir()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tandem", "bin"}, tops
    assert sorted(p.name for p in (target / "tandem").iterdir()) == [
        "loadtest", "router", "services"]
    assert (target / "tandem" / "services" / "engine" / "csrc" / "fused_ops.c").is_file()
    assert (target / "bin" / "tandem").is_file()
    # Both kernel libraries built at install (kernel_build.LIBRARIES; this machine has cc).
    kernels = target / "tandem" / "services" / "engine" / "_kernels"
    assert sorted(p.name.split("-")[1] for p in kernels.glob("*.so")) == ["avx2", "cpu"]
    # The installed tree imports from itself (not from this checkout), under the root alone.
    probe = ("import sys, tandem.services.version; "
             "assert 'services' not in sys.modules and 'router' not in sys.modules; "
             "print(tandem.services.version.__file__)")
    done = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, check=True,
                          capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(target)})
    assert done.stdout.strip().startswith(str(target / "tandem" / "services"))
