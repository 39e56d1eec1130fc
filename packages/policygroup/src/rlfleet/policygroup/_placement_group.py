"""Ray placement groups: a caller's group read back as a plan, and each bundle's node checked.

A caller's group is recorded as Ray made it (`Placement.from_bundles`); the group the builder
reserves pins each bundle to its planned node (`Placement.bundle_label_selectors`), so a bundle
that cannot go there keeps it pending and the builder fails at its deadline naming the nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table

from rlfleet.placement import Placement, PlacementError
from rlfleet.policygroup._errors import PolicyGroupError

__all__ = ["adopt_placement_group", "bundle_nodes", "check_bundle_nodes"]


def bundle_nodes(pg: Any, timeout_s: float, placement: Placement | None = None) -> list[str]:
    """The Ray node id of every bundle of `pg`, once it is ready (PolicyGroupError after
    `timeout_s`, naming the planned node of each bundle when `placement` is given)."""
    if not isinstance(pg, PlacementGroup):
        raise TypeError(f"placement_group must be a ray PlacementGroup, got {type(pg).__name__}")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        nodes = None if placement is None else [b.node[:12] for b in placement.bundles]
        planned = "" if nodes is None else f": bundles {pg.bundle_specs} planned on nodes {nodes}"
        raise PolicyGroupError(
            f"placement group {pg.id.hex()[:12]} ({pg.bundle_count} bundles) not ready within "
            f"{timeout_s:.0f}s{planned} (a node without room for its bundle, or gone)"
        ) from None
    where = placement_group_table(pg).get("bundles_to_node_id", {})
    missing = [i for i in range(pg.bundle_count) if not where.get(i)]
    if missing:
        raise PolicyGroupError(
            f"placement group {pg.id.hex()[:12]}: Ray reports no node for bundles {missing}"
        )
    return [str(where[i]) for i in range(pg.bundle_count)]


def adopt_placement_group(
    pg: Any, indices: Sequence[int] | None, num_train: int, num_eval: int, colocated: bool, timeout_s: float
) -> Placement:
    """The plan of workers in `pg`'s bundles (worker k in bundle ``indices[k]``), each bundle on
    the node Ray put it on: `Placement.from_bundles` (defaults, checks) once `pg` is ready."""
    nodes, strategy = bundle_nodes(pg, timeout_s), placement_group_table(pg).get("strategy")
    return Placement.from_bundles(nodes, pg.bundle_specs, num_train, num_eval, indices, colocated, strategy)


def check_bundle_nodes(pg: Any, placement: Placement, timeout_s: float) -> None:
    """PolicyGroupError unless Ray put every bundle of `pg` on the node `placement` planned."""
    actual = bundle_nodes(pg, timeout_s, placement)
    try:
        placement.check_bundle_nodes(actual)
    except PlacementError as exc:
        raise PolicyGroupError(str(exc)) from None
