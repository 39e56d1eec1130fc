"""rlfleet.policygroup: trainers and rollout workers on Ray, placed, connected, synced and routed.

- `PolicyGroup` and its builders (`driver/`, on Ray), the sync plan's executor (`sync/`);
- `BasePolicy`, the worker a user subclasses, made of Ray-free mixins: `worker/` (groups, weight
  calls, state and checkpoints, reference log-probs, device facts, offload) and `nemo/` (NeMo
  RL's refit and reshard calls); `WorkerCalls` is all of them, for a worker class of one's own;
- the configuration dataclasses, the errors.
"""

from rlfleet.policygroup.__about__ import __version__
from rlfleet.policygroup._batched import BatchedData
from rlfleet.policygroup._config import (
    BUFFER_STRATEGIES,
    BUFFER_TYPES,
    ROLLOUT_MODES,
    ROUTER_TYPES,
    PolicyConfig,
    TrainConfig,
    WeightBufferConfig,
)
from rlfleet.policygroup._errors import (
    CommGroupFormationError,
    PolicyGroupError,
    TaskTimeoutError,
    TrainWorkerDiedError,
    WorkerDiedError,
)
from rlfleet.policygroup._policy import BasePolicy, PolicyRole, WorkerCalls
from rlfleet.policygroup.driver import (
    PolicyGroup,
    TaskSubmitter,
    build_policy_group,
    plan_placement,
    ray_topology,
)
from rlfleet.policygroup.nemo import RolloutEngines
from rlfleet.policygroup.sync import SyncOutcome
from rlfleet.policygroup.worker import ParallelMode, WorkerHost
from rlfleet.weightsync import CommGroupError, PublishHandle, RefitChannelError

__all__ = [
    "BUFFER_STRATEGIES",
    "BUFFER_TYPES",
    "ROLLOUT_MODES",
    "ROUTER_TYPES",
    "BasePolicy",
    "BatchedData",
    "CommGroupError",
    "CommGroupFormationError",
    "ParallelMode",
    "PolicyConfig",
    "PolicyGroup",
    "PolicyGroupError",
    "PolicyRole",
    "PublishHandle",
    "RefitChannelError",
    "RolloutEngines",
    "SyncOutcome",
    "TaskSubmitter",
    "TaskTimeoutError",
    "TrainConfig",
    "TrainWorkerDiedError",
    "WeightBufferConfig",
    "WorkerCalls",
    "WorkerDiedError",
    "WorkerHost",
    "__version__",
    "build_policy_group",
    "plan_placement",
    "ray_topology",
]
