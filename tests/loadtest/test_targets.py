"""Target addresses: what --base-url and --target accept."""

from __future__ import annotations

import pytest

from tandem.loadtest.bench.clients import Target


@pytest.mark.parametrize(("spec", "protocol", "expected"), [
    ("http://127.0.0.1:8000", None, Target("127.0.0.1:8000", "http", "http://127.0.0.1:8000/v1")),
    ("peer=http://h:8000/v1/", None, Target("peer", "http", "http://h:8000/v1")),
    ("https://h/api", None, Target("h", "http", "https://h/api/v1")),
    ("grpc://127.0.0.1:50051", None, Target("127.0.0.1:50051", "grpc", "127.0.0.1:50051")),
    ("t=127.0.0.1:50051", "grpc", Target("t", "grpc", "127.0.0.1:50051")),
])
def test_targets_parse(spec: str, protocol: str | None, expected: Target) -> None:
    assert Target.parse(spec, protocol) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("spec", "protocol"), [
    ("ftp://h:1", None), ("127.0.0.1:8000", None), ("grpc://h", None),
    ("http://h:1", "grpc"), ("a=", None),
])
def test_bad_targets_are_rejected(spec: str, protocol: str | None) -> None:
    with pytest.raises(ValueError, match="target is"):
        Target.parse(spec, protocol)  # type: ignore[arg-type]
