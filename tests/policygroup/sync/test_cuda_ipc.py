"""The "cuda_ipc" step inside a PolicyGroup: real Ray actors, real processes, real shared memory.

``weight_buffer.cuda_ipc="host"`` makes placement hand a version from a trainer to the rollout
workers of its node by a "cuda_ipc" step on CPU workers too, run over weightsync's host
backend: the same channel protocol, control block and policygroup calls as on GPUs, only the
slots live in host shared memory. Layout (the suite's 3-node cluster): node0 holds the trainer
and two rollout workers; the fault tests use their own actors and kill them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

import pg_policies  # noqa: E402
from pg_policies import OBS_DIM, FaultyMLPPolicy, MLPPolicy  # noqa: E402
from testkit import cluster_config, eval_state, ready_group, spawn_actors  # noqa: E402

from rlfleet.policygroup import (  # noqa: E402
    PolicyConfig,
    PolicyGroup,
    PolicyGroupError,
    TrainConfig,
    TrainWorkerDiedError,
    WeightBufferConfig,
)

pytestmark = pytest.mark.timeout(300)
ray.cloudpickle.register_pickle_by_value(pg_policies)  # the workers need not import tests/

KIND = {"None": "WeightBuffer", "Double": "WeightBuffer", "Shared": "CPUWeightBuffer"}


def config(strategy: str = "Double", cuda_ipc: str = "host") -> PolicyConfig:
    return cluster_config(
        WeightBufferConfig(
            type=KIND[strategy], buffer_strategy=strategy, bucket_bytes=4096, cuda_ipc=cuda_ipc
        ),
        sync_timeout_s=30.0,
    )


def spawn(name: str, node: str, cls: type = MLPPolicy) -> Any:
    return spawn_actors(cls, config(), {name: node})[name]


@pytest.fixture(scope="module")
def actors(cluster: Any) -> Iterator[dict[str, Any]]:
    out = {name: spawn(name, "node0") for name in ("train0", "eval0", "eval1")}
    ray.get([a.is_alive.remote() for a in out.values()], timeout=240)
    yield out
    for a in out.values():
        ray.kill(a)


def ipc_steps(group: PolicyGroup) -> list[Any]:
    plan = group.sync_plan
    assert plan is not None
    return [s for s in plan.steps if s.transport == "cuda_ipc"]


def trainer_sum(group: PolicyGroup) -> str:
    return str(ray.get(group.train_list[0].get_weight_checksum.remote(), timeout=60))


@pytest.mark.parametrize("strategy", ["Double", "None"])
def test_same_node_rollout_workers_receive_by_ipc_bit_exact(actors: dict[str, Any], strategy: str) -> None:
    group = ready_group([actors["train0"]], [actors["eval0"], actors["eval1"]], config(strategy))
    try:
        [step] = ipc_steps(group)
        plan = group.sync_plan
        assert plan is not None
        assert [s.transport for s in plan.steps] == ["cuda_ipc"]  # no node buffer, no object store
        assert (step.src, step.dst) == ("t0", tuple(group.process_id(p) for p in group.eval_list))
        assert not plan.node_buffers
        assert not group.shared_weight_buffer_map
        for seed in (1, 2, 3):
            group.train(None, seed=seed)
            before = group.weight_version
            report = group.sync_weights()
            assert group.weight_version == before + 1
            assert eval_state(group) == [(group.weight_version, trainer_sum(group))] * 2  # bit-exact
            assert report is not None
            assert report.ok
            assert report.matches(plan)
            [measured] = report.steps
            assert "wire" in measured.phases
            assert "land" in measured.phases
            assert group.sync_plan is plan  # nothing changed: the same plan, the same channel
        x = torch.randn(4, OBS_DIM, generator=torch.Generator().manual_seed(0)).tolist()
        out = ray.get([p._rollout.remote(x[0]) for p in group.eval_list], timeout=60)
        assert {o["version"] for o in out} == {group.weight_version}
    finally:
        group.shutdown()


def test_shared_and_cpu_workers_keep_the_node_buffer(actors: dict[str, Any]) -> None:
    """ "Shared" binds the node buffer zero-copy: never an IPC step. CPU workers under "auto" or
    "off" keep today's node buffer."""
    with pytest.raises(ValueError, match=r"weight_buffer\.cuda_ipc 'host' does not run with strategy 'Sh"):
        WeightBufferConfig(type="CPUWeightBuffer", buffer_strategy="Shared", cuda_ipc="host")
    with pytest.raises(ValueError, match=r"weight_buffer\.cuda_ipc 'gpu' is unknown; valid: auto, off, host"):
        WeightBufferConfig(cuda_ipc="gpu")
    for strategy, mode in (("Shared", "auto"), ("Double", "auto"), ("Double", "off")):
        group = ready_group([actors["train0"]], [actors["eval0"], actors["eval1"]], config(strategy, mode))
        try:
            plan = group.sync_plan
            assert plan is not None
            assert not ipc_steps(group)
            assert [s.transport for s in plan.steps] == ["node_buffer"]
            group.train(None, seed=7)
            group.sync_weights()
            assert eval_state(group) == [(group.weight_version, trainer_sum(group))] * 2
        finally:
            group.shutdown()


