"""Names the package root kept for one release after a rename: reading one warns and names the new.

placement's ``WEIGHT_BUFFER_STRATEGIES`` (the seed's three strategies that
`build_transfer_info_for_disaggregated` accepts) shared its name with weightsync's four receive
strategies; it is ``SEED_BUFFER_STRATEGIES`` now. The root imports `__getattr__` from here so its
face stays imports only.
"""

from __future__ import annotations

import warnings

from rlfleet.placement.place._seed import SEED_BUFFER_STRATEGIES

__all__ = ["RENAMED", "__getattr__"]

#: old root name -> (new root name, its value)
RENAMED: dict[str, tuple[str, tuple[str, ...]]] = {
    "WEIGHT_BUFFER_STRATEGIES": ("SEED_BUFFER_STRATEGIES", SEED_BUFFER_STRATEGIES),
}


def __getattr__(name: str) -> tuple[str, ...]:
    """The module ``__getattr__`` of ``rlfleet.placement``: a renamed name warns and resolves."""
    if name in RENAMED:
        new, value = RENAMED[name]
        warnings.warn(
            f"rlfleet.placement.{name} is renamed {new} (the seed's strategies for "
            f"build_transfer_info_for_disaggregated; weightsync's WEIGHT_BUFFER_STRATEGIES are the "
            f"receive strategies); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module 'rlfleet.placement' has no attribute {name!r}")
