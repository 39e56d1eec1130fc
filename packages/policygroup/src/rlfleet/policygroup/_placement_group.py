"""Ray placement groups: adopting one the caller made, and checking where Ray put each bundle.

Stacks that own their cluster layout (verl's resource pools, OpenRLHF's and NeMo RL's clusters)
make their placement groups themselves. ``build_policy_group(..., placement_group=pg,
bundle_indices=...)`` schedules each worker into the bundle it names instead of reserving a
group of its own, and records the plan as Ray made it: each bundle on the node Ray chose. A
bundle may hold several GPUs (a tensor-parallel rollout instance): the worker placed in it takes
them all (workers sharing a bundle split it evenly), and `worker_gpus` reads the count back
from the recorded plan.

Left alone, Ray chooses the node of every bundle itself ("PACK" puts two bundles planned on two
nodes on one node when both fit). The group the builder reserves therefore pins each bundle to
its planned node (`pinned`: Ray's per-bundle label selector on ``ray.io/node-id``); a bundle
that cannot go there keeps the group pending, and the builder fails at its deadline naming the
bundles and their nodes. After a group is ready, `check_bundle_nodes` compares each bundle's
node with the planned one and fails naming the bundle, its workers and both nodes; once the
actors run, `check_actor_nodes` does the same for each actor (a bundle that Ray moved after a
node died is caught there).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table

from rlfleet.placement import Bundle, Placement, WorkerPlacement
from rlfleet.policygroup._errors import PolicyGroupError

__all__ = [
    "adopt_placement_group",
    "bundle_nodes",
    "check_actor_nodes",
    "check_bundle_nodes",
    "pinned",
    "worker_gpus",
    "worker_resources",
]

RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: The label every Ray node carries with its own id (what a bundle's label selector can ask for).
NODE_ID_LABEL = "ray.io/node-id"


def pinned(placement: Placement) -> list[dict[str, str]]:
    """Per-bundle label selectors that keep each bundle of `placement` on its planned node."""
    return [{NODE_ID_LABEL: bundle.node} for bundle in placement.bundles]


def bundle_nodes(pg: Any, timeout_s: float, placement: Placement | None = None) -> list[str]:
    """The Ray node id of every bundle of `pg`, once it is ready (PolicyGroupError after
    `timeout_s`, naming the planned node of each bundle when `placement` is given)."""
    if not isinstance(pg, PlacementGroup):
        raise TypeError(f"placement_group must be a ray PlacementGroup, got {type(pg).__name__}")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        planned = (
            ""
            if placement is None
            else f": bundles {pg.bundle_specs} planned on nodes "
            + str([b.node[:12] for b in placement.bundles])
        )
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


def _default_indices(num_train: int, num_eval: int, colocated: bool) -> list[int]:
    """Trainers on bundles 0.., rollout workers after them (colocated: rollout worker i on bundle i)."""
    evals = range(num_eval) if colocated else range(num_train, num_train + num_eval)
    return [*range(num_train), *evals]


def _check_indices(indices: Sequence[int] | None, need: int, count: int, default: list[int]) -> list[int]:
    if indices is None:
        indices = default
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
        raise TypeError(f"bundle_indices must be a sequence of ints, got {type(indices).__name__}")
    if len(indices) != need:
        raise ValueError(
            f"bundle_indices names {len(indices)} bundles, one per worker is needed ({need}: trainers first)"
        )
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
            raise ValueError(
                f"bundle_indices: {i!r} is not a bundle of this placement group (it has {count})"
            )
    return list(indices)


def adopt_placement_group(
    pg: Any,
    bundle_indices: Sequence[int] | None,
    num_train: int,
    num_eval: int,
    *,
    colocated: bool = False,
    timeout_s: float = 300.0,
) -> Placement:
    """The plan of workers in `pg`'s bundles: trainer i in bundle ``bundle_indices[i]``, then the
    rollout workers; every bundle on the node Ray put it on, with its CPUs and GPUs.

    Without `bundle_indices`, trainers take bundles 0.. and rollout workers the ones after them
    (colocated: rollout worker i shares bundle i with trainer i). A bundle with GPUs is a "gpu"
    device holding them all.
    """
    nodes = bundle_nodes(pg, timeout_s)
    specs: list[Mapping[str, float]] = list(pg.bundle_specs)
    default = _default_indices(num_train, num_eval, colocated)
    indices = _check_indices(bundle_indices, num_train + num_eval, len(specs), default)
    bundles = [
        Bundle(
            node,
            f"{'gpu' if spec.get('GPU') else 'cpu'}-bundle{i}",
            spec.get("CPU", 0.0),
            spec.get("GPU", 0.0),
        )
        for i, (node, spec) in enumerate(zip(nodes, specs, strict=True))
    ]
    ids = [(f"train-{i}", "train") for i in range(num_train)] + [
        (f"eval-{i}", "eval") for i in range(num_eval)
    ]
    workers = [
        WorkerPlacement(wid, role, bundles[b].node, bundles[b].device, b)
        for (wid, role), b in zip(ids, indices, strict=True)
    ]
    strategy = placement_group_table(pg).get("strategy")
    return Placement(tuple(workers), strategy if strategy in RAY_STRATEGIES else None, tuple(bundles))


def _sharers(placement: Placement) -> Counter[int]:
    return Counter(w.bundle_index for w in placement.workers if w.bundle_index is not None)


def worker_resources(placement: Placement, worker: WorkerPlacement, cpus: float) -> tuple[float, float]:
    """(CPUs, GPUs) a worker asks of its bundle: its even share of the bundle's GPUs, and `cpus`
    capped at its share of the bundle's CPUs."""
    if worker.bundle_index is None:
        raise PolicyGroupError(f"worker {worker.worker_id!r} has no bundle in the plan")
    bundle = placement.bundles[worker.bundle_index]
    share = _sharers(placement)[worker.bundle_index]
    return min(max(cpus, 0.0), bundle.cpu / share), bundle.gpu / share


