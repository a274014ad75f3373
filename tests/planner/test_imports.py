"""The planner runs in a small pod: no torch, no Ray (and kubernetes only when it applies)."""

from __future__ import annotations

from tests.gateway.test_imports import modules_after


def test_the_planner_imports_no_torch_and_no_ray() -> None:
    loaded = modules_after("""
        import tandem.services.planner.cli
    """)
    assert "tandem.services" in loaded
    assert not loaded & {"torch", "ray", "kubernetes", "transformers"}, loaded
