from __future__ import annotations

from pathlib import Path

from tandem.services.gateway.protogen import STUB_DIR, generate


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert {p.name for p in fresh} == {
        "generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"}
    for path in fresh:
        committed = STUB_DIR / path.name
        assert committed.is_file(), f"{committed} is missing"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is out of date: run `python -m tandem.services.gateway.protogen`")
