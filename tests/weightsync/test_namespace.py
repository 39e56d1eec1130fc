"""Packaging facts every rlfleet package must keep (the check is shared: `testkit.check_packaging`)."""

from testkit import check_packaging


def test_packaging_facts() -> None:
    check_packaging("weightsync")
