"""PolicyGroup on a 3-node Ray cluster: 2 train + 4 eval actors shared by every test here.

Layout: node0: train0, eval0 | node1: train1, eval1 | node2: eval2, eval3. Disaggregated plans
then mix shared-memory items (node0, node1) and a cross-node broadcast (to node2); colocated
plans pair train i with eval i on one node. The fault tests kill actors and so run last.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

import pg_policies  # noqa: E402
from pg_policies import OBS_DIM, MLPPolicy, make_model  # noqa: E402
from testkit import node_ids  # noqa: E402

from rlfleet.policygroup import (  # noqa: E402
    BatchedData,
    CommGroupError,
    PolicyConfig,
    PolicyGroup,
    TrainConfig,
    TrainWorkerDiedError,
    WeightBufferConfig,
)

pytestmark = pytest.mark.timeout(300)
ray.cloudpickle.register_pickle_by_value(pg_policies)  # the workers need not import tests/

STRATEGIES = [
    ("None", "WeightBuffer"),
    ("Double", "WeightBuffer"),
    ("Shared", "CPUWeightBuffer"),
    ("Sharded", "ShardedWeightBuffer"),
]
PLACES = {
    "train0": "node0",
    "train1": "node1",
    "eval0": "node0",
    "eval1": "node1",
    "eval2": "node2",
    "eval3": "node2",
}


def config(strategy: str = "Double", kind: str = "WeightBuffer", **kw: Any) -> PolicyConfig:
    return PolicyConfig(
        weight_buffer=WeightBufferConfig(type=kind, buffer_strategy=strategy, bucket_bytes=4096),
        group_timeout_s=20.0,
        sync_timeout_s=60.0,
        rpc_timeout_s=60.0,
        drain_timeout_s=30.0,
        **kw,
    )


@pytest.fixture(scope="module")
def actors(cluster: Any) -> dict[str, Any]:
    remote = ray.remote(MLPPolicy)
    out = {}
    for name, node in PLACES.items():
        role = "train" if name.startswith("train") else "eval"
        out[name] = remote.options(num_cpus=0, max_concurrency=16, resources={node: 1}).remote(
            config=config(), role=role, index=int(name[-1])
        )
    ray.get([a.is_alive.remote() for a in out.values()], timeout=240)
    return out


def make_group(
    actors: dict[str, Any],
    cfg: PolicyConfig,
    colocated: bool = False,
    evals: tuple[str, ...] = ("eval0", "eval1", "eval2", "eval3"),
) -> PolicyGroup:
    group = PolicyGroup([actors["train0"], actors["train1"]], [actors[e] for e in evals], cfg)
    group.init(TrainConfig(lr=1e-2))
    group.init_placement_info(is_colocated=colocated)
    group.init_weight_buffer()
    group.init_comm_group("gloo", is_colocated=colocated)
    group.sync_weights()  # rollout workers start from the trainers' weights (they served other groups before)
    return group


def obs(n: int, seed: int = 0) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, OBS_DIM, generator=g).tolist()


def trainer_logits(group: PolicyGroup, batch: list[list[float]]) -> torch.Tensor:
    model = make_model()
    state = ray.get(group.train_list[0].get_state_dict.remote(), timeout=60)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(torch.tensor(batch))


def check_synced(group: PolicyGroup) -> None:
    ref = ray.get(group.train_list[0].get_weight_checksum.remote(), timeout=60)
    sums = ray.get([p.get_weight_checksum.remote() for p in group.eval_list], timeout=60)
    assert sums == [ref] * len(sums)
    for trainer in group.train_list[1:]:  # DDP keeps trainers equal
        assert ray.get(trainer.get_weight_checksum.remote(), timeout=60) == ref
    assert group.verify_eval_weight_checksums()
    assert group.verify_eval_weight_consistency()
    assert group.eval_weight_versions() == [group.weight_version] * len(group.eval_list)


def rollout_values(group: PolicyGroup, batch: list[list[float]], ids: list[str] | None = None) -> list[Any]:
    ids = ids or [f"env-{i}" for i in range(len(batch))]
    resp = group.rollout_batch(BatchedData(ids, batch))
    assert resp.ids() == ids
    return list(ray.get(resp.values(), timeout=60))


def train_sync_and_check(group: PolicyGroup, step: int) -> None:
    before = group.weight_version
    info = group.train(None, seed=step)
    assert "loss" in info
    batch = obs(12, seed=step)
    stale = rollout_values(group, batch)
    expected = trainer_logits(group, batch)
    assert not torch.allclose(torch.tensor([r["logits"] for r in stale]), expected)
    group.sync_weights()
    assert group.weight_version == before + 1
    check_synced(group)
    fresh = rollout_values(group, batch)
    assert {r["version"] for r in fresh} == {group.weight_version}
    torch.testing.assert_close(torch.tensor([r["logits"] for r in fresh]), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("strategy", "kind"), STRATEGIES)
def test_sync_disaggregated_every_strategy(actors: dict[str, Any], strategy: str, kind: str) -> None:
    group = make_group(actors, config(strategy, kind))
    try:
        nodes = {group.node_of(p) for p in group.eval_list}
        assert len(nodes) == 3
        assert any(s.transport == "broadcast" for s in group._sync.steps), (
            "node2 has no trainer: weights cross nodes"
        )
        for step in (1, 2):
            train_sync_and_check(group, step)
    finally:
        group.shutdown()


@pytest.mark.parametrize(("strategy", "kind"), STRATEGIES)
def test_sync_colocated_every_strategy(actors: dict[str, Any], strategy: str, kind: str) -> None:
    group = make_group(actors, config(strategy, kind), colocated=True, evals=("eval0", "eval1"))
    try:
        assert set(group.transfer_info) == {"all"}
        assert all(s.transport == "node_buffer" for s in group._sync.steps)  # each pair shares a node
        train_sync_and_check(group, 3)
    finally:
        group.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_node_affinity_routing(actors: dict[str, Any], mode: str) -> None:
    # env workers 0-3 run on node0, 4-7 on node1, 8-11 on node2 (the seed's component_distribution)
    dist = {
        "node0": {"env": {"ids": [0, 1, 2, 3]}, "eval": {"ids": [0]}},
        "node1": {"env": {"ids": [4, 5, 6, 7]}, "eval": {"ids": [1]}},
        "node2": {"env": {"ids": [8, 9, 10, 11]}, "eval": {"ids": [2, 3]}},
    }
    group = make_group(
        actors, config(rollout_mode=mode, router_type="node_affinity", component_distribution=dist)
    )
    try:
        ids = [f"env-{i}" for i in range(12)]
        real = node_ids()
        for _ in range(3):
            out = rollout_values(group, obs(12), ids)
            for i, r in enumerate(out):
                assert r["node"] == real[f"node{i // 4}"], (i, r["worker"])
        assert group.wait_idle() == 0  # released on completion, by callback
    finally:
        group.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_least_load_routing_spreads_and_releases(actors: dict[str, Any], mode: str) -> None:
    group = make_group(actors, config(rollout_mode=mode))
    try:
        out = rollout_values(group, obs(40))
        per_worker: dict[int, int] = {}
        for r in out:
            per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
        assert sorted(per_worker.values()) == [10, 10, 10, 10]
        assert group.wait_idle() == 0
    finally:
        group.shutdown()


def test_rolling_update_keeps_serving(actors: dict[str, Any]) -> None:
    group = make_group(actors, config("Double"))
    try:
        group.train(None, seed=7)
        errors: list[BaseException] = []
        seen: list[int] = []
        stop = threading.Event()

        def serve() -> None:
            try:
                while not stop.is_set():
                    seen.extend(r["version"] for r in rollout_values(group, obs(8)))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            v0 = group.weight_version
            group.sync_weights()
        finally:
            stop.set()
            thread.join(120)
        assert not errors
        assert set(seen) <= {v0, v0 + 1}
        check_synced(group)
    finally:
        group.shutdown()


def test_role_conversion(actors: dict[str, Any]) -> None:
    group = make_group(actors, config("Double"))
    try:
        group.train(None, seed=11)
        group.sync_weights()
        group.convert_train_to_eval(1)
        assert len(group.train_list) == 1
        assert len(group.eval_list) == 5
        assert ray.get(group.eval_list[-1].get_role.remote(), timeout=30) == "eval"
        check_synced(group)
        assert len(rollout_values(group, obs(10))) == 10
        group.train(None, seed=12)
        group.sync_weights()
        check_synced(group)
        group.convert_eval_to_train(1)
        assert len(group.train_list) == 2
        assert len(group.eval_list) == 4
        assert ray.get(group.train_list[-1].get_role.remote(), timeout=30) == "train"
        check_synced(group)
        train_sync_and_check(group, 13)  # DDP over the rebuilt train group keeps both trainers equal
    finally:
        group.shutdown()


def test_comm_group_names_the_rank_that_did_not_join(actors: dict[str, Any]) -> None:
    a, b = actors["train0"], actors["eval2"]
    addr, port = ray.get(a._get_addr_and_port.remote(), timeout=30)
    refs = [
        p.init_distributed_env.remote(
            rank=r,
            world_size=3,
            local_rank=0,
            local_world_size=1,
            master_addr=addr,
            master_port=port,
            backend="gloo",
            timeout_s=3.0,
            epoch="missing",
        )
        for r, p in enumerate((a, b))
    ]
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref, timeout=60)
        assert isinstance(info.value.cause, CommGroupError)
        assert "rank(s) [2] did not join" in str(info.value.cause)
        assert info.value.cause.missing_ranks == (2,)


def test_zz_dead_eval_is_dropped_and_sync_completes(actors: dict[str, Any]) -> None:
    group = make_group(actors, config("Double"))
    try:
        group.train(None, seed=21)
        victim = actors["eval3"]
        ray.kill(victim, no_restart=True)
        group.sync_weights()  # detects the death, re-plans, syncs the survivors
        assert len(group.eval_list) == 3
        assert all(p is not victim for p in group.eval_list)
        check_synced(group)
        out = rollout_values(group, obs(9))
        assert {r["worker"] for r in out} == {0, 1, 2}
        # now one dies between syncs while rollouts are routed: it is dropped from routing too
        ray.kill(actors["eval2"], no_restart=True)
        resp = group.rollout_batch(BatchedData([f"env-{i}" for i in range(8)], obs(8)))
        ray.wait(resp.values(), num_returns=8, timeout=60)
        group.train(None, seed=22)
        group.sync_weights()
        assert len(group.eval_list) == 2
        check_synced(group)
        assert {r["worker"] for r in rollout_values(group, obs(6))} == {0, 1}
    finally:
        group.shutdown()


def test_zzz_dead_train_worker_is_a_clear_error(actors: dict[str, Any]) -> None:
    group = make_group(actors, config("Double"), evals=("eval0", "eval1"))
    try:
        ray.kill(actors["train1"], no_restart=True)
        with pytest.raises(TrainWorkerDiedError, match="trainer 1"):
            group.sync_weights()
        with pytest.raises(TrainWorkerDiedError, match="trainer 1"):
            group.train(None, seed=1)
    finally:
        group.shutdown()
