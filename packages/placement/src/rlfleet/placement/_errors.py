"""Error classes: every bad input raises a ValueError subclass that names the offending entry."""

from __future__ import annotations

from rlfleet.placement._public import public

__all__ = [
    "CapacityError",
    "ColocatedSizeError",
    "CostModelError",
    "EmptyEvalNodeError",
    "PlacementError",
    "ReshardError",
    "SyncPlanError",
    "TopologyError",
]


@public
class PlacementError(ValueError):
    """Bad input to rlfleet.placement (a ValueError, so generic callers can catch it)."""


@public
class TopologyError(PlacementError):
    """A topology spec or query is malformed: unknown vertex, bad bandwidth, duplicate id, ..."""


@public
class CapacityError(PlacementError):
    """The topology has too few devices for the requested workers; the message says what is short."""


@public
class ColocatedSizeError(PlacementError, AssertionError):
    """More eval than train workers in colocated mode.

    The seed signals this with ``assert``; subclassing AssertionError keeps seed callers working.
    """


@public
class EmptyEvalNodeError(PlacementError, IndexError):
    """A node listed as an eval node holds no eval policy (the seed fails here with IndexError)."""


@public
class ReshardError(PlacementError):
    """A reshard input or plan is inconsistent; the message names the parameter and slice."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


@public
class SyncPlanError(PlacementError):
    """A sync plan (or the input to plan one) is inconsistent; the message names the step or process."""


@public
class CostModelError(PlacementError):
    """A cost model parameter is out of range, or a calibration has nothing to fit."""
