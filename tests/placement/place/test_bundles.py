"""Workers in Ray placement-group bundles, as data: a caller's bundles read back as a plan, each
worker's share of its bundle, the label selectors that pin bundles, the checks that name every
bundle or worker Ray put elsewhere, the start order, and plans over ``ray.nodes()`` listings."""

from __future__ import annotations

from typing import Any

import pytest

from rlfleet.placement import (
    NODE_ID_LABEL,
    Bundle,
    CapacityError,
    Placement,
    PlacementError,
    TopologyError,
    WorkerPlacement,
    place_on_ray_nodes,
    ray_node_topology,
)

A, B, C = "a" * 56, "b" * 56, "c" * 56
CPU = {"CPU": 0.5}
TWO_GPUS = {"CPU": 1.0, "GPU": 2.0}


def where(placement: Placement) -> dict[str, tuple[str, int | None]]:
    return {str(w.worker_id): (w.node, w.bundle_index) for w in placement.workers}


def ray_node(
    node_id: str, cpus: float, gpus: float = 0.0, *, head: bool = False, alive: bool = True
) -> dict[str, Any]:
    """The keys of a ``ray.nodes()`` entry that placement reads."""
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    if head:
        resources["node:__internal_head__"] = 1.0
    return {"NodeID": node_id, "Alive": alive, "Resources": resources}


def test_from_bundles_places_workers_in_the_named_bundles() -> None:
    placement = Placement.from_bundles([A, B, C], [CPU, CPU, CPU], 1, 2, [2, 0, 1], strategy="SPREAD")
    assert where(placement) == {"train-0": (C, 2), "eval-0": (A, 0), "eval-1": (B, 1)}
    assert placement.strategy == "SPREAD"
    assert [b.device for b in placement.bundles] == ["cpu-bundle0", "cpu-bundle1", "cpu-bundle2"]
    assert placement.ray_bundles() == [{"CPU": 0.5}] * 3


def test_from_bundles_defaults_trainers_first_then_rollout_workers() -> None:
    placement = Placement.from_bundles([A, A, B, B], [CPU] * 4, 2, 2)
    assert where(placement) == {"train-0": (A, 0), "train-1": (A, 1), "eval-0": (B, 2), "eval-1": (B, 3)}
    assert placement.strategy is None  # none given
    colocated = Placement.from_bundles([A, B], [CPU, CPU], 2, 1, colocated=True, strategy="not-a-ray-one")
    assert where(colocated) == {"train-0": (A, 0), "train-1": (B, 1), "eval-0": (A, 0)}
    assert colocated.strategy is None  # a strategy Ray does not name is not recorded
    assert colocated.colocated


def test_a_multi_gpu_bundle_is_one_gpu_device_its_worker_holds() -> None:
    placement = Placement.from_bundles([A, B, B], [CPU, TWO_GPUS, TWO_GPUS], 1, 2, strategy="PACK")
    assert [(b.device, b.gpu) for b in placement.bundles] == [
        ("cpu-bundle0", 0.0),
        ("gpu-bundle1", 2.0),
        ("gpu-bundle2", 2.0),
    ]
    assert placement.worker_gpus() == {"train-0": 0.0, "eval-0": 2.0, "eval-1": 2.0}
    rollout = placement.eval[0]
    assert placement.worker_resources(rollout, 4.0) == (1.0, 2.0)  # CPUs capped at its bundle's
    assert placement.worker_resources(rollout, 0.25) == (0.25, 2.0)
    assert placement.worker_resources(rollout, -1.0) == (0.0, 2.0)


def test_workers_sharing_a_bundle_split_it_evenly() -> None:
    placement = Placement.from_bundles([A], [{"CPU": 0.2, "GPU": 1.0}], 1, 1, colocated=True)
    assert placement.worker_gpus() == {"train-0": 0.5, "eval-0": 0.5}
    assert placement.worker_resources(placement.train[0], 1.0) == (0.1, 0.5)


def test_bad_bundle_indices_are_named() -> None:
    with pytest.raises(
        PlacementError, match=r"names 2 bundles, one per worker is needed \(3: trainers first\)"
    ):
        Placement.from_bundles([A, B], [CPU, CPU], 1, 2, [0, 1])
    with pytest.raises(PlacementError, match=r"5 is not a bundle of this placement group \(it has 2\)"):
        Placement.from_bundles([A, B], [CPU, CPU], 1, 1, [0, 5])
    with pytest.raises(PlacementError, match="-1 is not a bundle"):
        Placement.from_bundles([A, B], [CPU, CPU], 1, 1, [0, -1])
    with pytest.raises(PlacementError, match="True is not a bundle"):
        Placement.from_bundles([A, B], [CPU, CPU], 1, 1, [0, True])
    with pytest.raises(TypeError, match="sequence of ints, got str"):
        Placement.from_bundles([A, B], [CPU, CPU], 1, 1, "01")  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="not a bundle"):  # default indices past the group's end
        Placement.from_bundles([A], [CPU], 1, 1)
    with pytest.raises(PlacementError, match="2 bundle nodes for 1 bundle specs"):
        Placement.from_bundles([A, B], [CPU], 1, 0)
    with pytest.raises(PlacementError, match="n_eval must be a non-negative int"):
        Placement.from_bundles([A], [CPU], 1, -1)


