"""The policy group's parts on their own, in one process: checkpoints, offload, timings, device
facts, the sync planner and call failure classification (the Ray paths are in test_cluster)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_policies import MLPPolicy

from rlfleet.policygroup import PolicyConfig, PolicyGroupError, WeightBufferConfig
from rlfleet.policygroup._calls import Calls, Roster, vagueness
from rlfleet.policygroup._checkpoint import Checkpoints
from rlfleet.policygroup._device import Timings, device_id, device_info
from rlfleet.policygroup._offload import Offload
from rlfleet.policygroup._sync_plan import BROADCAST, NODE_BUFFER, Processes, plan_steps
from rlfleet.weightsync import LayoutMismatchError, checksum


def test_checkpoints_are_whole_and_a_failed_background_write_is_reported(tmp_path: Path) -> None:
    store = Checkpoints()
    state = {"model": {"w": torch.arange(6.0)}, "version": 3}
    path = str(tmp_path / "a" / "ckpt.pt")
    assert store.save(state, path) == path
    assert Checkpoints.load(path)["version"] == 3
    assert os.listdir(tmp_path / "a") == ["ckpt.pt"]  # the temporary file was renamed over it
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    store.save(state, str(blocked / "ckpt.pt"), async_save=True)
    with pytest.raises(RuntimeError, match="async checkpoint failed"):
        store.finalize(30.0)
    store.finalize(30.0)  # reported once


def test_offload_on_cpu_records_state_and_keeps_weights() -> None:
    policy = MLPPolicy(PolicyConfig(), role="train")
    policy.init_train()
    before = checksum(policy.model.state_dict())
    offload = Offload(torch.device("cpu"))
    offload.params_and_grads(policy.model, True, grads=False)
    offload.optimizer(policy.optimizer, True)
    assert offload.state() == {"model": True, "optimizer": True, "grad": False}
    offload.model(policy.model, False, pinned_in_place=True)
    offload.optimizer(policy.optimizer, False)
    assert offload.state() == {"model": False, "optimizer": False, "grad": False}
    assert checksum(policy.model.state_dict()) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_gpu_is_synchronized_before_host_reads() -> None:
    """Non-blocking copies to host memory: the call returns only once they landed."""
    module = torch.nn.Linear(2048, 2048).cuda()
    expected = module.weight.detach().cpu().clone()
    offload = Offload(torch.device("cuda"))
    offload.params_and_grads(module, True)
    assert module.weight.device.type == "cpu"
    assert torch.equal(module.weight.detach(), expected)  # read at once: the copy is complete
    offload.params_and_grads(module, False)
    assert module.weight.device.type == "cuda"


def test_timings_count_and_reset(capsys: Any) -> None:
    timings = Timings()
    start = time.perf_counter()
    timings.add("rollout", start)
    timings.add("rollout", start)
    summary = timings.summary("eval0", reset=True)
    assert summary["rollout"]["count"] == 2
    assert summary["rollout"]["total_s"] >= summary["rollout"]["mean_s"] >= 0
    assert "[eval0] rollout: n=2" in capsys.readouterr().out
    assert timings.summary("eval0") == {}


def test_device_facts_on_cpu() -> None:
    info = device_info(torch.device("cpu"), 1234)
    assert info["device"] == "cpu"
    assert info["memory_allocated"] == 1234
    assert info["total_memory"] >= info["free_memory"] > 0
    assert device_id(torch.device("cpu")).startswith("CPU-")


def _planned(strategy: str) -> tuple[list[Any], list[Any], Any]:
    """Trainers on nodes A and B, rollout workers on A, B and (two) C; the steps for `strategy`."""
    config = PolicyConfig(weight_buffer=WeightBufferConfig(buffer_strategy=strategy, type="CPUWeightBuffer"))
    train = [MLPPolicy(config, role="train", index=i) for i in range(2)]
    evals = [MLPPolicy(config, index=i) for i in range(4)]
    roster = Roster(train, evals)
    processes = Processes(roster, Calls(roster, 10.0, lambda: []))
    for policy, node in zip(train + evals, "ABABCC", strict=True):
        processes.node_of[roster.wid(policy)] = node  # located: no call to the workers
        processes.gpu_of[roster.wid(policy)] = 0
    processes.place(False, strategy)
    return train, evals, plan_steps(processes, strategy == "Shared")


def test_sync_steps_double_copy_from_node_buffers_and_broadcast_across_nodes() -> None:
    train, evals, steps = _planned("Double")
    buffers = [s for s in steps if s.transport == NODE_BUFFER]
    [broadcast] = [s for s in steps if s.transport == BROADCAST]
    assert {(s.node, s.src, tuple(s.dst)) for s in buffers} == {
        ("A", train[0], (evals[0],)),
        ("B", train[1], (evals[1],)),
    }
    assert broadcast.node == "C"
    assert broadcast.src in train
    assert broadcast.dst == [evals[2], evals[3]]
    assert [s.index for s in steps] == list(range(len(steps)))


def test_sync_steps_shared_has_one_receiver_fill_its_node_buffer() -> None:
    _, evals, steps = _planned("Shared")
    [broadcast] = [s for s in steps if s.transport == BROADCAST]
    assert broadcast.dst == [evals[2]]
    [fed] = [s for s in steps if s.transport == NODE_BUFFER and s.node == "C"]
    assert (fed.src, fed.dst, fed.after) == (evals[2], [evals[3]], (broadcast.index,))


class _Refusing(MLPPolicy):
    def get_weight_checksum(self) -> str:
        raise LayoutMismatchError("parameter '0.weight' differs", "0.weight")


def test_failures_name_the_worker_and_the_clearest_one_wins() -> None:
    config = PolicyConfig()
    roster = Roster([MLPPolicy(config, role="train")], [MLPPolicy(config), _Refusing(config, index=1)])
    calls = Calls(roster, 10.0, lambda: [])
    with pytest.raises(
        PolicyGroupError, match=r"get_weight_checksum: rollout worker 1 failed: parameter '0\.weight'"
    ):
        calls.call_all(roster.eval_list, "get_weight_checksum")
    assert vagueness(LayoutMismatchError("x", "0.weight")) == 0
    assert vagueness(RuntimeError("a receiver has a different layout")) == 1
