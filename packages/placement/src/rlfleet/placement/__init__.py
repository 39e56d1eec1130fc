"""rlfleet.placement: topology graphs, placement plans, communication-group plans and topology-aware
weight-transfer planning for RL post-training clusters (networkx only; matplotlib for drawing)."""

from rlfleet.placement.__about__ import __version__
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
from rlfleet.placement._errors import (
    CapacityError,
    ColocatedSizeError,
    EmptyEvalNodeError,
    PlacementError,
    TopologyError,
)
from rlfleet.placement._placement import (
    Bundle,
    Placement,
    WorkerPlacement,
    place_colocated,
    place_disaggregated,
)
from rlfleet.placement._plan import LinkLoad, TransferPlan, TransferStep
from rlfleet.placement._reshard import (
    DEFAULT_STRIPE_BYTES,
    DTYPE_SIZES,
    Move,
    Parallelism,
    ParamSpec,
    ReshardError,
    ReshardPlan,
    plan_reshard,
)
from rlfleet.placement._seed import (
    WEIGHT_BUFFER_STRATEGIES,
    build_transfer_info_for_colocated,
    build_transfer_info_for_disaggregated,
)
from rlfleet.placement._topology import DEVICE_KINDS, LINK_KINDS, Device, Link, Port, Switch, Topology
from rlfleet.placement._transfer import (
    DEFAULT_BUCKET_BYTES,
    RELAY_MODES,
    cost_transfer_info,
    plan_transfer,
    seed_plan,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_STRIPE_BYTES",
    "DEVICE_KINDS",
    "DTYPE_SIZES",
    "INTRA_NODE",
    "LINK_KINDS",
    "RELAY_MODES",
    "TRAIN_DATA_PARALLEL",
    "WEIGHT_BUFFER_STRATEGIES",
    "WEIGHT_TRANSFER",
    "Bundle",
    "CapacityError",
    "ColocatedSizeError",
    "CommGroup",
    "CommGroupPlan",
    "Device",
    "EmptyEvalNodeError",
    "Link",
    "LinkLoad",
    "Move",
    "Parallelism",
    "ParamSpec",
    "Placement",
    "PlacementError",
    "Port",
    "RankInfo",
    "ReshardError",
    "ReshardPlan",
    "Switch",
    "Topology",
    "TopologyError",
    "TransferPlan",
    "TransferStep",
    "WorkerPlacement",
    "__version__",
    "build_transfer_info_for_colocated",
    "build_transfer_info_for_disaggregated",
    "cost_transfer_info",
    "lower_bound_seconds",
    "place_colocated",
    "place_disaggregated",
    "plan_comm_groups",
    "plan_reshard",
    "plan_transfer",
    "seed_plan",
]
