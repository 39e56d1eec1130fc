"""Placement as data: which worker runs where, and the Ray placement-group bundles that ask for it.

Nothing here imports Ray: bundles are plain dicts (``{"CPU": 1, "GPU": 1}``) and the strategy a
string, ready to pass to ``ray.util.placement_group(bundles, strategy=...)``. Left alone, Ray
chooses the node of each bundle itself ("PACK" puts two bundles planned on two nodes on one node
when both fit), so `Placement.bundle_label_selectors` pins each bundle to its planned node; the
caller reads each bundle's (and later each worker's) node back and `check_bundle_nodes` /
`check_worker_nodes` name every one that is elsewhere. `Placement.from_bundles` records a
placement group someone else made, each bundle on the node Ray put it on; a bundle may hold
several GPUs (a tensor-parallel rollout instance), and workers sharing a bundle split it evenly
(`worker_resources`, `worker_gpus`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.placement._errors import CapacityError, ColocatedSizeError, PlacementError
from rlfleet.placement._public import public
from rlfleet.placement.topology._topology import Topology

__all__ = [
    "NODE_ID_LABEL",
    "ROLES",
    "Bundle",
    "Placement",
    "WorkerPlacement",
    "place_colocated",
    "place_disaggregated",
]

ROLES: tuple[str, ...] = ("train", "eval")
RAY_STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: The label every Ray node carries with its own id (what a bundle's label selector can ask for).
NODE_ID_LABEL = "ray.io/node-id"


@public
@dataclass(frozen=True)
class WorkerPlacement:
    """One worker (any hashable id) on one device of one node; ``bundle_index`` into the bundles."""

    worker_id: Hashable
    role: str
    node: str
    device: str
    bundle_index: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PlacementError(
                f"worker {self.worker_id!r}: role must be one of {list(ROLES)}, got {self.role!r}"
            )
        if not isinstance(self.node, str) or not isinstance(self.device, str):
            raise PlacementError(
                f"worker {self.worker_id!r}: node and device must be strings, "
                f"got {self.node!r}, {self.device!r}"
            )


@public
@dataclass(frozen=True)
class Bundle:
    """One Ray placement-group bundle and the (node, device) it is planned for."""

    node: str
    device: str
    cpu: float
    gpu: float

    def to_ray(self) -> dict[str, float]:
        out: dict[str, float] = {"CPU": self.cpu}
        if self.gpu:
            out["GPU"] = self.gpu
        return out


@public
@dataclass(frozen=True)
class Placement:
    """Workers and, when a strategy produced it, the placement group that reserves their devices."""

    workers: tuple[WorkerPlacement, ...]
    strategy: str | None = None
    bundles: tuple[Bundle, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(self.workers))
        object.__setattr__(self, "bundles", tuple(self.bundles))
        seen: set[Hashable] = set()
        for w in self.workers:
            if not isinstance(w, WorkerPlacement):
                raise PlacementError(f"Placement.workers must hold WorkerPlacement, got {type(w).__name__}")
            if w.worker_id in seen:
                raise PlacementError(f"duplicate worker id {w.worker_id!r}")
            seen.add(w.worker_id)
            if w.bundle_index is not None and not 0 <= w.bundle_index < len(self.bundles):
                raise PlacementError(
                    f"worker {w.worker_id!r}: bundle_index {w.bundle_index} "
                    f"outside 0..{len(self.bundles) - 1}"
                )
        if self.strategy is not None and self.strategy not in RAY_STRATEGIES:
            raise PlacementError(f"strategy must be one of {list(RAY_STRATEGIES)}, got {self.strategy!r}")

    @property
    def train(self) -> tuple[WorkerPlacement, ...]:
        return tuple(w for w in self.workers if w.role == "train")

    @property
    def eval(self) -> tuple[WorkerPlacement, ...]:
        return tuple(w for w in self.workers if w.role == "eval")

    @property
    def colocated(self) -> bool:
        """True when every eval worker shares a device with a train worker (and there is one)."""
        train_devices = {(w.node, w.device) for w in self.train}
        evals = self.eval
        return bool(evals) and all((w.node, w.device) in train_devices for w in evals)

    def placement_info(self) -> dict[str, dict[str, list[Hashable]]]:
        """The seed's ``{node_id: {"train_policies": [...], "eval_policies": [...]}}``.

        Nodes appear in the order the seed meets them: train workers first, then eval workers.
        """
        info: dict[str, dict[str, list[Hashable]]] = {}
        for role, key in (("train", "train_policies"), ("eval", "eval_policies")):
            for w in self.workers:
                if w.role != role:
                    continue
                entry = info.setdefault(w.node, {"train_policies": [], "eval_policies": []})
                entry[key].append(w.worker_id)
        return info

    def ray_bundles(self) -> list[dict[str, float]]:
        """Bundle dicts for ``ray.util.placement_group``."""
        return [b.to_ray() for b in self.bundles]

    def bundle_index(self, worker_id: Hashable) -> int:
        for w in self.workers:
            if w.worker_id == worker_id:
                if w.bundle_index is None:
                    raise PlacementError(f"worker {worker_id!r} has no bundle")
                return w.bundle_index
        raise PlacementError(f"unknown worker {worker_id!r}")

    def placement_group_spec(self) -> dict[str, Any]:
        """``{"bundles": [...], "strategy": ..., "bundle_index": [[worker_id, index], ...]}``."""
        return {
            "bundles": self.ray_bundles(),
            "strategy": self.strategy,
            "bundle_index": [[w.worker_id, w.bundle_index] for w in self.workers],
        }

    @classmethod
    def from_bundles(
        cls,
        nodes: Sequence[str],
        specs: Sequence[Mapping[str, float]],
        n_train: int,
        n_eval: int,
        bundle_indices: Sequence[int] | None = None,
        colocated: bool = False,
        strategy: str | None = None,
    ) -> Placement:
        """Workers in a placement group someone else made: bundle ``i`` (``specs[i]``, Ray's
        ``{"CPU": .., "GPU": ..}``) on ``nodes[i]``, worker k (trainers first) in bundle
        ``bundle_indices[k]``.

        Default: trainers on bundles 0.., rollout workers after them (colocated: rollout worker i
        shares bundle i with trainer i). A bundle with GPUs is a "gpu" device holding them all; a
        `strategy` that is not Ray's is recorded as None.
        """
        _check_count("n_train", n_train)
        _check_count("n_eval", n_eval)
        if len(nodes) != len(specs):
            raise PlacementError(f"{len(nodes)} bundle nodes for {len(specs)} bundle specs")
        indices = _bundle_indices(bundle_indices, n_train, n_eval, len(specs), colocated)
        bundles = [
            Bundle(
                str(node),
                f"{'gpu' if spec.get('GPU') else 'cpu'}-bundle{i}",
                float(spec.get("CPU", 0.0)),
                float(spec.get("GPU", 0.0)),
            )
            for i, (node, spec) in enumerate(zip(nodes, specs, strict=True))
        ]
        workers = [
            WorkerPlacement(wid, role, bundles[b].node, bundles[b].device, b)
            for (wid, role), b in zip(_worker_ids(n_train, n_eval), indices, strict=True)
        ]
        return cls(tuple(workers), strategy if strategy in RAY_STRATEGIES else None, tuple(bundles))

    def bundle_label_selectors(self) -> list[dict[str, str]]:
        """Ray's per-bundle label selectors that keep each bundle on its planned node."""
        return [{NODE_ID_LABEL: bundle.node} for bundle in self.bundles]

    def _sharers(self) -> Counter[int]:
        return Counter(w.bundle_index for w in self.workers if w.bundle_index is not None)

    def worker_resources(self, worker: WorkerPlacement, cpus: float) -> tuple[float, float]:
        """(CPUs, GPUs) `worker` asks of its bundle: its even share of the bundle's GPUs, and
        `cpus` capped at its share of the bundle's CPUs."""
        if worker.bundle_index is None:
            raise PlacementError(f"worker {worker.worker_id!r} has no bundle in the plan")
        bundle = self.bundles[worker.bundle_index]
        share = self._sharers()[worker.bundle_index]
        return min(max(cpus, 0.0), bundle.cpu / share), bundle.gpu / share

    def worker_gpus(self) -> dict[str, float]:
        """GPUs of each worker with a bundle (by id): its share of its bundle's GPUs (a
        tensor-parallel rollout instance alone in a bundle of four GPUs has 4.0)."""
        sharers = self._sharers()
        return {
            str(w.worker_id): self.bundles[w.bundle_index].gpu / sharers[w.bundle_index]
            for w in self.workers
            if w.bundle_index is not None
        }

    def start_order(self) -> tuple[WorkerPlacement, ...]:
        """The workers in the order their processes start: trainers first, each role by index
        (the number ending the id, as in ``train-0``, ``eval-1``)."""
        return tuple(sorted(self.workers, key=lambda w: (w.role != "train", _role_index(w))))

    def check_bundle_nodes(self, actual: Sequence[str]) -> None:
        """PlacementError naming each bundle (its workers, both nodes) whose node in `actual`
        (one per bundle, as Ray reports them) is not the planned one."""
        if len(actual) != len(self.bundles):
            raise PlacementError(
                f"the placement group has {len(actual)} bundles, the plan {len(self.bundles)}"
            )
        wrong = [self._misplaced(i, node) for i, node in enumerate(actual) if node != self.bundles[i].node]
        if wrong:
            raise PlacementError(
                "Ray did not put the placement group's bundles where the plan needs them: "
                + "; ".join(wrong)
                + " (the sync plan would pair the wrong workers on a node)"
            )

    def _misplaced(self, index: int, actual: str) -> str:
        who = [str(w.worker_id) for w in self.workers if w.bundle_index == index]
        planned = self.bundles[index].node
        return f"bundle {index} (workers {who}) is on node {actual[:12]}, planned on node {planned[:12]}"

    def check_worker_nodes(self, actual: Mapping[Hashable, str]) -> None:
        """PlacementError naming each worker whose node in `actual` (by worker id, where its
        process runs) is not its planned one, or that `actual` leaves out."""
        missing = [w.worker_id for w in self.workers if w.worker_id not in actual]
        if missing:
            raise PlacementError(f"no node reported for workers {missing}")
        wrong = [
            f"{w.worker_id} runs on node {str(actual[w.worker_id])[:12]}, "
            f"its bundle {w.bundle_index} was planned on node {w.node[:12]}"
            for w in self.workers
            if actual[w.worker_id] != w.node
        ]
        if wrong:
            raise PlacementError("workers are not on their planned nodes: " + "; ".join(wrong))

    def validate(self, topology: Topology) -> None:
        """Raise PlacementError naming the first worker whose node or device is not in ``topology``."""
        for w in self.workers:
            try:
                topology.device_vertex(w.node, w.device)
            except PlacementError as exc:
                raise PlacementError(f"worker {w.worker_id!r}: {exc}") from None


