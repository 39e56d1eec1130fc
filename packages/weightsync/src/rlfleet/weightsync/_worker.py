"""`WorkerCalls`: every worker call weightsync has, in one class for a host class to inherit.

A host (policygroup's `BasePolicy`, or a test's plain class) inherits it, sets what `WorkerHost`
declares and calls `_init_parts`; it adds its own hooks (`build_optimizer`, `_refuse_if_restarted`)
and, for ``nccl_reshard``, the planning (`ReshardCalls._prepare_reshard`).
"""

from __future__ import annotations

from rlfleet.weightsync._refit_calls import RefitCalls
from rlfleet.weightsync._reshard_calls import ReshardCalls
from rlfleet.weightsync._worker_calls import WeightCalls
from rlfleet.weightsync._worker_comm import CommGroupCalls
from rlfleet.weightsync._worker_reference import ReferenceCalls
from rlfleet.weightsync._worker_resources import DeviceCalls, OffloadCalls
from rlfleet.weightsync._worker_state import StateCalls


class WorkerCalls(
    CommGroupCalls,
    WeightCalls,
    ReshardCalls,
    RefitCalls,
    StateCalls,
    ReferenceCalls,
    DeviceCalls,
    OffloadCalls,
):
    """Groups, the sync's calls, NeMo RL's refit and reshard calls, state, checkpoints, reference
    log-probs, device facts, profiling and offload of one worker."""
