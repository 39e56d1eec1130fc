"""A worker's components on their own, in one process and without Ray: checkpoints, offload,
timings, device facts, and the worker call mixins on a host class that is not policygroup's
(a node buffer written by one host and staged, then applied, by another)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.weightsync import (
    Checkpoints,
    CommGroupCalls,
    CommGroupError,
    Layout,
    Offload,
    ServingLock,
    Timings,
    WeightCalls,
    WeightSyncError,
    WorkerComm,
    WorkerWeights,
    checksum,
    device_id,
    device_info,
)


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
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()  # optimizer state exists
    before = checksum(model.state_dict())
    offload = Offload(torch.device("cpu"))
    offload.params_and_grads(model, True, grads=False)
    offload.optimizer(optimizer, True)
    assert offload.state() == {"model": True, "optimizer": True, "grad": False}
    offload.model(model, False, pinned_in_place=True)
    offload.optimizer(optimizer, False)
    assert offload.state() == {"model": False, "optimizer": False, "grad": False}
    assert checksum(model.state_dict()) == before


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
    named = device_info(torch.device("cpu"), 0, node_id="0123456789abcdef0123")
    assert named["node_id"] == "0123456789abcdef0123"
    assert named["uuid"].endswith("-0123456789ab")  # the node, shortened


@dataclass(frozen=True)
class Buffers:
    bucket_bytes: int = 4096
    buffer_strategy: str = "Double"


@dataclass(frozen=True)
class Settings:
    group_timeout_s: float = 10.0
    sync_timeout_s: float = 10.0
    drain_timeout_s: float = 10.0
    weight_buffer: Buffers = field(default_factory=Buffers)


class Host(CommGroupCalls, WeightCalls):
    """The least a worker class provides for weightsync's worker calls (no Ray, no policygroup)."""

    def __init__(self, seed: int, settings: Settings = Settings()) -> None:
        torch.manual_seed(seed)
        self.config = settings
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        self.device = torch.device("cpu")
        self.role, self.index, self.model_update_group = "eval", seed, None
        self._serve = ServingLock()
        self._comm = WorkerComm(settings.group_timeout_s)
        self._restarted = False
        self._weights = WorkerWeights(
            self._serve,
            lambda: f"host {seed}",
            bucket_bytes=settings.weight_buffer.bucket_bytes,
            commit_timeout_s=settings.drain_timeout_s,
            attach_timeout_s=settings.group_timeout_s,
            write_timeout_s=settings.sync_timeout_s,
        )
        self._refuse_if_restarted: Callable[[], None] = lambda: None
        self._node_ip: Callable[[], str] = lambda: "127.0.0.1"
        self.get_state_dict: Callable[[], dict[str, torch.Tensor]] = lambda: dict(self.model.state_dict())
        self.load_state_dict: Callable[[Mapping[str, torch.Tensor]], None] = self.model.load_state_dict


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    writer, reader = Host(1), Host(2)
    yield writer, reader
    reader.release_weight_buffers()
    writer.release_weight_buffers()


def test_worker_calls_run_on_any_host_class(hosts: tuple[Host, Host]) -> None:
    """A node buffer through the mixins' calls: the staged version is invisible until applied,
    then bit-exact, and a layout that differs is refused by name."""
    writer, reader = hosts
    layout = Layout.from_state_dict(writer.model.state_dict(), 4096).to_dict()
    name = writer.create_shared_writer(layout, 1, "rlfleet-test-host")
    reader.init_weight_buffer({"name": name}, strategy="Double", layout=layout)
    before = checksum(reader.model.state_dict())
    deadline = time.time() + 30
    published = writer.sync_publish(1, deadline)
    assert published["t1"] >= published["t0"]
    assert set(published["phases"]) == {"pack"}
    staged = reader.sync_stage(name, 1, deadline)
    assert set(staged["phases"]) == {"land"}
    assert checksum(reader.model.state_dict()) == before  # staged, not applied
    assert reader.get_staged_version() == 1
    assert reader.apply_staged(1) == 1
    assert checksum(reader.model.state_dict()) == checksum(writer.model.state_dict())
    other = Host(3)
    other.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 5))
    with pytest.raises(WeightSyncError, match=r"'1\.weight'"):
        other.init_weight_buffer({"name": name}, strategy="Double", layout=layout)


def test_a_step_after_the_syncs_deadline_is_refused(hosts: tuple[Host, Host]) -> None:
    writer, _ = hosts
    layout = Layout.from_state_dict(writer.model.state_dict(), 4096).to_dict()
    writer.create_shared_writer(layout, 1, "rlfleet-test-host")
    with pytest.raises(WeightSyncError, match="deadline passed"):
        writer.sync_publish(1, time.time() - 1)


def test_groups_need_the_world_first_and_say_so() -> None:
    host = Host(4)
    with pytest.raises(CommGroupError, match="init_distributed_env"):
        host.init_single_comm_group([0, 1], "weight_transfer")
    assert host.get_groups() == {}