def worker_gpus(placement: Placement) -> dict[str, float]:
    """GPUs of each worker (by id): its share of its bundle's GPUs (a tensor-parallel rollout
    instance in a bundle of four GPUs has 4.0)."""
    sharers = _sharers(placement)
    return {
        str(w.worker_id): placement.bundles[w.bundle_index].gpu / sharers[w.bundle_index]
        for w in placement.workers
        if w.bundle_index is not None
    }


def _misplaced(placement: Placement, index: int, actual: str) -> str:
    bundle = placement.bundles[index]
    who = [str(w.worker_id) for w in placement.workers if w.bundle_index == index]
    return f"bundle {index} (workers {who}) is on node {actual[:12]}, planned on node {bundle.node[:12]}"


def check_bundle_nodes(pg: Any, placement: Placement, timeout_s: float) -> None:
    """PolicyGroupError unless Ray put every bundle of `pg` on the node `placement` planned."""
    actual = bundle_nodes(pg, timeout_s, placement)
    if len(actual) != len(placement.bundles):
        raise PolicyGroupError(
            f"the placement group has {len(actual)} bundles, the plan {len(placement.bundles)}"
        )
    wrong = [
        _misplaced(placement, i, node) for i, node in enumerate(actual) if node != placement.bundles[i].node
    ]
    if wrong:
        raise PolicyGroupError(
            "Ray did not put the placement group's bundles where the plan needs them: "
            + "; ".join(wrong)
            + " (the sync plan would pair the wrong workers on a node)"
        )


def check_actor_nodes(actors: Mapping[str, Sequence[Any]], placement: Placement, timeout_s: float) -> None:
    """PolicyGroupError unless every actor runs on the node its bundle was planned on."""
    started = [(w, actors[w.role][int(str(w.worker_id).rsplit("-", 1)[-1])]) for w in placement.workers]
    found = ray.get([actor._get_node_id.remote() for _, actor in started], timeout=timeout_s)
    wrong = [
        f"{w.worker_id} runs on node {str(node)[:12]}, "
        f"its bundle {w.bundle_index} was planned on node {w.node[:12]}"
        for (w, _), node in zip(started, found, strict=True)
        if node != w.node
    ]
    if wrong:
        raise PolicyGroupError("workers are not on their planned nodes: " + "; ".join(wrong))
