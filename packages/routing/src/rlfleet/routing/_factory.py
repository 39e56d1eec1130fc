"""`create_router`: the seed's factory, with every router reachable by name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlfleet.routing._base import Router
from rlfleet.routing._consistent_hash import ConsistentHashRouter
from rlfleet.routing._least_load import LeastLoadRouter
from rlfleet.routing._node_affinity import ComponentDistribution, NodeAffinityRouter
from rlfleet.routing._power_of_two import PowerOfTwoRouter
from rlfleet.routing._prefix_aware import PrefixAwareRouter
from rlfleet.routing._public import public
from rlfleet.routing._round_robin import RoundRobinRouter
from rlfleet.routing._worker import W

ROLLOUT_MODES = ("sync", "async")
ROUTER_TYPES = (
    "simple",
    "node_affinity",
    "round_robin",
    "least_load",
    "power_of_two",
    "consistent_hash",
    "prefix_aware",
)

_BY_NAME: dict[str, type[Router[Any]]] = {
    "simple": LeastLoadRouter,
    "least_load": LeastLoadRouter,
    "round_robin": RoundRobinRouter,
    "power_of_two": PowerOfTwoRouter,
    "consistent_hash": ConsistentHashRouter,
    "prefix_aware": PrefixAwareRouter,
}


@public
def create_router(
    rollout_mode: str,
    router_type: str,
    workers: Iterable[W] = (),
    *,
    eval_policies: Iterable[W] | None = None,
    component_distribution: ComponentDistribution | None = None,
    global_resource_manager: Any = None,
    **kwargs: Any,
) -> Router[W]:
    """Build a router the way the seed's `create_router(rollout_mode, router_type, ...)` does.

    `"simple"` is the least-load router in both modes (the seed's async heap; in sync mode it
    also picks an idle worker first, as the seed's idle deque does, without polling).
    `"node_affinity"` needs `component_distribution` (or the seed's `global_resource_manager`
    with `get_component_distribution()`), or `key_to_node=` and worker nodes. Unlike the seed,
    async mode honours `router_type`. `eval_policies` is accepted as the seed's name for
    `workers`; other keyword arguments go to the router's constructor.
    """
    if rollout_mode not in ROLLOUT_MODES:
        raise ValueError(f"unknown rollout_mode {rollout_mode!r}; valid: {', '.join(ROLLOUT_MODES)}")
    if router_type not in ROUTER_TYPES:
        raise ValueError(f"unknown router_type {router_type!r}; valid: {', '.join(ROUTER_TYPES)}")
    if eval_policies is not None:
        if workers:
            raise ValueError("pass the workers once: either workers or eval_policies")
        workers = eval_policies
    if router_type != "node_affinity":
        extra = [
            name
            for name, value in (
                ("component_distribution", component_distribution),
                ("global_resource_manager", global_resource_manager),
            )
            if value is not None
        ]
        if extra:
            raise ValueError(
                f"{', '.join(extra)} only apply to router_type 'node_affinity', not {router_type!r}"
            )
        return _BY_NAME[router_type](workers, **kwargs)

    if component_distribution is None and global_resource_manager is not None:
        component_distribution = global_resource_manager.get_component_distribution()
    if component_distribution is not None:
        if len(component_distribution) == 0:
            raise ValueError("router_type 'node_affinity' got an empty component_distribution")
        return NodeAffinityRouter.from_component_distribution(list(workers), component_distribution, **kwargs)
    if "key_to_node" not in kwargs:
        raise ValueError(
            "router_type 'node_affinity' needs component_distribution, global_resource_manager "
            "or key_to_node (with worker_nodes)"
        )
    return NodeAffinityRouter(workers, **kwargs)