def test_host_mode_needs_ray_actors() -> None:
    trainer = MLPPolicy(config=config(), role="train", index=0)
    reader = MLPPolicy(config=config(), role="eval", index=0)
    group = PolicyGroup([trainer], [reader], config())
    try:
        group.init(TrainConfig(lr=1e-2))
        with pytest.raises(PolicyGroupError, match="cuda_ipc 'host' needs Ray actors"):
            group.init_placement_info()  # placement plans here
    finally:
        group.shutdown()


# ------------------------------------------------------------------ faults (own actors, killed)
@pytest.mark.parametrize("strategy", ["Double", "None"])
def test_reader_killed_mid_step_keeps_the_previous_version_then_replans(cluster: Any, strategy: str) -> None:
    """A reader SIGKILLs itself after taking the first bucket: the step fails naming it, the
    other reader keeps the previous version bit for bit; the next sync re-plans without the dead
    reader (a new channel for the survivor) and lands bit-exact."""
    train, keep = spawn("train0", "node0"), spawn("eval0", "node0")
    victim = spawn("eval1", "node0", FaultyMLPPolicy)
    group = ready_group([train], [keep, victim], config(strategy))
    try:
        group.train(None, seed=11)
        before, version = eval_state(group)[0], group.weight_version
        ray.get(victim.arm_kill_after_first_bucket.remote(), timeout=30)
        with pytest.raises(PolicyGroupError, match=r"IPC channel \S+: reader 1 \(pid \d+\) died"):
            group._sync.send(group._sync.next_version(), retry=False)  # one attempt: see it fail
        assert group.weight_version == version
        assert eval_state(group) == [before]  # the survivor: the previous version, bit for bit
        report = group.last_sync_report
        assert report is not None
        assert not report.ok
        assert "reader 1" in str(report.error)
        assert group.eval_list == [keep]  # dropped like any dead rollout worker
        group.sync_weights()  # re-planned like any death
        [step] = ipc_steps(group)
        assert step.dst == (group.process_id(keep),)
        assert eval_state(group) == [(group.weight_version, trainer_sum(group))]
    finally:
        group.shutdown()
        for a in (train, keep, victim):
            ray.kill(a)


def test_writer_killed_mid_step_readers_keep_the_previous_version(cluster: Any) -> None:
    """The trainer is SIGKILLed after a reader took the first bucket: a clear error naming it;
    the readers abort (two-phase commit) and keep the previous version."""
    train = spawn("train0", "node0", FaultyMLPPolicy)
    first, second = spawn("eval0", "node0", FaultyMLPPolicy), spawn("eval1", "node0")
    group = ready_group([train], [first, second], config("Double"))
    try:
        group.train(None, seed=12)
        before, version = eval_state(group), group.weight_version
        pid = ray.get(train.get_pid.remote(), timeout=30)
        ray.get(first.arm_kill_after_first_bucket.remote(pid), timeout=30)
        with pytest.raises(TrainWorkerDiedError, match="trainer 0"):
            group.sync_weights()
        assert group.weight_version == version
        assert eval_state(group) == before
    finally:
        group.shutdown()
        for a in (train, first, second):
            ray.kill(a)
