"""Placement as data: which worker runs where, and the Ray placement-group bundles that ask for it.

Nothing here imports Ray: bundles are plain dicts (``{"CPU": 1, "GPU": 1}``) and the strategy a
string, ready to pass to ``ray.util.placement_group(bundles, strategy=...)``. Ray chooses the node of
each bundle itself; the ``node`` recorded here is the plan, which the caller can check after the group
is ready (for example by reading each bundle's node id).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.placement._errors import CapacityError, ColocatedSizeError, PlacementError
from rlfleet.placement._topology import Topology

__all__ = [
    "ROLES",
    "Bundle",
    "Placement",
    "WorkerPlacement",
    "place_colocated",
    "place_disaggregated",
]

ROLES: tuple[str, ...] = ("train", "eval")
RAY_STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


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
    ids = [(f"train-{i}", "train") for i in range(n_train)] + [(f"eval-{i}", "eval") for i in range(n_eval)]
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
