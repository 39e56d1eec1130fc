"""rlfleet.policygroup: trainers and rollout workers on Ray, placed, connected, synced and routed."""

from rlfleet.policygroup.__about__ import __version__
from rlfleet.policygroup._batched import BatchedData
from rlfleet.policygroup._builder import build_policy_group, plan_placement, ray_topology
from rlfleet.policygroup._config import (
    BUFFER_STRATEGIES,
    BUFFER_TYPES,
    ROLLOUT_MODES,
    PolicyConfig,
    TrainConfig,
    WeightBufferConfig,
)
from rlfleet.policygroup._errors import (
    PolicyGroupError,
    TaskTimeoutError,
    TrainWorkerDiedError,
    WorkerDiedError,
)
from rlfleet.policygroup._group import PolicyGroup
from rlfleet.policygroup._submitter import TaskSubmitter  # the seed's submitter, for users' own actors
from rlfleet.policygroup._sync import SyncOutcome
from rlfleet.policygroup._worker import BasePolicy, PolicyRole

# a worker's components are weightsync's; these are the names a policy-group user meets
from rlfleet.weightsync import CommGroupError, ParallelMode, RefitChannelError, RolloutEngines

__all__ = [
    "BUFFER_STRATEGIES",
    "BUFFER_TYPES",
    "ROLLOUT_MODES",
    "BasePolicy",
    "BatchedData",
    "CommGroupError",
    "ParallelMode",
    "PolicyConfig",
    "PolicyGroup",
    "PolicyGroupError",
    "PolicyRole",
    "RefitChannelError",
    "RolloutEngines",
    "SyncOutcome",
    "TaskSubmitter",
    "TaskTimeoutError",
    "TrainConfig",
    "TrainWorkerDiedError",
    "WeightBufferConfig",
    "WorkerDiedError",
    "__version__",
    "build_policy_group",
    "plan_placement",
    "ray_topology",
]
