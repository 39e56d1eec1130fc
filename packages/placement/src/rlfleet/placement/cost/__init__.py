"""Cost model: the terms a weight sync is priced with, and documented hardware profiles."""

from rlfleet.placement.cost._model import LINEAR_PARAMS, CostModel, pipeline_seconds
from rlfleet.placement.cost._profiles import HARDWARE_PROFILES

__all__ = [
    "HARDWARE_PROFILES",
    "LINEAR_PARAMS",
    "CostModel",
    "pipeline_seconds",
]
