"""Reshard plans: which training rank sends which slice of a parameter to which generation ranks,
and their price."""

from rlfleet.placement.reshard._cost import ReshardCost, price_reshard, reshard_lower_bound
from rlfleet.placement.reshard._plan import Move, ReshardPlan
from rlfleet.placement.reshard._planner import DEFAULT_STRIPE_BYTES, plan_reshard
from rlfleet.placement.reshard._specs import DTYPE_SIZES, Parallelism, ParamSpec

__all__ = [
    "DEFAULT_STRIPE_BYTES",
    "DTYPE_SIZES",
    "Move",
    "Parallelism",
    "ParamSpec",
    "ReshardCost",
    "ReshardPlan",
    "plan_reshard",
    "price_reshard",
    "reshard_lower_bound",
]
