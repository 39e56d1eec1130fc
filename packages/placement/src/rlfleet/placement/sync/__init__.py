"""The executable sync plan: its value, planner, checks, diff, report, pictures, pricing, and the
cost model's fit from measured reports."""

from rlfleet.placement.sync._diff import SyncPlanDiff, endpoint_needs, nodes_to_rewire
from rlfleet.placement.sync._fit import fit_cost_model
from rlfleet.placement.sync._plan import (
    GROUP_TRANSPORTS,
    SYNC_STRATEGIES,
    TRANSPORTS,
    NodeBuffer,
    SyncPlan,
    SyncProcess,
    SyncStep,
)
from rlfleet.placement.sync._planner import FANOUTS, SENDERS, plan_sync, seed_sync_plan, split_shares
from rlfleet.placement.sync._report import MEASURED_PHASES, WALL_PHASES, StepReport, SyncReport

__all__ = [
    "FANOUTS",
    "GROUP_TRANSPORTS",
    "MEASURED_PHASES",
    "SENDERS",
    "SYNC_STRATEGIES",
    "TRANSPORTS",
    "WALL_PHASES",
    "NodeBuffer",
    "StepReport",
    "SyncPlan",
    "SyncPlanDiff",
    "SyncProcess",
    "SyncReport",
    "SyncStep",
    "endpoint_needs",
    "fit_cost_model",
    "nodes_to_rewire",
    "plan_sync",
    "seed_sync_plan",
    "split_shares",
]
