"""The whole sync, predicted: what an executor does around the plan's steps.

A plan's ``predicted_seconds`` prices its steps. A caller waits longer: before the steps the
executor checks its workers (one control round trip, in parallel), after them it collects the
answers (one more) and applies the version. "None" applies in place during the steps; the
other strategies apply as a rolling update, one rollout worker (one node's group for "Sharded")
at a time: a control round trip each, plus the copy of the version into the worker's weights
("Double", "Sharded"), or none ("Shared" rebinds views of the node's buffer).
"""

from __future__ import annotations

from rlfleet.placement._public import public
from rlfleet.placement.cost._model import CostModel
from rlfleet.placement.sync._plan import SyncPlan
from rlfleet.placement.sync._report import WALL_PHASES

__all__ = ["predict_sync_wall"]

COPYING = ("Double", "Sharded")  # strategies whose apply copies the version into live weights


@public
def predict_sync_wall(
    plan: SyncPlan, model: CostModel | None = None, *, apply: bool = True
) -> dict[str, float]:
    """The predicted `WALL_PHASES` of one sync of `plan` (their sum is its predicted wall time).

    `apply`: the version is applied too (``sync_weights``), not only staged (``send_weights``).
    """
    model = model if model is not None else CostModel()
    rtt = model.control_round_trip_s
    rollouts = [p for p in plan.processes if p.role == "rollout"]
    phases = dict.fromkeys(WALL_PHASES, 0.0)
    phases["prepare"] = rtt
    phases["steps"] = plan.predicted_seconds
    phases["collect"] = rtt
    if apply and plan.strategy != "None":
        swaps = len({p.node for p in rollouts}) if plan.strategy == "Sharded" else len(rollouts)
        copy = model.copy_seconds(sum(plan.bucket_bytes), "load") if plan.strategy in COPYING else 0.0
        phases["apply"] = swaps * (rtt + copy)
    return phases
