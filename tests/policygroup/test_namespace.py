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


def test_public_names_are_sorted_and_internals_stay_private() -> None:
    names = rlfleet.policygroup.__all__

    def kind(name: str) -> int:  # constants, then classes, then functions (ruff's RUF022 order)
        return 0 if name.isupper() else 1 if name[:1].isupper() else 2

    assert names == sorted(names, key=lambda n: (kind(n), n))
    assert all(hasattr(rlfleet.policygroup, n) for n in names)
    for internal in ("ReshardWorkerMixin", "resolve_object"):  # BasePolicy and the group use them
        assert internal not in names
        assert not hasattr(rlfleet.policygroup, internal)
