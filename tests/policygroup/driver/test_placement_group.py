"""Ray placement groups: adopting one the caller made (multi-GPU bundles included), and the
check that every bundle is on its planned node, on a real multi-raylet Ray cluster.

The suite's 3-node cluster (`cluster`) gets one more raylet here with four logical GPUs (Ray
schedules GPUs as resources: a bundle of two GPUs is reserved and handed to the actor in it,
with no CUDA device needed), removed again at the end of the module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import pg_policies  # noqa: E402
from pg_policies import MLPPolicy  # noqa: E402
from ray.util.placement_group import (  # noqa: E402
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from testkit import node_ids, wait_until  # noqa: E402

from rlfleet.placement import Bundle, Placement, WorkerPlacement  # noqa: E402
from rlfleet.policygroup import (  # noqa: E402
    PolicyConfig,
    PolicyGroupError,
    WeightBufferConfig,
    build_policy_group,
)
from rlfleet.policygroup.driver._builder import check_bundle_nodes  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ray.cloudpickle.register_pickle_by_value(pg_policies)


def config() -> PolicyConfig:
    return PolicyConfig(
        weight_buffer=WeightBufferConfig(type="WeightBuffer", buffer_strategy="Double", bucket_bytes=4096),
        group_timeout_s=30.0,
        sync_timeout_s=60.0,
        rpc_timeout_s=60.0,
    )


def _alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())


@pytest.fixture(scope="module")
def gpu_node(cluster: Any) -> Iterator[str]:
    """A raylet with 4 logical GPUs (label "gpunode"), joined for this module only."""
    node = cluster.add_node(num_cpus=1, num_gpus=4, resources={"gpunode": 100})
    cluster.wait_for_nodes()
    node_id = node.node_id
    try:
        yield node_id
    finally:
        cluster.remove_node(node)
        end = time.monotonic() + 60
        while _alive(node_id) and time.monotonic() < end:  # later plans must not see it
            time.sleep(0.5)


def _on(label: str, cpu: float = 0.1, **more: float) -> dict[str, float]:
    """A bundle that can only go to the node carrying `label` (testkit's "node{i}" resources)."""
    return {"CPU": cpu, label: 0.01, **more}


def test_adopts_a_placement_group_the_caller_made_and_syncs(cluster: Any) -> None:
    nodes = node_ids()
    pg = placement_group([_on("node0"), _on("node1"), _on("node2")], strategy="SPREAD")
    try:
        group = build_policy_group(MLPPolicy, 1, 2, config(), placement_group=pg, bundle_indices=[2, 0, 1])
        try:
            where = {w.worker_id: (w.node, w.bundle_index) for w in group.placement.workers}
            assert where == {
                "train-0": (nodes["node2"], 2),
                "eval-0": (nodes["node0"], 0),
                "eval-1": (nodes["node1"], 1),
            }
            found = ray.get([a._get_node_id.remote() for a in group.train_list + group.eval_list], timeout=60)
            assert found == [nodes["node2"], nodes["node0"], nodes["node1"]]
            group.sync_weights()
            ref = ray.get(group.train_list[0].get_weight_checksum.remote(), timeout=60)
            assert ray.get([e.get_weight_checksum.remote() for e in group.eval_list], timeout=60) == [
                ref,
                ref,
            ]
            assert group.placement.worker_gpus() == {"train-0": 0.0, "eval-0": 0.0, "eval-1": 0.0}
        finally:
            group.shutdown()
        assert placement_group_table(pg)["state"] == "CREATED"  # the caller's group is the caller's
    finally:
        remove_placement_group(pg)


def test_a_multi_gpu_bundle_holds_one_tensor_parallel_rollout_worker(gpu_node: str) -> None:
    trainer = _on("node0")
    rollout = {"CPU": 0.1, "GPU": 2.0, "gpunode": 0.01}
    pg = placement_group([trainer, rollout, rollout], strategy="PACK")
    try:
        group = build_policy_group(MLPPolicy, 1, 2, config(), placement_group=pg, init=False)
        try:
            assert group.placement.worker_gpus() == {"train-0": 0.0, "eval-0": 2.0, "eval-1": 2.0}
            assert [w.node for w in group.placement.eval] == [gpu_node, gpu_node]
            assert [b.gpu for b in group.placement.bundles] == [0.0, 2.0, 2.0]
            ids = ray.get([e._get_gpu_ids.remote() for e in group.eval_list], timeout=60)
            assert [len(i) for i in ids] == [2, 2]  # Ray gave each instance both GPUs of its bundle
            assert not set(ids[0]) & set(ids[1])
        finally:
            group.shutdown()
    finally:
        remove_placement_group(pg)


def test_colocated_workers_split_their_bundle(gpu_node: str) -> None:
    pg = placement_group([{"CPU": 0.2, "GPU": 1.0, "gpunode": 0.01}], strategy="STRICT_PACK")
    try:
        group = build_policy_group(MLPPolicy, 1, 1, config(), placement_group=pg, colocated=True, init=False)
        try:
            assert group.placement.worker_gpus() == {"train-0": 0.5, "eval-0": 0.5}
            assert {w.bundle_index for w in group.placement.workers} == {0}
        finally:
            group.shutdown()
    finally:
        remove_placement_group(pg)


def test_a_bundle_on_another_node_than_planned_is_named(cluster: Any) -> None:
    nodes = node_ids()
    pg = placement_group([_on("node2")], strategy="PACK")
    try:
        planned_elsewhere = Placement(
            (WorkerPlacement("train-0", "train", nodes["node0"], "cpu0", 0),),
            "PACK",
            (Bundle(nodes["node0"], "cpu0", 0.1, 0.0),),
        )
        with pytest.raises(PolicyGroupError, match="bundle 0") as caught:
            check_bundle_nodes(pg, planned_elsewhere, 60.0)
        message = str(caught.value)
        assert nodes["node2"][:12] in message
        assert nodes["node0"][:12] in message
        assert "train-0" in message
    finally:
        remove_placement_group(pg)


def test_own_group_keeps_each_bundle_on_its_planned_node(cluster: Any) -> None:
    """The builder pins its bundles: planned on node1 while node1 has no room, the group stays
    pending and the build fails naming the node, instead of running the workers elsewhere."""
    nodes = node_ids()
    blocker = ray.remote(num_cpus=1, resources={"node1": 1})(MLPPolicy).remote(config=config())
    ray.get(blocker.is_alive.remote(), timeout=120)
    try:
        before = {p for p, t in placement_group_table().items() if t["state"] != "REMOVED"}
        cfg = config()
        cfg.train_num_cpus = cfg.eval_num_cpus = 0.5
        with pytest.raises(PolicyGroupError, match="not ready") as caught:
            build_policy_group(
                MLPPolicy,
                1,
                1,
                cfg,
                scheduling="placement_group",
                nodes=[nodes["node1"]],
                ready_timeout_s=5.0,
            )
        assert nodes["node1"][:12] in str(caught.value)

        def removed() -> bool:  # the pending group the build made is gone (its removal is async)
            return {p for p, t in placement_group_table().items() if t["state"] != "REMOVED"} <= before

        wait_until(removed, 30, "the pending placement group removed", interval_s=0.1)
    finally:
        ray.kill(blocker)
    group = build_policy_group(MLPPolicy, 1, 1, cfg, scheduling="placement_group", nodes=[nodes["node1"]])
    try:
        assert {w.node for w in group.placement.workers} == {nodes["node1"]}
        found = ray.get([a._get_node_id.remote() for a in group.train_list + group.eval_list], timeout=60)
        assert found == [nodes["node1"], nodes["node1"]]
    finally:
        group.shutdown()


def test_bad_bundle_indices_are_refused_before_any_actor(cluster: Any) -> None:
    pg = placement_group([_on("node0"), _on("node1")], strategy="PACK")
    try:
        with pytest.raises(ValueError, match="one per worker"):
            build_policy_group(MLPPolicy, 1, 2, config(), placement_group=pg, bundle_indices=[0, 1])
        with pytest.raises(ValueError, match="not a bundle"):
            build_policy_group(MLPPolicy, 1, 1, config(), placement_group=pg, bundle_indices=[0, 5])
        with pytest.raises(ValueError, match="pass the group"):
            build_policy_group(MLPPolicy, 1, 1, config(), bundle_indices=[0, 1])
        with pytest.raises(TypeError, match="PlacementGroup"):
            build_policy_group(MLPPolicy, 1, 1, config(), placement_group="pg-0")
        infeasible = placement_group([{"CPU": 64.0}])
        try:
            with pytest.raises(PolicyGroupError, match="not ready within"):
                build_policy_group(MLPPolicy, 1, 0, config(), placement_group=infeasible, ready_timeout_s=2.0)
        finally:
            remove_placement_group(infeasible)
    finally:
        remove_placement_group(pg)
