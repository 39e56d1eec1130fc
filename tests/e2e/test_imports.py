"""The e2e environment composes every package."""

import rlfleet.placement
import rlfleet.policygroup
import rlfleet.routing
import rlfleet.weightsync


def test_all_packages_import_together() -> None:
    versions = {
        m.__name__: m.__version__
        for m in (rlfleet.routing, rlfleet.placement, rlfleet.weightsync, rlfleet.policygroup)
    }
    assert all(v for v in versions.values())
