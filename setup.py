"""Installs the repository's top-level folders under one import root, ``tandem``:
``tandem.services`` from services/, ``tandem.router`` from router/, ``tandem.loadtest`` from
loadtest/. The rest of the metadata is in pyproject.toml."""

from setuptools import find_packages, setup

FOLDERS = ("services", "router", "loadtest")

setup(
    packages=[f"tandem.{package}"
              for package in find_packages(include=[f"{f}*" for f in FOLDERS])],
    package_dir={f"tandem.{folder}": folder for folder in FOLDERS},
)
