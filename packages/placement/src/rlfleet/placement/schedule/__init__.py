"""What an executor does with a sync plan: the calls per step and the report their timings make,
its processes and options, the node buffers, endpoints and communication groups to wire."""

from rlfleet.placement.schedule._calls import (
    CALL_KINDS,
    CallKind,
    CallResult,
    GroupPart,
    PartResult,
    PlannedCall,
    WireResult,
    schedule_calls,
    sync_report,
)
from rlfleet.placement.schedule._comm import (
    INTRA_NODE,
    TRAIN_DATA_PARALLEL,
    WEIGHT_TRANSFER,
    CommGroup,
    CommGroupPlan,
    RankInfo,
    plan_comm_groups,
)
from rlfleet.placement.schedule._setup import (
    CUDA_IPC_SETTINGS,
    PLANNERS,
    WorkerSite,
    check_sync_options,
    cuda_ipc_mode,
    make_sync_plan,
    sync_processes,
)
from rlfleet.placement.schedule._wall import predict_sync_wall
from rlfleet.placement.schedule._wiring import BufferWiring, NodeWiring, SyncGroups, node_wiring

__all__ = [
    "CALL_KINDS",
    "CUDA_IPC_SETTINGS",
    "INTRA_NODE",
    "PLANNERS",
    "TRAIN_DATA_PARALLEL",
    "WEIGHT_TRANSFER",
    "BufferWiring",
    "CallKind",
    "CallResult",
    "CommGroup",
    "CommGroupPlan",
    "GroupPart",
    "NodeWiring",
    "PartResult",
    "PlannedCall",
    "RankInfo",
    "SyncGroups",
    "WireResult",
    "WorkerSite",
    "check_sync_options",
    "cuda_ipc_mode",
    "make_sync_plan",
    "node_wiring",
    "plan_comm_groups",
    "predict_sync_wall",
    "schedule_calls",
    "sync_processes",
    "sync_report",
]
