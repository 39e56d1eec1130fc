"""The driver side, on Ray: `PolicyGroup` (the seed's whole API, a facade over its parts),
building it from a placement plan or a caller's placement group, bounded Ray calls with failure
classification, rollout dispatch, membership and role changes, calibration.
"""

from rlfleet.policygroup.driver._builder import build_policy_group, plan_placement, ray_topology
from rlfleet.policygroup.driver._group import PolicyGroup
from rlfleet.policygroup.driver._submitter import TaskSubmitter

__all__ = ["PolicyGroup", "TaskSubmitter", "build_policy_group", "plan_placement", "ray_topology"]
