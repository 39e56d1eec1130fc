"""routing's environment holds routing alone: nothing heavy is importable there."""

import importlib.util

import pytest


@pytest.mark.parametrize("module", ["torch", "numpy", "networkx", "ray", "cupy"])
def test_heavy_dependency_is_absent(module: str) -> None:
    assert importlib.util.find_spec(module) is None, f"{module} leaked into rlfleet-routing's environment"


def test_siblings_are_absent() -> None:
    for pkg in ("placement", "weightsync", "policygroup"):
        assert importlib.util.find_spec(f"rlfleet.{pkg}") is None
