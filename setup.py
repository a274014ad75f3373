"""Installs the repository's top-level folders under one import root, ``tandem``:
``tandem.services`` from services/, ``tandem.router`` from router/, ``tandem.loadtest`` from
loadtest/, and compiles our CPU kernels into the package (services/engine/kernel_build.py) where
the machine has a C compiler for them. The rest of the metadata is in pyproject.toml."""

import runpy
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

FOLDERS = ("services", "router", "loadtest")
ROOT = Path(__file__).parent


class BuildWithKernels(build_py):
    """build_py, then the kernels' library into ``tandem/services/engine/_kernels``: the build's
    copy of the package, or the source tree itself for an editable install. Without a compiler
    that can (no cc, not x86) this is a warning: the engine then builds them on first use if it
    can, or runs torch, and says so."""

    def run(self) -> None:
        super().run()
        kernel_build = runpy.run_path(str(ROOT / "services/engine/kernel_build.py"),
                                      run_name="tandem_kernel_build")
        engine = (ROOT / "services/engine" if self.editable_mode
                  else Path(self.build_lib) / "tandem/services/engine")
        for name in kernel_build["LIBRARIES"]:
            try:
                built = kernel_build["build_into"](engine / "_kernels", name)
            except OSError as exc:
                self.warn(f"the CPU kernels ({name}) were not built at install: {exc}")
            else:
                self.announce(f"built the CPU kernels: {built}", level=2)


class PlatformDistribution(Distribution):
    """The wheel carries a compiled library: tag it for this platform."""

    def has_ext_modules(self) -> bool:
        return True


setup(
    packages=[f"tandem.{package}"
              for package in find_packages(include=[f"{f}*" for f in FOLDERS])],
    package_dir={f"tandem.{folder}": folder for folder in FOLDERS},
    cmdclass={"build_py": BuildWithKernels},
    distclass=PlatformDistribution,
)
