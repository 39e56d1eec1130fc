"""Packaging facts every rlfleet package must keep (the shared check), and policygroup's public names."""

from testkit import check_packaging

import rlfleet.policygroup


def test_packaging_facts() -> None:
    check_packaging("policygroup")


def test_public_names_are_sorted_and_internals_stay_private() -> None:
    names = rlfleet.policygroup.__all__

    def kind(name: str) -> int:  # constants, then classes, then functions (ruff's RUF022 order)
        return 0 if name.isupper() else 1 if name[:1].isupper() else 2

    assert names == sorted(names, key=lambda n: (kind(n), n))
    assert all(hasattr(rlfleet.policygroup, n) for n in names)
    for internal in ("ReshardWorkerMixin", "resolve_object"):  # BasePolicy and the group use them
        assert internal not in names
        assert not hasattr(rlfleet.policygroup, internal)
