"""Tandem's version: the installed distribution's (pyproject.toml)."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
