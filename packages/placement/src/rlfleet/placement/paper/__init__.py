"""Plans on paper: the what-if `TransferPlan` planner for clusters we cannot run (ours and the
seed's, priced with the cost model); nothing here is executed."""

from rlfleet.placement.paper._cost import lower_bound_seconds
from rlfleet.placement.paper._plan import LinkLoad, TransferPlan, TransferStep
from rlfleet.placement.paper._seed_plan import cost_transfer_info, seed_plan
from rlfleet.placement.paper._transfer import DEFAULT_BUCKET_BYTES, RELAY_MODES, plan_transfer

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "RELAY_MODES",
    "LinkLoad",
    "TransferPlan",
    "TransferStep",
    "cost_transfer_info",
    "lower_bound_seconds",
    "plan_transfer",
    "seed_plan",
]
