"""The worker surface (seed calls and NeMo RL's) on real Ray actors, and the TaskSubmitter."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

import pg_policies  # noqa: E402
from pg_policies import OBS_DIM, MLPPolicy, make_model  # noqa: E402
from testkit import free_port  # noqa: E402

from rlfleet.policygroup import PolicyConfig, TaskSubmitter, TaskTimeoutError, TrainConfig  # noqa: E402

pytestmark = pytest.mark.timeout(240)
ray.cloudpickle.register_pickle_by_value(pg_policies)  # the workers need not import tests/


@pytest.fixture(scope="module")
def pair(cluster: Any) -> tuple[Any, Any]:
    remote = ray.remote(MLPPolicy)
    cfg = PolicyConfig(group_timeout_s=20.0)
    opts = {"num_cpus": 0, "max_concurrency": 8}
    trainer = remote.options(resources={"node1": 1}, **opts).remote(config=cfg, role="train", index=0)
    evaluator = remote.options(resources={"node2": 1}, **opts).remote(config=cfg, role="eval", index=0)
    ray.get([trainer.init_train.remote(TrainConfig()), evaluator.init_eval.remote()], timeout=200)
    return trainer, evaluator


def test_device_facts_on_cpu(pair: tuple[Any, Any]) -> None:
    trainer, _ = pair
    assert ray.get(trainer.is_alive.remote(), timeout=30) is True
    info = ray.get(trainer.get_gpu_info.remote(), timeout=30)
    assert info["device"] == "cpu"
    assert info["total_memory"] >= info["free_memory"] > 0
    assert info["memory_allocated"] > 0
    assert ray.get(trainer.report_device_id.remote(), timeout=30).startswith("CPU-")
    assert ray.get(trainer.get_free_memory_bytes.remote(), timeout=30) > 0
    ip, gpu = ray.get(trainer.report_node_ip_and_gpu_id.remote(), timeout=30)
    assert isinstance(ip, str)
    assert ip
    assert gpu == -1
    ray.get(trainer.reset_peak_memory_stats.remote(), timeout=30)
    assert ray.get(trainer.stand_down_refit_watchdog.remote(), timeout=30) == 0
    assert ray.get(trainer.get_num_requests.remote(), timeout=30) == 0


def test_profiling_writes_a_trace(pair: tuple[Any, Any], tmp_path: Any) -> None:
    trainer, _ = pair
    ray.get(trainer.start_gpu_profiling.remote(str(tmp_path)), timeout=30)
    ray.get(trainer.train.remote(None, seed=1), timeout=60)
    path = ray.get(trainer.stop_gpu_profiling.remote(), timeout=60)
    assert path is not None
    assert os.path.getsize(path) > 0
    assert ray.get(trainer.stop_gpu_profiling.remote(), timeout=30) is None


def test_async_checkpoint_and_finish(pair: tuple[Any, Any], tmp_path: Any) -> None:
    trainer, _ = pair
    path = str(tmp_path / "async.pt")
    ray.get(trainer.save_checkpoint.remote(path, async_save=True), timeout=60)
    ray.get(trainer.finalize_async_save.remote(), timeout=60)
    state = torch.load(path, weights_only=True)
    assert set(state) == {"model", "optimizer", "version"}
    assert state["model"].keys() == make_model().state_dict().keys()
    ray.get(trainer.finish_training.remote(), timeout=60)


def test_reference_logprobs_come_from_a_frozen_copy(pair: tuple[Any, Any]) -> None:
    trainer, _ = pair
    g = torch.Generator().manual_seed(0)
    data = {"obs": torch.randn(5, OBS_DIM, generator=g), "actions": torch.tensor([0, 1, 2, 3, 0])}
    ray.get(trainer.init_train.remote(TrainConfig(lr=0.05)), timeout=60)
    state = ray.get(trainer.get_state_dict.remote(), timeout=60)
    first = ray.get(trainer.get_reference_policy_logprobs.remote(data=data, micro_batch_size=2), timeout=60)
    model = make_model()
    model.load_state_dict(state)
    with torch.no_grad():
        expected = torch.log_softmax(model(data["obs"]), -1).gather(-1, data["actions"][:, None])[:, 0]
    torch.testing.assert_close(first["reference_logprobs"], expected)
    ray.get(trainer.train.remote(None, seed=2), timeout=60)  # the policy moves on, the reference does not
    again = ray.get(trainer.get_reference_policy_logprobs.remote(data=data), timeout=60)
    torch.testing.assert_close(again["reference_logprobs"], expected)
    tokens = {"input_ids": torch.randn(2, 3, OBS_DIM, generator=g)}
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(trainer.get_reference_policy_logprobs.remote(data=tokens), timeout=60)


def test_init_collective_forms_a_group_across_nodes(pair: tuple[Any, Any]) -> None:
    trainer, evaluator = pair
    port2 = free_port()
    refs = [
        trainer.init_collective.remote("127.0.0.1", port2, 2, train_world_size=1),
        evaluator.init_collective.remote("127.0.0.1", port2, 2, train_world_size=1),
    ]
    ray.get(refs, timeout=90)
    # one group of two: the trainer is rank 0, the rollout worker follows; an all-reduce over it
    # from both nodes adds both values
    sums = ray.get([trainer.collective_sum.remote(1.0), evaluator.collective_sum.remote(2.0)], timeout=90)
    assert sums == [(0, 2, 3.0), (1, 2, 3.0)]
    nodes = ray.get([trainer._get_node_id.remote(), evaluator._get_node_id.remote()], timeout=30)
    assert nodes[0] != nodes[1]


def test_submitter_bounds_each_actor_without_blocking_others(pair: tuple[Any, Any]) -> None:
    trainer, evaluator = pair
    sub = TaskSubmitter(max_pending_tasks_each_worker=1, timeout_s=60)
    release = ray.get(trainer.sleep.remote(0), timeout=30)  # warm
    assert release == 0
    busy = sub.submit(trainer.sleep, 3.0)
    blocked_done = threading.Event()
    other_done = threading.Event()
    order: list[str] = []

    def blocked() -> None:
        sub.submit(trainer.sleep, 0.0, _block=True)  # waits for the busy task on this actor
        order.append("blocked")
        blocked_done.set()

    def other() -> None:
        sub.submit(evaluator.sleep, 0.0, _block=True)  # another actor: never waits behind it
        order.append("other")
        other_done.set()

    t1 = threading.Thread(target=blocked)
    t1.start()
    t2 = threading.Thread(target=other)
    t2.start()
    assert other_done.wait(60)
    assert blocked_done.wait(60)
    t1.join(5)
    t2.join(5)
    assert order == ["other", "blocked"]
    assert ray.get(busy, timeout=30) == 3.0
    assert sub.pending(trainer) == 0
    quick = TaskSubmitter(max_pending_tasks_each_worker=1, timeout_s=0.5)
    quick.submit(trainer.sleep, 5.0)
    with pytest.raises(TaskTimeoutError, match="still had 1 task"):
        quick.submit(trainer.sleep, 0.0)
