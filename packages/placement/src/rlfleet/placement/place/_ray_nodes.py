"""Placing workers on a Ray cluster given as data: ``ray.nodes()`` in, a `Placement` out (no Ray)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rlfleet.placement._public import public
from rlfleet.placement.place._placement import Placement, place_colocated, place_disaggregated
from rlfleet.placement.topology._cluster import alive_nodes
from rlfleet.placement.topology._topology import Topology

__all__ = ["place_on_ray_nodes", "ray_node_topology"]


@public
def ray_node_topology(
    ray_nodes: Sequence[Mapping[str, Any]],
    *,
    nodes: Sequence[str] | None = None,
    slots_per_node: int = 1,
    device_kind: str = "cpu",
    overrides: Mapping[str, Any] | None = None,
) -> Topology:
    """`Topology.from_ray_nodes` with `slots_per_node` devices of `device_kind` ("gpu" or
    "cpu") on each alive node (only `nodes`, in that order, when given); `overrides` set rates."""
    opts: dict[str, Any] = {
        ("gpus" if device_kind == "gpu" else "cpu_slots"): slots_per_node,
        **dict(overrides or {}),
    }
    if nodes is not None:
        opts["nodes"] = list(nodes)
    return Topology.from_ray_nodes(ray_nodes, opts)


@public
def place_on_ray_nodes(
    ray_nodes: Sequence[Mapping[str, Any]],
    n_train: int,
    n_eval: int,
    *,
    colocated: bool = False,
    mode: str = "packed",
    nodes: Sequence[str] | None = None,
    slots_per_node: int | None = None,
    device_kind: str = "cpu",
    cpus_per_worker: float = 1.0,
    overrides: Mapping[str, Any] | None = None,
) -> Placement:
    """`place_colocated` / `place_disaggregated` (`mode`) on `ray_node_topology`.

    Without `slots_per_node`, each node gets just enough devices for the workers that need one
    of their own (the trainers when colocated, every worker otherwise) spread over the nodes.
    """
    if slots_per_node is None:
        count = len(nodes) if nodes is not None else len(alive_nodes(ray_nodes))
        need = n_train if colocated else n_train + n_eval
        slots_per_node = max(1, math.ceil(need / max(1, count)))
    topology = ray_node_topology(
        ray_nodes, nodes=nodes, slots_per_node=slots_per_node, device_kind=device_kind, overrides=overrides
    )
    if colocated:
        return place_colocated(
            topology, n_train, n_eval, cpus_per_worker=cpus_per_worker, device_kind=device_kind
        )
    return place_disaggregated(
        topology, n_train, n_eval, mode=mode, cpus_per_worker=cpus_per_worker, device_kind=device_kind
    )