def _check_count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PlacementError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _bundle_indices(
    indices: Sequence[int] | None, n_train: int, n_eval: int, count: int, colocated: bool
) -> list[int]:
    """The bundle of each worker (trainers first): `indices` checked, or the default."""
    if indices is None:
        evals = range(n_eval) if colocated else range(n_train, n_train + n_eval)
        indices = [*range(n_train), *evals]
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
        raise TypeError(f"bundle_indices must be a sequence of ints, got {type(indices).__name__}")
    need = n_train + n_eval
    if len(indices) != need:
        raise PlacementError(
            f"bundle_indices names {len(indices)} bundles, one per worker is needed ({need}: trainers first)"
        )
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
            raise PlacementError(
                f"bundle_indices: {i!r} is not a bundle of this placement group (it has {count})"
            )
    return list(indices)


def _worker_ids(n_train: int, n_eval: int) -> list[tuple[str, str]]:
    """(id, role) of every worker, trainers first: ``train-0``, ..., ``eval-0``, ..."""
    return [(f"train-{i}", "train") for i in range(n_train)] + [(f"eval-{i}", "eval") for i in range(n_eval)]


def _role_index(worker: WorkerPlacement) -> int:
    tail = str(worker.worker_id).rsplit("-", 1)[-1]
    if not (tail.isascii() and tail.isdigit()):
        raise PlacementError(
            f"worker {worker.worker_id!r}: a start order needs ids ending in their index (train-0, eval-1)"
        )
    return int(tail)


