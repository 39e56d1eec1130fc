"""PolicyGroup on a 3-node Ray cluster: 2 train + 4 eval actors shared by every test here.

Layout: node0: train0, eval0 | node1: train1, eval1 | node2: eval2, eval3. Disaggregated plans
then mix shared-memory items (node0, node1) and a cross-node broadcast (to node2); colocated
plans pair train i with eval i on one node. The fault tests kill only actors they spawned
themselves (`spares`), so every test runs in any order against the same shared actors.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

import pg_policies  # noqa: E402
from pg_policies import OBS_DIM, MLPPolicy, make_model  # noqa: E402
from testkit import PLACES, cluster_config, node_ids, ready_group, spawn_actors, started_actors  # noqa: E402

from rlfleet.placement import build_transfer_info_for_disaggregated  # noqa: E402
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
EVALS = ("eval0", "eval1", "eval2", "eval3")


def config(
    strategy: str = "Double", kind: str = "WeightBuffer", planner: str = "rlfleet", **kw: Any
) -> PolicyConfig:
    return cluster_config(
        WeightBufferConfig(type=kind, buffer_strategy=strategy, bucket_bytes=4096, planner=planner), **kw
    )


@pytest.fixture(scope="module")
def actors(cluster: Any) -> Iterator[dict[str, Any]]:
    """The six shared actors (`testkit.PLACES`); no test kills one of them."""
    out = started_actors(MLPPolicy, config(), PLACES)
    yield out
    for a in out.values():
        ray.kill(a)


@contextlib.contextmanager
def spares(places: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Fresh actors (name -> node, as `PLACES`) for a test that kills them; gone afterwards."""
    out = spawn_actors(MLPPolicy, config(), places)
    try:
        ray.get([a.is_alive.remote() for a in out.values()], timeout=240)
        yield out
    finally:
        for a in out.values():
            ray.kill(a)


def group_of(
    actors: dict[str, Any],
    cfg: PolicyConfig,
    colocated: bool = False,
    evals: tuple[str, ...] = EVALS,
    align_trainers: bool = False,
) -> PolicyGroup:
    """train0 and train1 with `evals`, synced once (`testkit.ready_group`)."""
    train, rollout = [actors["train0"], actors["train1"]], [actors[e] for e in evals]
    group: PolicyGroup = ready_group(train, rollout, cfg, colocated=colocated, align_trainers=align_trainers)
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
    group = group_of(actors, config(strategy, kind))
    try:
        nodes = {group.node_of(p) for p in group.eval_list}
        assert len(nodes) == 3
        shares = [s for s in group.sync_plan.steps if s.transport == "broadcast"]  # node2 has no trainer
        assert [s.src for s in shares] == ["t0", "t1"]  # several senders: each trainer sends a share
        assert sorted(b for s in shares for b in s.buckets) == list(range(len(group.sync_plan.bucket_bytes)))
        for step in (1, 2):
            train_sync_and_check(group, step)
    finally:
        group.shutdown()


@pytest.mark.parametrize(("strategy", "kind"), STRATEGIES)
def test_sync_colocated_every_strategy(actors: dict[str, Any], strategy: str, kind: str) -> None:
    group = group_of(actors, config(strategy, kind), colocated=True, evals=("eval0", "eval1"))
    try:
        assert all(s.transport == "node_buffer" for s in group.sync_plan.steps)  # each pair shares a node
        train_sync_and_check(group, 3)
    finally:
        group.shutdown()


