"""`build_policy_group`: actors from a placement plan or in a caller's Ray placement group.

A caller's group is recorded as Ray made it (`Placement.from_bundles`); a group the builder
reserves pins each bundle to its planned node (`Placement.bundle_label_selectors`), so a bundle
that cannot go there keeps it pending and the build fails at its deadline naming the nodes.
Once the group is ready, and once the actors run, placement names any bundle or worker elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rlfleet.placement import (
    Placement,
    PlacementError,
    Topology,
    TopologyError,
    WorkerPlacement,
    place_on_ray_nodes,
    ray_node_topology,
)
from rlfleet.policygroup._config import PolicyConfig, TrainConfig
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.policygroup._policy import BasePolicy, PolicyRole
from rlfleet.policygroup._ray_node import ray_nodes
from rlfleet.policygroup.driver._group import PolicyGroup


def ray_topology(
    nodes: Sequence[str] | None = None,
    slots_per_node: int = 1,
    kind: str = "cpu",
    *,
    overrides: Mapping[str, Any] | None = None,
) -> Topology:
    """A placement Topology of the alive Ray nodes (head first), `slots_per_node` devices of
    `kind` each (placement's `ray_node_topology` over ``ray.nodes()``); link rates from
    `overrides`, the node's accelerator profile or placement's fallback (``topology.source``)."""
    try:
        return ray_node_topology(
            ray_nodes(), nodes=nodes, slots_per_node=slots_per_node, device_kind=kind, overrides=overrides
        )
    except TopologyError as exc:
        raise PolicyGroupError(f"Ray cluster topology: {exc}") from exc


def plan_placement(
    num_train: int,
    num_eval: int,
    config: PolicyConfig,
    *,
    colocated: bool = False,
    nodes: Sequence[str] | None = None,
    slots_per_node: int | None = None,
    mode: str = "packed",
) -> Placement:
    """Where each worker goes: train-i / eval-i ids on Ray node ids (placement's `place_on_ray_nodes`)."""
    try:
        return place_on_ray_nodes(
            ray_nodes(),
            num_train,
            num_eval,
            colocated=colocated,
            mode=mode,
            nodes=nodes,
            slots_per_node=slots_per_node,
            device_kind="gpu" if (config.train_num_gpus or config.eval_num_gpus) else "cpu",
            cpus_per_worker=max(config.train_num_cpus, config.eval_num_cpus, 0.01),
            overrides=config.topology,
        )
    except TopologyError as exc:
        raise PolicyGroupError(f"Ray cluster topology: {exc}") from exc


def _reserve(placement: Placement, timeout_s: float) -> Any:
    """A Ray placement group of the plan's bundles, each pinned to its planned node, ready (or
    removed and an error)."""
    pg = ray.util.placement_group(
        placement.ray_bundles(),
        strategy=placement.strategy or "PACK",
        bundle_label_selector=placement.bundle_label_selectors(),
    )
    try:
        check_bundle_nodes(pg, placement, timeout_s)  # ready, and every bundle where planned
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise
    return pg


def bundle_nodes(pg: Any, timeout_s: float, placement: Placement | None = None) -> list[str]:
    """The Ray node id of every bundle of `pg`, once it is ready (PolicyGroupError after
    `timeout_s`, naming the planned node of each bundle when `placement` is given)."""
    if not isinstance(pg, PlacementGroup):
        raise TypeError(f"placement_group must be a ray PlacementGroup, got {type(pg).__name__}")
    name = f"placement group {pg.id.hex()[:12]}"
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        nodes = None if placement is None else [b.node[:12] for b in placement.bundles]
        planned = "" if nodes is None else f": bundles {pg.bundle_specs} planned on nodes {nodes}"
        raise PolicyGroupError(
            f"{name} ({pg.bundle_count} bundles) not ready within {timeout_s:.0f}s{planned} "
            "(a node without room for its bundle, or gone)"
        ) from None
    where = placement_group_table(pg).get("bundles_to_node_id", {})
    missing = [i for i in range(pg.bundle_count) if not where.get(i)]
    if missing:
        raise PolicyGroupError(f"{name}: Ray reports no node for bundles {missing}")
    return [str(where[i]) for i in range(pg.bundle_count)]


def adopt_placement_group(
    pg: Any, indices: Sequence[int] | None, num_train: int, num_eval: int, colocated: bool, timeout_s: float
) -> Placement:
    """The plan of workers in `pg`'s bundles (worker k in bundle ``indices[k]``), each bundle on
    the node Ray put it on: `Placement.from_bundles` (defaults, checks) once `pg` is ready."""
    nodes, strategy = bundle_nodes(pg, timeout_s), placement_group_table(pg).get("strategy")
    return Placement.from_bundles(nodes, pg.bundle_specs, num_train, num_eval, indices, colocated, strategy)


def _checked(check: Callable[[Any], None], actual: Any) -> None:
    """Run one of placement's where-did-Ray-put-it checks; its error is the group's."""
    try:
        check(actual)
    except PlacementError as exc:
        raise PolicyGroupError(str(exc)) from None


def check_bundle_nodes(pg: Any, placement: Placement, timeout_s: float) -> None:
    """PolicyGroupError unless Ray put every bundle of `pg` on the node `placement` planned."""
    _checked(placement.check_bundle_nodes, bundle_nodes(pg, timeout_s, placement))


def _start_actors(
    policy_cls: type[BasePolicy],
    placement: Placement,
    pg: Any,
    config: PolicyConfig,
    kwargs: Mapping[str, Any],
) -> list[tuple[WorkerPlacement, Any]]:
    """One actor per planned worker, pinned to its node (or its bundle), in placement's start order."""
    remote_cls = ray.remote(policy_cls)
    started: list[tuple[WorkerPlacement, Any]] = []
    for w in placement.start_order():
        train = w.role == "train"
        cpus = config.train_num_cpus if train else config.eval_num_cpus
        gpus = config.train_num_gpus if train else config.eval_num_gpus
        strategy: Any = NodeAffinitySchedulingStrategy(node_id=w.node, soft=False)
        if pg is not None:  # a share of its bundle: all of a multi-GPU bundle's GPUs when alone
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=w.bundle_index or 0)
            cpus, gpus = placement.worker_resources(w, cpus)
        index = sum(1 for v, _ in started if v.role == w.role)
        actor = remote_cls.options(
            num_cpus=cpus,
            num_gpus=gpus,
            max_concurrency=config.max_concurrency,
            scheduling_strategy=strategy,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}},
        ).remote(config=config, role=PolicyRole(w.role), index=index, **kwargs)
        started.append((w, actor))
    return started


