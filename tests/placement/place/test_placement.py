"""Placement strategies and the Ray bundle specs they produce (as plain data, no Ray)."""

from __future__ import annotations

import json

import pytest

from rlfleet.placement import (
    Bundle,
    CapacityError,
    ColocatedSizeError,
    Placement,
    PlacementError,
    Topology,
    WorkerPlacement,
    place_colocated,
    place_disaggregated,
)


def test_packed_fills_whole_nodes_per_role() -> None:
    topo = Topology.synthetic(8, 8)
    p = place_disaggregated(topo, 16, 48)
    assert p.strategy == "PACK"
    assert {w.node for w in p.train} == {"node0", "node1"}
    assert {w.node for w in p.eval} == {f"node{i}" for i in range(2, 8)}
    assert p.ray_bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 64
    assert [w.bundle_index for w in p.workers] == list(range(64))
    assert p.bundle_index("eval-0") == 16
    assert p.bundles[16] == Bundle("node2", "gpu0", 1.0, 1.0)
    assert not p.colocated
    spec = p.placement_group_spec()
    assert spec["strategy"] == "PACK"
    assert len(spec["bundles"]) == 64
    json.dumps(spec)


def test_packed_shares_the_boundary_node_and_strict_packs_one_node() -> None:
    topo = Topology.synthetic(2, 4)
    p = place_disaggregated(topo, 3, 2)
    assert [(w.worker_id, w.node, w.device) for w in p.workers] == [
        ("train-0", "node0", "gpu0"),
        ("train-1", "node0", "gpu1"),
        ("train-2", "node0", "gpu2"),
        ("eval-0", "node0", "gpu3"),
        ("eval-1", "node1", "gpu0"),
    ]
    assert place_disaggregated(topo, 2, 2).strategy == "STRICT_PACK"


def test_spread_deals_workers_round_robin() -> None:
    topo = Topology.synthetic(4, 8)
    p = place_disaggregated(topo, 8, 8, mode="spread")
    assert p.strategy == "SPREAD"
    for node in topo.nodes:
        assert sum(w.node == node for w in p.train) == 2
        assert sum(w.node == node for w in p.eval) == 2
    assert len({(w.node, w.device) for w in p.workers}) == 16
    # uneven nodes: a full node is skipped
    uneven = Topology.from_spec(
        {
            "nodes": [
                {"id": "a", "devices": [{"id": "g0"}]},
                {"id": "b", "devices": [{"id": "g0"}, {"id": "g1"}, {"id": "g2"}]},
            ]
        }
    )
    q = place_disaggregated(uneven, 2, 2, mode="spread")
    assert [(w.node, w.device) for w in q.workers] == [("a", "g0"), ("b", "g0"), ("b", "g1"), ("b", "g2")]


def test_colocated_pairs_eval_i_with_train_i() -> None:
    topo = Topology.synthetic(2, 4)
    p = place_colocated(topo, 6, 4)
    assert p.colocated
    for i in range(4):
        t, e = p.workers[i], p.workers[6 + i]
        assert (t.node, t.device, t.bundle_index) == (e.node, e.device, e.bundle_index)
    assert len(p.bundles) == 6
    assert p.ray_bundles()[0] == {"CPU": 2.0, "GPU": 1.0}
    assert p.ray_bundles()[5] == {"CPU": 1.0, "GPU": 1.0}
    assert p.strategy == "PACK"


def test_capacity_errors_say_what_is_short() -> None:
    topo = Topology.synthetic(4, 8)
    with pytest.raises(CapacityError, match=r"need 40 gpu devices.*32 train \+ 8 eval.*has 32.*short by 8"):
        place_disaggregated(topo, 32, 8)
    with pytest.raises(CapacityError, match="short by 1"):
        place_colocated(topo, 33, 1)
    with pytest.raises(ColocatedSizeError) as info:
        place_colocated(topo, 2, 3)
    assert isinstance(info.value, AssertionError)
    assert isinstance(info.value, ValueError)
    with pytest.raises(CapacityError, match="cpu devices"):
        place_disaggregated(topo, 1, 0, device_kind="cpu")
    with pytest.raises(PlacementError, match="mode"):
        place_disaggregated(topo, 1, 1, mode="random")
    with pytest.raises(PlacementError, match="n_train"):
        place_disaggregated(topo, -1, 1)


def test_placement_as_data_with_any_hashable_ids() -> None:
    workers = (
        WorkerPlacement(("eval", 0), "eval", "n1", "gpu0"),
        WorkerPlacement(7, "train", "n0", "gpu0"),
        WorkerPlacement(("eval", 1), "eval", "n0", "gpu1"),
        WorkerPlacement(8, "train", "n2", "gpu0"),
    )
    p = Placement(workers)
    # train workers are seen first, as in the seed
    assert p.placement_info() == {
        "n0": {"train_policies": [7], "eval_policies": [("eval", 1)]},
        "n2": {"train_policies": [8], "eval_policies": []},
        "n1": {"train_policies": [], "eval_policies": [("eval", 0)]},
    }
    assert list(p.placement_info()) == ["n0", "n2", "n1"]
    with pytest.raises(PlacementError, match="duplicate worker id 7"):
        Placement((*workers, WorkerPlacement(7, "eval", "n0", "gpu2")))
    with pytest.raises(PlacementError, match="role"):
        WorkerPlacement("w", "rollout", "n0", "gpu0")
    with pytest.raises(PlacementError, match="bundle_index"):
        Placement((WorkerPlacement("w", "train", "n0", "gpu0", 3),))
    with pytest.raises(PlacementError, match="strategy"):
        Placement((), strategy="CLOSE")
    with pytest.raises(PlacementError, match="no bundle"):
        p.bundle_index(7)
    with pytest.raises(PlacementError, match="unknown worker"):
        p.bundle_index(99)


def test_validate_names_the_worker() -> None:
    topo = Topology.synthetic(1, 2)
    good = Placement((WorkerPlacement("t", "train", "node0", "gpu1"),))
    good.validate(topo)
    with pytest.raises(PlacementError, match=r"worker 'e'.*'gpu5'"):
        Placement((WorkerPlacement("e", "eval", "node0", "gpu5"),)).validate(topo)
    with pytest.raises(PlacementError, match=r"worker 'e'.*'node3'"):
        Placement((WorkerPlacement("e", "eval", "node3", "gpu0"),)).validate(topo)


@pytest.mark.parametrize("cpus", [-1, 0, float("nan"), float("inf"), "1", True, None])
def test_cpus_per_worker_must_be_a_positive_finite_number(cpus: object) -> None:
    """Issue 15 item 17: -1 or NaN CPUs used to become bundles Ray cannot schedule."""
    topo = Topology.synthetic(2, 4)
    with pytest.raises(PlacementError, match="cpus_per_worker must be a positive finite number"):
        place_disaggregated(topo, 2, 2, cpus_per_worker=cpus)  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="cpus_per_worker"):
        place_colocated(topo, 2, 2, cpus_per_worker=cpus)  # type: ignore[arg-type]
    assert place_disaggregated(topo, 2, 2, cpus_per_worker=0.5).bundles[0].cpu == 0.5