def test_label_selectors_pin_each_bundle_to_its_planned_node() -> None:
    placement = Placement.from_bundles([A, B], [CPU, CPU], 1, 1)
    assert placement.bundle_label_selectors() == [{NODE_ID_LABEL: A}, {NODE_ID_LABEL: B}]
    assert NODE_ID_LABEL == "ray.io/node-id"


def test_a_bundle_on_another_node_is_named_with_its_workers_and_both_nodes() -> None:
    placement = Placement.from_bundles([A, B], [CPU, CPU], 1, 2, [0, 1, 1])
    placement.check_bundle_nodes([A, B])  # as planned
    with pytest.raises(PlacementError, match="bundle 1") as caught:
        placement.check_bundle_nodes([A, C])
    message = str(caught.value)
    assert f"(workers ['eval-0', 'eval-1']) is on node {C[:12]}, planned on node {B[:12]}" in message
    assert "bundle 0" not in message
    assert "the sync plan would pair the wrong workers" in message
    with pytest.raises(PlacementError, match="the placement group has 3 bundles, the plan 2"):
        placement.check_bundle_nodes([A, B, C])


def test_a_worker_on_another_node_is_named() -> None:
    placement = Placement.from_bundles([A, B], [CPU, CPU], 1, 1)
    placement.check_worker_nodes({"train-0": A, "eval-0": B})
    with pytest.raises(PlacementError, match="not on their planned nodes") as caught:
        placement.check_worker_nodes({"train-0": A, "eval-0": C})
    assert f"eval-0 runs on node {C[:12]}, its bundle 1 was planned on node {B[:12]}" in str(caught.value)
    assert "train-0" not in str(caught.value)
    with pytest.raises(PlacementError, match=r"no node reported for workers \['eval-0'\]"):
        placement.check_worker_nodes({"train-0": A})


def test_start_order_is_trainers_first_then_by_index() -> None:
    workers = [
        WorkerPlacement("eval-1", "eval", A, "d0"),
        WorkerPlacement("train-10", "train", A, "d0"),
        WorkerPlacement("eval-0", "eval", A, "d0"),
        WorkerPlacement("train-2", "train", A, "d0"),
    ]
    order = [w.worker_id for w in Placement(tuple(workers)).start_order()]
    assert order == ["train-2", "train-10", "eval-0", "eval-1"]
    odd = Placement((WorkerPlacement("trainer", "train", A, "d0"),))
    with pytest.raises(PlacementError, match="'trainer': a start order needs ids ending in their index"):
        odd.start_order()


def test_a_worker_without_a_bundle_has_no_resources_to_ask() -> None:
    placement = Placement(
        (WorkerPlacement("train-0", "train", A, "d0"), WorkerPlacement("eval-0", "eval", A, "d0", 0)),
        bundles=(Bundle(A, "d0", 1.0, 1.0),),
    )
    assert placement.worker_gpus() == {"eval-0": 1.0}
    with pytest.raises(PlacementError, match="'train-0' has no bundle in the plan"):
        placement.worker_resources(placement.train[0], 1.0)


def test_ray_node_topology_gives_each_alive_node_its_slots() -> None:
    nodes = [ray_node(B, 8.0), ray_node(A, 4.0, head=True), ray_node(C, 8.0, alive=False)]
    topology = ray_node_topology(nodes, slots_per_node=3)
    assert topology.nodes == (A, B)  # alive only, head first
    assert [len(topology.devices(n, kind="cpu")) for n in topology.nodes] == [3, 3]
    gpus = ray_node_topology(nodes, nodes=[B], slots_per_node=2, device_kind="gpu")
    assert gpus.nodes == (B,)
    assert len(gpus.devices(B, kind="gpu")) == 2
    with pytest.raises(TopologyError, match="not alive"):
        ray_node_topology(nodes, nodes=[C])
    with pytest.raises(TopologyError, match="unknown override"):
        ray_node_topology(nodes, overrides={"nic_speed": 1})


def test_place_on_ray_nodes_spreads_the_workers_that_need_a_device() -> None:
    nodes = [ray_node(A, 4.0, head=True), ray_node(B, 4.0), ray_node(C, 4.0, alive=False)]
    packed = place_on_ray_nodes(nodes, 2, 2, cpus_per_worker=0.5)  # 4 workers, 2 alive nodes: 2 slots each
    assert where(packed) == {"train-0": (A, 0), "train-1": (A, 1), "eval-0": (B, 2), "eval-1": (B, 3)}
    assert [b.cpu for b in packed.bundles] == [0.5] * 4
    spread = place_on_ray_nodes(nodes, 2, 2, mode="spread")
    assert {w.node for w in spread.train} == {A, B}
    colocated = place_on_ray_nodes(nodes, 2, 2, colocated=True)  # 2 trainers need a slot each
    assert [w.node for w in colocated.workers] == [A, B, A, B]
    assert colocated.colocated
    only_b = place_on_ray_nodes(nodes, 1, 2, nodes=[B])
    assert {w.node for w in only_b.workers} == {B}
    with pytest.raises(CapacityError, match="short by 2"):
        place_on_ray_nodes(nodes, 2, 2, slots_per_node=1)
    with pytest.raises(TopologyError, match="NodeID"):
        place_on_ray_nodes([{"Alive": True}], 1, 1)
