"""Packaging facts every rlfleet package must keep."""

import importlib
from pathlib import Path

import rlfleet.policygroup

REPO = Path(__file__).resolve().parents[2]


def test_version_is_exposed() -> None:
    assert (
        rlfleet.policygroup.__version__
        == importlib.import_module("rlfleet.policygroup.__about__").__version__
    )


def test_rlfleet_is_an_implicit_namespace_in_every_package() -> None:
    for pkg in ("routing", "placement", "weightsync", "policygroup"):
        src = REPO / "packages" / pkg / "src"
        assert (src / "rlfleet" / pkg / "py.typed").is_file()
        assert not (src / "rlfleet" / "__init__.py").exists(), f"{src}/rlfleet/__init__.py must not exist"