def _wait_started(
    started: list[tuple[WorkerPlacement, Any]], placement: Placement, pg: Any, timeout_s: float
) -> None:
    """Every actor answers within `timeout_s`; in a placement group, each on its bundle's node."""
    refs = [actor._get_node_id.remote() for _, actor in started]
    _ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        raise PolicyGroupError(f"{len(pending)} policy actor(s) did not start within {timeout_s:.0f}s")
    found = ray.get(refs, timeout=30)
    if pg is not None:
        _checked(
            placement.check_worker_nodes,
            {w.worker_id: str(n) for (w, _), n in zip(started, found, strict=True)},
        )


def build_policy_group(
    policy_cls: type[BasePolicy],
    num_train: int,
    num_eval: int,
    config: PolicyConfig,
    *,
    scheduling: str = "node_affinity",
    colocated: bool = False,
    mode: str = "packed",
    nodes: Sequence[str] | None = None,
    slots_per_node: int | None = None,
    policy_kwargs: Mapping[str, Any] | None = None,
    train_config: TrainConfig | None = None,
    init: bool = True,
    ready_timeout_s: float = 300.0,
    placement_group: Any = None,
    bundle_indices: Sequence[int] | None = None,
) -> PolicyGroup:
    """Create `num_train` + `num_eval` actors of `policy_cls` as planned, and connect them.

    `scheduling`: "node_affinity" pins each actor to its planned Ray node; "placement_group"
    reserves the plan's bundles in a Ray placement group first and fails if Ray put a bundle
    on another node than planned. `placement_group`: a ready (or pending) Ray placement group
    the caller made and keeps; worker k (trainers first) runs in bundle ``bundle_indices[k]``
    (`Placement.from_bundles`: multi-GPU bundles, defaults). With `init`, runs the seed's order:
    init (eval, train) -> init_placement_info -> init_weight_buffer -> init_comm_group.
    """
    if not ray.is_initialized():
        raise PolicyGroupError("build_policy_group needs ray.init() (or a cluster address) first")
    if scheduling not in ("node_affinity", "placement_group"):
        raise ValueError(f"scheduling must be 'node_affinity' or 'placement_group', got {scheduling!r}")
    if placement_group is not None:
        pg, owned = placement_group, []  # the caller's: never removed here
        placement = adopt_placement_group(pg, bundle_indices, num_train, num_eval, colocated, ready_timeout_s)
    elif bundle_indices is not None:
        raise ValueError("bundle_indices names bundles of a placement_group: pass the group too")
    else:
        placement = plan_placement(
            num_train,
            num_eval,
            config,
            colocated=colocated,
            mode=mode,
            nodes=nodes,
            slots_per_node=slots_per_node,
        )
        pg = _reserve(placement, ready_timeout_s) if scheduling == "placement_group" else None
        owned = [] if pg is None else [pg]
    started = _start_actors(policy_cls, placement, pg, config, dict(policy_kwargs or {}))
    trainers, rollout = ([a for w, a in started if w.role == role] for role in ("train", "eval"))
    everyone = trainers + rollout
    group = PolicyGroup(
        trainers, rollout, config, placement=placement, owned_actors=everyone, placement_groups=owned
    )
    try:
        _wait_started(started, placement, pg, ready_timeout_s)
        if init:
            group.init(train_config if train_config is not None else TrainConfig())
            group.init_placement_info(is_colocated=colocated)
            group.init_weight_buffer()
            group.init_comm_group(config.backend, is_colocated=colocated)
    except BaseException:
        group.shutdown()
        raise
    return group
