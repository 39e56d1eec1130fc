"""rlfleet.placement: topology graphs, placement plans, communication-group plans and topology-aware
weight-transfer planning for RL post-training clusters (networkx only; matplotlib for drawing)."""

from rlfleet.placement.__about__ import __version__
from rlfleet.placement._cluster import NvidiaSmiTopo, parse_nvidia_smi_topo
from rlfleet.placement._cluster_plan import place_on_ray_nodes, ray_node_topology
from rlfleet.placement._comm import (
    INTRA_NODE,
    TRAIN_DATA_PARALLEL,
    WEIGHT_TRANSFER,
    CommGroup,
    CommGroupPlan,
    RankInfo,
    plan_comm_groups,
)
from rlfleet.placement._cost import lower_bound_seconds
from rlfleet.placement._cost_model import LINEAR_PARAMS, CostModel, pipeline_seconds
from rlfleet.placement._errors import (
    CapacityError,
    ColocatedSizeError,
    CostModelError,
    EmptyEvalNodeError,
    PlacementError,
    ReshardError,
    SyncPlanError,
    TopologyError,
)
from rlfleet.placement._placement import (
    NODE_ID_LABEL,
    Bundle,
    Placement,
    WorkerPlacement,
    place_colocated,
    place_disaggregated,
)
from rlfleet.placement._plan import LinkLoad, TransferPlan, TransferStep
from rlfleet.placement._profiles import HARDWARE_PROFILES
from rlfleet.placement._reshard import DEFAULT_STRIPE_BYTES, plan_reshard
from rlfleet.placement._reshard_cost import ReshardCost, price_reshard, reshard_lower_bound
from rlfleet.placement._reshard_plan import Move, ReshardPlan
from rlfleet.placement._reshard_specs import DTYPE_SIZES, Parallelism, ParamSpec
from rlfleet.placement._seed import (
    WEIGHT_BUFFER_STRATEGIES,
    build_transfer_info_for_colocated,
    build_transfer_info_for_disaggregated,
)
from rlfleet.placement._sync_diff import SyncPlanDiff, endpoint_needs, nodes_to_rewire
from rlfleet.placement._sync_plan import (
    GROUP_TRANSPORTS,
    SYNC_STRATEGIES,
    TRANSPORTS,
    NodeBuffer,
    SyncPlan,
    SyncProcess,
    SyncStep,
)
from rlfleet.placement._sync_planner import FANOUTS, SENDERS, plan_sync, seed_sync_plan, split_shares
from rlfleet.placement._sync_report import MEASURED_PHASES, StepReport, SyncReport
from rlfleet.placement._sync_schedule import CALL_KINDS, GroupPart, PlannedCall, schedule_calls, sync_report
from rlfleet.placement._sync_setup import (
    CUDA_IPC_SETTINGS,
    PLANNERS,
    WorkerSite,
    check_sync_options,
    cuda_ipc_mode,
    make_sync_plan,
    sync_processes,
)
from rlfleet.placement._sync_wiring import BufferWiring, NodeWiring, SyncGroups, node_wiring
from rlfleet.placement._topology import DEVICE_KINDS, LINK_KINDS, Device, Link, Port, Switch, Topology
from rlfleet.placement._transfer import DEFAULT_BUCKET_BYTES, RELAY_MODES, plan_transfer
from rlfleet.placement._transfer_seed import cost_transfer_info, seed_plan

__all__ = [
    "CALL_KINDS",
    "CUDA_IPC_SETTINGS",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_STRIPE_BYTES",
    "DEVICE_KINDS",
    "DTYPE_SIZES",
    "FANOUTS",
    "GROUP_TRANSPORTS",
    "HARDWARE_PROFILES",
    "INTRA_NODE",
    "LINEAR_PARAMS",
    "LINK_KINDS",
    "MEASURED_PHASES",
    "NODE_ID_LABEL",
    "PLANNERS",
    "RELAY_MODES",
    "SENDERS",
    "SYNC_STRATEGIES",
    "TRAIN_DATA_PARALLEL",
    "TRANSPORTS",
    "WEIGHT_BUFFER_STRATEGIES",
    "WEIGHT_TRANSFER",
    "BufferWiring",
    "Bundle",
    "CapacityError",
    "ColocatedSizeError",
    "CommGroup",
    "CommGroupPlan",
    "CostModel",
    "CostModelError",
    "Device",
    "EmptyEvalNodeError",
    "GroupPart",
    "Link",
    "LinkLoad",
    "Move",
    "NodeBuffer",
    "NodeWiring",
    "NvidiaSmiTopo",
    "Parallelism",
    "ParamSpec",
    "Placement",
    "PlacementError",
    "PlannedCall",
    "Port",
    "RankInfo",
    "ReshardCost",
    "ReshardError",
    "ReshardPlan",
    "StepReport",
    "Switch",
    "SyncGroups",
    "SyncPlan",
    "SyncPlanDiff",
    "SyncPlanError",
    "SyncProcess",
    "SyncReport",
    "SyncStep",
    "Topology",
    "TopologyError",
    "TransferPlan",
    "TransferStep",
    "WorkerPlacement",
    "WorkerSite",
    "__version__",
    "build_transfer_info_for_colocated",
    "build_transfer_info_for_disaggregated",
    "check_sync_options",
    "cost_transfer_info",
    "cuda_ipc_mode",
    "endpoint_needs",
    "lower_bound_seconds",
    "make_sync_plan",
    "node_wiring",
    "nodes_to_rewire",
    "parse_nvidia_smi_topo",
    "pipeline_seconds",
    "place_colocated",
    "place_disaggregated",
    "place_on_ray_nodes",
    "plan_comm_groups",
    "plan_reshard",
    "plan_sync",
    "plan_transfer",
    "price_reshard",
    "ray_node_topology",
    "reshard_lower_bound",
    "schedule_calls",
    "seed_plan",
    "seed_sync_plan",
    "split_shares",
    "sync_processes",
    "sync_report",
]
