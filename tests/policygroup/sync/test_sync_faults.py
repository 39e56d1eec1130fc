"""A sync that fails leaves routing as it found it, and says whom it dropped (real Ray actors).

"None" applies a version in place, so its send drains every rollout worker first; a trainer that
dies mid-send must not leave them drained (a soak once ended with every worker draining and
requests timing out). A rollout worker found dead as a sync begins is named in that sync's
outcome.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

import pg_policies  # noqa: E402
from pg_policies import OBS_DIM, MLPPolicy  # noqa: E402
from testkit import cluster_config  # noqa: E402

from rlfleet.policygroup import (  # noqa: E402
    BatchedData,
    PolicyConfig,
    PolicyGroup,
    PolicyGroupError,
    TrainWorkerDiedError,
    WeightBufferConfig,
)

pytestmark = pytest.mark.timeout(300)
ray.cloudpickle.register_pickle_by_value(pg_policies)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DyingTrainer(MLPPolicy):
    """Once armed, SIGKILLs itself when the sync calls it to send (node buffer or broadcast)."""

    _armed = False

    def arm(self) -> None:
        self._armed = True

    def _maybe_die(self) -> None:
        if self._armed:
            os.kill(os.getpid(), signal.SIGKILL)

    def publish_shared(self, version: int, timeout_s: float) -> int:
        self._maybe_die()
        return super().publish_shared(version, timeout_s)

    def send_broadcast(self, *args: Any, **kwargs: Any) -> int:
        self._maybe_die()
        return super().send_broadcast(*args, **kwargs)


def _config(strategy: str) -> PolicyConfig:
    return cluster_config(
        WeightBufferConfig(buffer_strategy=strategy, bucket_bytes=4096),
        sync_timeout_s=30.0,
        drain_timeout_s=20.0,
    )


@pytest.fixture
def group(cluster: Any, request: pytest.FixtureRequest) -> Iterator[PolicyGroup]:
    strategy = request.param
    config = _config(strategy)
    node = {"resources": {"node0": 1}, "num_cpus": 0, "max_concurrency": 16}
    trainer = ray.remote(DyingTrainer).options(**node).remote(config=config, role="train", index=0)
    rollouts = [
        ray.remote(MLPPolicy).options(**node).remote(config=config, role="eval", index=i) for i in range(2)
    ]
    made = PolicyGroup([trainer], rollouts, config)
    made.init_placement_info()
    made.init_weight_buffer()
    made.init_comm_group("gloo")
    yield made
    made.shutdown()
    for actor in [trainer, *rollouts]:
        ray.kill(actor)


def _serves(group: PolicyGroup) -> list[int]:
    """Route one request to each rollout worker; the weight versions that answered."""
    obs = [torch.zeros(OBS_DIM).tolist() for _ in group.eval_list]
    out = group.rollout_batch(BatchedData(list(range(len(obs))), obs))
    return [r["version"] for r in ray.get(out.values(), timeout=60)]


@pytest.mark.parametrize("group", ["None"], indirect=True)
def test_a_trainer_dying_mid_sync_leaves_no_rollout_worker_drained(group: PolicyGroup) -> None:
    group.sync_weights()
    assert _serves(group) == [1, 1]
    ray.get(group.train_list[0].arm.remote(), timeout=60)
    with pytest.raises(TrainWorkerDiedError, match="trainer 0"):
        group.sync_weights()
    router = group._rollouts.router
    assert [w for w in router.workers if router.is_draining(w)] == []
    # still serving the last version every worker committed, without waiting on a drain
    assert _serves(group) == [1, 1]


@pytest.mark.parametrize("group", ["Double"], indirect=True)
def test_a_sync_names_the_rollout_worker_it_found_dead(group: PolicyGroup) -> None:
    group.sync_weights()
    victim = group.eval_list[1]
    ray.kill(victim)
    group.sync_weights()
    outcome = group.last_sync
    assert outcome is not None
    assert outcome.dropped == ("rollout worker 1",)
    assert len(group.eval_list) == 1
    assert _serves(group) == [2]


class SlowRollouts(MLPPolicy):
    """A rollout asked for "slow" holds the worker (and its serving lock) for a while."""

    def rollout_step(self, env_ret: Any) -> dict[str, Any]:
        if env_ret == "slow":
            time.sleep(3.0)  # simulated generation that outlasts the rolling update's drain
            env_ret = torch.zeros(OBS_DIM).tolist()
        return super().rollout_step(env_ret)


def test_a_request_outlasting_the_drain_leaves_its_worker_serving_and_routable(cluster: Any) -> None:
    config = dataclasses.replace(_config("Double"), drain_timeout_s=1.0)
    node = {"resources": {"node0": 1}, "num_cpus": 0, "max_concurrency": 16}
    trainer = ray.remote(MLPPolicy).options(**node).remote(config=config, role="train", index=0)
    rollout = ray.remote(SlowRollouts).options(**node).remote(config=config, role="eval", index=0)
    group = PolicyGroup([trainer], [rollout], config)
    try:
        group.init_placement_info()
        group.init_weight_buffer()
        group.sync_weights()
        slow = group.rollout_batch(BatchedData([0], ["slow"])).values()[0]
        group.send_weights()  # v2 staged while the slow request runs
        with pytest.raises(PolicyGroupError, match=r"rollout worker 0 still had requests in flight.*v1"):
            group.notify_update_weights()
        router = group._rollouts.router
        assert [w for w in router.workers if router.is_draining(w)] == []  # routable, as it was
        assert ray.get(slow, timeout=60)["version"] == 1
        assert group.eval_weight_versions() == [1]
        group.notify_update_weights()  # the next apply swaps it
        assert group.eval_weight_versions() == [2]
        assert _serves(group) == [2]
    finally:
        group.shutdown()
        for actor in (trainer, rollout):
            ray.kill(actor)


def test_a_worker_left_behind_in_a_node_buffer_is_swapped_before_the_next_version_is_sent(
    cluster: Any,
) -> None:
    """ "Shared": a worker whose request outlasted the drain still binds the slot of the version
    before; the writer of the next version needs that slot. The next sync swaps it first (before:
    that sync, and every one after, waited out its deadline for the slot and failed)."""
    config = dataclasses.replace(_config("Shared"), drain_timeout_s=2.0, sync_timeout_s=8.0)
    node = {"resources": {"node0": 1}, "num_cpus": 0, "max_concurrency": 16}
    trainer = ray.remote(MLPPolicy).options(**node).remote(config=config, role="train", index=0)
    rollouts = [
        ray.remote(SlowRollouts).options(**node).remote(config=config, role="eval", index=i) for i in range(2)
    ]
    group = PolicyGroup([trainer], rollouts, config)
    try:
        group.init_placement_info()
        group.init_weight_buffer()
        group.sync_weights()
        slow = group.rollout_batch(BatchedData([0], ["slow"])).values()[0]
        busy_at_v1 = r"rollout worker (\d) still had requests in flight.*v1"
        with pytest.raises(PolicyGroupError, match=busy_at_v1) as info:
            group.sync_weights()  # v2: the other swaps, the busy one keeps serving v1 (its slot bound)
        named = re.search(busy_at_v1, str(info.value))
        assert named is not None
        busy = int(named.group(1))
        assert group.eval_weight_versions() == [1 if i == busy else 2 for i in range(2)]
        report = group.sync_weights()  # v3: the busy one swapped to v2 first, then v3 written and applied
        assert report is not None
        assert report.ok, report
        assert ray.get(slow, timeout=60)["version"] == 1
        assert group.eval_weight_versions() == [3, 3]
        assert _serves(group) == [3, 3]
    finally:
        group.shutdown()
        for actor in (trainer, *rollouts):
            ray.kill(actor)