def test_seed_plan_runs_as_planned(actors: dict[str, Any]) -> None:
    """The seed's plans run too: colocated pairs hand over point to point, disaggregated ones
    funnel through the seed's round robin; `transfer_info` is the seed's shape of the plan."""
    cfg = config("Double", planner="seed")
    group = group_of(actors, cfg, colocated=True, evals=("eval0", "eval1"))
    try:
        assert group.sync_plan.name == "seed"
        assert set(group.transfer_info) == {"all"}
        assert {s.transport for s in group.sync_plan.steps} == {"p2p"}
        train_sync_and_check(group, 4)
    finally:
        group.shutdown()
    group = group_of(actors, config("Shared", "CPUWeightBuffer", planner="seed"))
    try:
        plan = group.sync_plan
        assert plan.name == "seed"
        seed = build_transfer_info_for_disaggregated(group.placement_info, "Shared")
        assert group.transfer_info == seed  # the view equals the seed planner's output
        train_sync_and_check(group, 5)
        assert group.last_sync_report is not None
        assert group.last_sync_report.matches(plan)
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
    group = group_of(
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
    group = group_of(actors, config(rollout_mode=mode))
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
    group = group_of(actors, config("Double"))
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
    group = group_of(actors, config("Double"))
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


def test_sync_report_matches_the_plan_it_ran(actors: dict[str, Any]) -> None:
    group = group_of(actors, config("Shared", "CPUWeightBuffer"))
    try:
        plan = group.sync_plan
        assert plan is not None
        assert plan.name == "rlfleet"
        assert plan.topology_source.startswith("topology: ray.nodes()")  # the cluster, not a placeholder
        ids = {group.process_id(p) for p in group.train_list + group.eval_list}
        assert {p.id for p in plan.processes} == ids
        group.train(None, seed=31)
        report = group.sync_weights()
        assert report is not None
        assert report.ok
        assert report.matches(plan)
        assert report is group.last_sync_report
        assert report.predicted_seconds == plan.predicted_seconds
        for step in report.steps:
            assert step.predicted_seconds == plan.steps[step.index].predicted_seconds
            assert step.measured_seconds > 0
        transports = {plan.steps[s.index].transport: s.phases for s in report.steps}
        assert "wire" in transports["broadcast"]
        assert "land" in transports["node_buffer"]
        assert f"v{group.weight_version} ok" in report.summary()
    finally:
        group.shutdown()


def test_pop_replans_like_a_death(actors: dict[str, Any]) -> None:
    """Shared: the popped reader leaves its node buffer and the next syncs work; None: the
    popped worker is never written to again; both keep serving what they held."""
    for strategy, kind in (("Shared", "CPUWeightBuffer"), ("None", "WeightBuffer")):
        group = group_of(actors, config(strategy, kind))
        try:
            popped = group.pop("eval")
            assert popped is actors["eval3"]
            pid = group.process_id(popped)
            assert pid not in {p.id for p in group.sync_plan.processes}
            before = ray.get(popped.get_weight_checksum.remote(), timeout=60)
            version = ray.get(popped.get_weight_version.remote(), timeout=60)
            for step in (41, 42):
                train_sync_and_check(group, step)
            assert ray.get(popped.get_weight_checksum.remote(), timeout=60) == before
            assert ray.get(popped.get_weight_version.remote(), timeout=60) == version
            out = ray.get(popped._rollout.remote(obs(1)[0]), timeout=60)  # still serves its version
            assert out["version"] == version
        finally:
            group.shutdown()


def test_postprocess_offload_and_pop_push_on_ray_actors(actors: dict[str, Any]) -> None:
    group = group_of(actors, config("Double"))
    try:
        batch = obs(6)
        ids = [f"env-{i}" for i in range(6)]
        resp = group.rollout_batch(BatchedData(ids, batch))
        post = group.postprocess(BatchedData(ids, batch), resp)
        assert post.ids() == ids
        assert ray.get(post.values(), timeout=60) == ray.get(resp.values(), timeout=60)
        assert group.wait_idle() == 0
        group.train(None, seed=51)
        group.offload_model_optimizer()
        states = ray.get([t.get_offload_state.remote() for t in group.train_list], timeout=60)
        assert all(s["optimizer"] for s in states)
        group.reload_model_param_and_grad()
        group.train(None, seed=52)  # the optimizer came back
        popped = group.pop("eval")
        group.push(popped, "eval")
        group.init_eval()
        group.init_placement_info()
        group.init_weight_buffer()
        group.init_comm_group("gloo")
        train_sync_and_check(group, 53)
    finally:
        group.shutdown()


def test_worker_shutdown_releases_its_node_buffer(cluster: Any) -> None:
    with spares({"train0": "node1", "eval0": "node1"}) as own:
        trainer, reader = own["train0"], own["eval0"]
        group = PolicyGroup([trainer], [reader], config("Shared", "CPUWeightBuffer"))
        group.init(TrainConfig(lr=1e-2))
        group.init_placement_info()
        group.init_weight_buffer()
        group.sync_weights()
        [entry] = group.shared_weight_buffer_map.values()
        name = entry["shared_weight_buffer"]["name"]
        assert ray.get(reader.get_weight_version.remote(), timeout=60) == 1
        assert ray.get(trainer.shutdown.remote(), timeout=60) is True
        assert ray.get(reader.shutdown.remote(), timeout=60) is True
        assert not ray.get(trainer.segment_exists.remote(name), timeout=60)  # unlinked by its writer
        out = ray.get(reader._rollout.remote(obs(1)[0]), timeout=60)  # private weights, still version 1
        assert out["version"] == 1


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
        assert "rank(s) [2] did not check in" in str(info.value.cause)
        assert info.value.cause.missing_ranks == (2,)


def test_a_sharded_group_replans_its_shards_when_a_rollout_worker_dies(actors: dict[str, Any]) -> None:
    with spares({"eval4": "node2", "eval5": "node2", "eval6": "node2"}) as extra:
        group = group_of({**actors, **extra}, config("Sharded", "ShardedWeightBuffer"), evals=tuple(extra))
        try:
            ray.kill(extra["eval6"], no_restart=True)
            group.train(None, seed=61)
            group.sync_weights()  # re-planned by placement: two shares on node2 now
            assert len(group.eval_list) == 2
            assert sorted(p.shard for p in group.sync_plan.rollouts) == [(0, 2), (1, 2)]
            check_synced(group)
            train_sync_and_check(group, 62)
        finally:
            group.shutdown()


def test_a_dead_rollout_worker_is_dropped_from_syncs_and_routing(actors: dict[str, Any]) -> None:
    with spares({"eval2": "node2", "eval3": "node2"}) as victims:
        group = group_of({**actors, **victims}, config("Double"))
        try:
            group.train(None, seed=21)
            ray.kill(victims["eval3"], no_restart=True)
            group.sync_weights()  # detects the death, re-plans, syncs the survivors
            assert len(group.eval_list) == 3
            assert all(p is not victims["eval3"] for p in group.eval_list)
            check_synced(group)
            out = rollout_values(group, obs(9))
            assert {r["worker"] for r in out} == {0, 1, 2}
            # now one dies between syncs while rollouts are routed: it is dropped from routing too
            ray.kill(victims["eval2"], no_restart=True)
            resp = group.rollout_batch(BatchedData([f"env-{i}" for i in range(8)], obs(8)))
            ray.wait(resp.values(), num_returns=8, timeout=60)
            group.train(None, seed=22)
            group.sync_weights()
            assert len(group.eval_list) == 2
            check_synced(group)
            assert {r["worker"] for r in rollout_values(group, obs(6))} == {0, 1}
        finally:
            group.shutdown()


def test_a_dead_trainer_is_a_clear_error_naming_it(actors: dict[str, Any]) -> None:
    with spares({"train1": "node1"}) as victim:  # a fresh trainer 1, aligned with train0's weights
        group = group_of(
            {**actors, **victim}, config("Double"), evals=("eval0", "eval1"), align_trainers=True
        )
        try:
            ray.kill(victim["train1"], no_restart=True)
            with pytest.raises(TrainWorkerDiedError, match="trainer 1"):
                group.sync_weights()
            with pytest.raises(TrainWorkerDiedError, match="trainer 1"):
                group.train(None, seed=1)
        finally:
            group.shutdown()
