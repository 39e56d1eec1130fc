"""A policy worker's own surface, Ray-free: mixins any worker class inherits over `WorkerHost`
(which declares what they read), and the parts they share.

Communication groups (`CommGroupCalls`), the timed weight calls a sync plan runs
(`WeightCalls`), weights, training state and checkpoints (`StateCalls`), reference log-probs
(`ReferenceCalls`), device facts and profiling (`DeviceCalls`), offload (`OffloadCalls`); a
trainer's snapshots for non-blocking syncs (`TrainerSnapshots`).
"""

from rlfleet.policygroup.worker._checkpoints import Checkpoints
from rlfleet.policygroup.worker._comm import CommGroupCalls, ParallelMode, WorkerComm
from rlfleet.policygroup.worker._device import (
    Profiler,
    Timings,
    device_id,
    device_info,
    free_memory,
    host_memory,
    reset_peak_memory,
)
from rlfleet.policygroup.worker._host import WorkerHost
from rlfleet.policygroup.worker._reference import ReferenceCalls, reference_logprobs
from rlfleet.policygroup.worker._resources import DeviceCalls, OffloadCalls
from rlfleet.policygroup.worker._settings import BufferSettings, WorkerSettings
from rlfleet.policygroup.worker._snapshots import TrainerSnapshots
from rlfleet.policygroup.worker._state import StateCalls
from rlfleet.policygroup.worker._weight_calls import STEP_CALLS, WeightCalls

__all__ = [
    "STEP_CALLS",
    "BufferSettings",
    "Checkpoints",
    "CommGroupCalls",
    "DeviceCalls",
    "OffloadCalls",
    "ParallelMode",
    "Profiler",
    "ReferenceCalls",
    "StateCalls",
    "Timings",
    "TrainerSnapshots",
    "WeightCalls",
    "WorkerComm",
    "WorkerHost",
    "WorkerSettings",
    "device_id",
    "device_info",
    "free_memory",
    "host_memory",
    "reference_logprobs",
    "reset_peak_memory",
]
