"""Where workers go: placement plans and bundles, Ray node lists as data, and the seed's
transfer-info planners over a placement."""

from rlfleet.placement.place._placement import (
    NODE_ID_LABEL,
    Bundle,
    Placement,
    WorkerPlacement,
    place_colocated,
    place_disaggregated,
)
from rlfleet.placement.place._ray_nodes import place_on_ray_nodes, ray_node_topology
from rlfleet.placement.place._seed import (
    SEED_BUFFER_STRATEGIES,
    build_transfer_info_for_colocated,
    build_transfer_info_for_disaggregated,
)

__all__ = [
    "NODE_ID_LABEL",
    "SEED_BUFFER_STRATEGIES",
    "Bundle",
    "Placement",
    "WorkerPlacement",
    "build_transfer_info_for_colocated",
    "build_transfer_info_for_disaggregated",
    "place_colocated",
    "place_disaggregated",
    "place_on_ray_nodes",
    "ray_node_topology",
]