def _check_cpus(value: object) -> float:
    """A bundle's CPU share: a finite number > 0 (Ray rejects 0, negative and NaN CPU requests)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise PlacementError(f"cpus_per_worker must be a positive finite number, got {value!r}")
    return float(value)


def _slots(topology: Topology, device_kind: str) -> list[tuple[str, str]]:
    return [(d.node, d.id) for d in topology.devices(kind=device_kind)]


def _capacity_error(need: int, what: str, topology: Topology, device_kind: str) -> CapacityError:
    have = len(topology.devices(kind=device_kind))
    return CapacityError(
        f"need {need} {device_kind} devices for {what}, topology has {have} on {len(topology.nodes)} nodes "
        f"(short by {need - have})"
    )


def _build(
    workers: Sequence[tuple[Hashable, str, str, str]], strategy: str, cpus_per_worker: float, device_kind: str
) -> Placement:
    """One bundle per distinct device, in first-use order, sized for the workers that share it."""
    index: dict[tuple[str, str], int] = {}
    count: list[int] = []
    slots: list[tuple[str, str]] = []
    for _wid, _role, node, dev in workers:
        key = (node, dev)
        if key not in index:
            index[key] = len(slots)
            slots.append(key)
            count.append(0)
        count[index[key]] += 1
    gpu = 1.0 if device_kind == "gpu" else 0.0
    bundles = tuple(Bundle(n, d, cpus_per_worker * c, gpu) for (n, d), c in zip(slots, count, strict=True))
    placed = tuple(WorkerPlacement(wid, role, n, d, index[(n, d)]) for wid, role, n, d in workers)
    return Placement(placed, strategy, bundles)


@public
def place_colocated(
    topology: Topology,
    n_train: int,
    n_eval: int,
    *,
    cpus_per_worker: float = 1.0,
    device_kind: str = "gpu",
) -> Placement:
    """Eval worker ``i`` shares the device (and bundle) of train worker ``i``, as the seed assumes.

    Train workers fill devices node by node. Needs ``n_eval <= n_train`` (the seed's assert).
    """
    _check_count("n_train", n_train)
    _check_count("n_eval", n_eval)
    _check_cpus(cpus_per_worker)
    if n_eval > n_train:
        raise ColocatedSizeError(
            f"colocated placement needs n_train >= n_eval, got n_train={n_train}, n_eval={n_eval}"
        )
    slots = _slots(topology, device_kind)
    if n_train > len(slots):
        raise _capacity_error(n_train, f"{n_train} colocated train workers", topology, device_kind)
    workers = [(f"train-{i}", "train", *slots[i]) for i in range(n_train)]
    workers += [(f"eval-{i}", "eval", *slots[i]) for i in range(n_eval)]
    return _build(workers, "PACK", cpus_per_worker, device_kind)


@public
def place_disaggregated(
    topology: Topology,
    n_train: int,
    n_eval: int,
    *,
    mode: str = "packed",
    cpus_per_worker: float = 1.0,
    device_kind: str = "gpu",
) -> Placement:
    """Train and eval workers on distinct devices.

    ``"packed"``: train workers fill devices node by node, then eval workers continue on the next free
    devices (fewest nodes; whole nodes per role when counts are multiples of the node size).
    ``"spread"``: workers are dealt round-robin over nodes (train first, then eval), so each role is
    spread over as many nodes as possible and most nodes hold both roles.
    """
    _check_count("n_train", n_train)
    _check_count("n_eval", n_eval)
    _check_cpus(cpus_per_worker)
    if mode not in ("packed", "spread"):
        raise PlacementError(f"mode must be 'packed' or 'spread', got {mode!r}")
    need = n_train + n_eval
    slots = _slots(topology, device_kind)
    if need > len(slots):
        raise _capacity_error(need, f"{n_train} train + {n_eval} eval workers", topology, device_kind)
    ids = _worker_ids(n_train, n_eval)
    if mode == "packed":
        workers = [(wid, role, *slots[i]) for i, (wid, role) in enumerate(ids)]
        nodes_used = {slots[i][0] for i in range(need)}
        strategy = "STRICT_PACK" if len(nodes_used) <= 1 else "PACK"
    else:
        free: dict[str, list[str]] = {}
        for node, dev in slots:
            free.setdefault(node, []).append(dev)
        order = [n for n in topology.nodes if n in free]
        cursor = dict.fromkeys(order, 0)
        workers = []
        k = 0
        for wid, role in ids:
            while cursor[order[k % len(order)]] >= len(free[order[k % len(order)]]):
                k += 1
            node = order[k % len(order)]
            workers.append((wid, role, node, free[node][cursor[node]]))
            cursor[node] += 1
            k += 1
        strategy = "SPREAD"
    return _build(workers, strategy, cpus_per_worker, device_kind)
