"""A worker's components on their own, in one process and without Ray: checkpoints, offload,
timings, device facts, and the worker call mixins (`WorkerCalls`) on a host class that is not
policygroup's: a node buffer written by one host and staged, then applied, by another; weights
and training state copied between hosts; checkpoints, reference log-probs, device facts,
profiling, offload and shutdown."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.policygroup import WorkerCalls
from rlfleet.policygroup.worker import Checkpoints, Timings, device_id, device_info, reference_logprobs
from rlfleet.weightsync import CommGroupError, Layout, WeightSyncError, checksum, is_offloaded


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


class Host(WorkerCalls):
    """The least a worker class provides for the worker calls (no Ray, not `BasePolicy`)."""

    def __init__(self, seed: int, settings: Settings = Settings(), device: str = "cpu") -> None:
        torch.manual_seed(seed)
        self.config = settings
        self.device = torch.device(device)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(self.device)
        self.role, self.index = "eval", seed
        self._init_parts()

    def _refuse_if_restarted(self) -> None:
        pass

    def build_optimizer(self, train_config: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=train_config or 1e-2)


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


# ---------------------------------------------------------------- state, checkpoints, reference
def train_once(host: Host, seed: int) -> None:
    """One optimizer step of `host` on a batch drawn from `seed` (the same batch for every host)."""
    assert host.optimizer is not None
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)).to(host.device)
    host.optimizer.zero_grad()
    host.model(x).pow(2).mean().backward()
    host.optimizer.step()


def trained(seed: int, steps: int = 2, device: str = "cpu") -> Host:
    host = Host(seed, device=device)
    host.optimizer = host.build_optimizer(None)
    for step in range(steps):
        train_once(host, 100 + step)
    return host


def optimizer_tensors(host: Host) -> list[torch.Tensor]:
    assert host.optimizer is not None
    state = host.optimizer.state_dict()["state"]
    return [t for k in sorted(state) for _, t in sorted(state[k].items()) if torch.is_tensor(t)]


def test_weights_inspection_names_the_same_weights_the_same_way() -> None:
    a, b, other = Host(5), Host(5), Host(6)
    assert a.get_weight_checksum() == b.get_weight_checksum() != other.get_weight_checksum()
    assert a.get_param_fingerprint() == b.get_param_fingerprint() != other.get_param_fingerprint()
    copy = other.get_state_dict()
    other.load_state_dict(a.get_state_dict())
    assert other.get_weight_checksum() == a.get_weight_checksum()
    assert checksum(copy) != a.get_weight_checksum()  # the copy taken before is independent
    a.set_weight_version(7)
    assert (a.get_weight_version(), b.get_weight_version()) == (7, 0)
    assert a.get_weight_layout(4096) == Layout.from_state_dict(b.model.state_dict(), 4096).to_dict()


def test_a_training_state_copied_to_a_second_host_makes_its_next_step_identical() -> None:
    source, replica = trained(1), Host(2)
    replica.load_training_state(source.get_training_state())
    assert replica.get_weight_checksum() == source.get_weight_checksum()
    train_once(source, 7)
    train_once(replica, 7)
    assert replica.get_weight_checksum() == source.get_weight_checksum()
    assert all(
        torch.equal(x, y) for x, y in zip(optimizer_tensors(source), optimizer_tensors(replica), strict=True)
    )
    fresh = Host(2)  # without the optimizer state, the same step lands elsewhere (Adam's moments)
    fresh.load_state_dict(trained(1).get_state_dict())
    fresh.optimizer = fresh.build_optimizer(None)
    train_once(fresh, 7)
    assert fresh.get_weight_checksum() != source.get_weight_checksum()


def test_a_checkpoint_saved_in_the_background_loads_back_bit_exact(tmp_path: Path) -> None:
    source = trained(3)
    source.set_weight_version(4)
    expected, moments = source.get_weight_checksum(), [t.clone() for t in optimizer_tensors(source)]
    path = source.save_checkpoint(str(tmp_path / "ckpt" / "a.pt"), async_save=True)
    train_once(source, 9)  # the checkpoint holds the state of the call, not what came after
    source.finalize_async_save()
    target = trained(8, steps=1)
    assert target.load_checkpoint(path) == 4
    assert target.get_weight_checksum() == expected != source.get_weight_checksum()
    assert all(torch.equal(x, y) for x, y in zip(moments, optimizer_tensors(target), strict=True))
    target.finish_training()


def test_reference_logprobs_equal_a_direct_log_softmax_gather_and_stay_frozen() -> None:
    host = Host(4)
    obs = torch.randn(10, 16, generator=torch.Generator().manual_seed(0))
    actions = torch.randint(0, 4, (10,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        direct = torch.log_softmax(host.model(obs), dim=-1).gather(-1, actions[:, None]).squeeze(-1)
    data = {"obs": obs, "actions": actions}
    out = host.get_reference_policy_logprobs(data=data, micro_batch_size=3)["reference_logprobs"]
    assert out.shape == (10,)
    torch.testing.assert_close(out, direct)
    host.load_state_dict(Host(5).get_state_dict())  # the policy moves on, the reference does not
    torch.testing.assert_close(host.get_reference_policy_logprobs(data=data)["reference_logprobs"], direct)
    host.load_training_state(Host(5).get_training_state())  # a new training state: a new reference
    assert not torch.allclose(host.get_reference_policy_logprobs(data=data)["reference_logprobs"], direct)


def test_reference_logprobs_of_token_ids_score_each_token_by_the_logits_before_it() -> None:
    torch.manual_seed(0)
    lm = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    ids = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(2))
    out = reference_logprobs(lm, {"input_ids": ids}, lambda m, d: m(d["input_ids"]), micro_batch_size=2)
    logp = torch.log_softmax(lm(ids).detach(), dim=-1)
    assert out.shape == (3, 5)
    assert torch.equal(out[:, 0], torch.zeros(3))
    for i in range(1, 5):
        torch.testing.assert_close(out[:, i], logp[torch.arange(3), i - 1, ids[:, i]])


# ---------------------------------------------------------------- device facts, profiling, offload
class OnNode(Host):
    """A host whose cluster layer names its node (the hook the device facts read)."""

    def _get_node_id(self) -> str:
        return "0123456789abcdef0123"


def test_device_calls_use_the_hosts_node_and_the_models_size(tmp_path: Path) -> None:
    host = OnNode(3)
    assert host.is_alive()
    assert host.report_device_id().endswith("-0123456789ab")
    info = host.get_gpu_info()
    assert info["node_id"] == "0123456789abcdef0123"
    assert info["memory_allocated"] == sum(
        t.numel() * t.element_size() for t in host.model.state_dict().values()
    )
    assert host.get_free_memory_bytes() > 0
    assert host.report_node_ip_and_gpu_id() == ("127.0.0.1", -1)  # no GPU: no GPU id
    host.reset_peak_memory_stats()
    host.start_gpu_profiling(str(tmp_path))
    host.model(torch.randn(2, 16))
    trace = host.stop_gpu_profiling()
    assert trace is not None
    assert os.path.basename(trace).startswith("eval3-")
    assert os.path.getsize(trace) > 0
    assert host.stop_gpu_profiling() is None  # not running any more


def test_timings_measure_a_block_even_when_it_raises(capsys: Any) -> None:
    host = Host(1)
    with host._timings.measure("train"):
        pass
    with pytest.raises(ValueError), host._timings.measure("train"):
        raise ValueError("bad batch")
    assert host.print_timing_summary()["train"]["count"] == 2
    assert "[eval1] train: n=2" in capsys.readouterr().out


def test_offload_calls_keep_values_and_report_their_state() -> None:
    host = trained(2)
    before, moments = host.get_weight_checksum(), [t.clone() for t in optimizer_tensors(host)]
    host.offload_model_param_and_grad(offload_grad=False)
    host.offload_optimizer()
    assert host.get_offload_state() == {"model": True, "optimizer": True, "grad": False}
    host.reload_model_param_and_grad()
    host.reload_optimizer()
    host.offload_model()
    host.reload_model()
    assert host.get_offload_state() == {"model": False, "optimizer": False, "grad": False}
    assert host.get_weight_checksum() == before
    assert all(torch.equal(x, y) for x, y in zip(moments, optimizer_tensors(host), strict=True))


def test_shutdown_finishes_the_checkpoint_and_leaves_the_node_buffer(tmp_path: Path) -> None:
    host = Host(6)
    layout = Layout.from_state_dict(host.model.state_dict(), 4096).to_dict()
    name = host.create_shared_writer(layout, 1, "rlfleet-test-host")
    assert glob.glob(f"/dev/shm/{name}*")
    path = host.save_checkpoint(str(tmp_path / "last.pt"), async_save=True)
    host.start_gpu_profiling(str(tmp_path))
    assert host.shutdown() is True
    assert Checkpoints.load(path)["version"] == 0
    assert not glob.glob(f"/dev/shm/{name}*")  # unlinked by its writer
    assert host.stop_gpu_profiling() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_and_offload_calls_on_a_gpu_host() -> None:
    host = trained(2, device="cuda")
    before, moments = host.get_weight_checksum(), [t.cpu() for t in optimizer_tensors(host)]
    allocated = torch.cuda.memory_allocated()
    host.offload_model_param_and_grad()
    host.offload_optimizer()
    # storage-level offload: the same Parameter objects, their device memory freed
    assert is_offloaded(host.model)
    assert is_offloaded(host.optimizer)
    assert all(p.untyped_storage().nbytes() == 0 for p in host.model.parameters())
    assert torch.cuda.memory_allocated() < allocated
    host.reload_model_param_and_grad()
    host.reload_optimizer()
    assert not is_offloaded(host.model)
    assert {t.device.type for t in host.model.parameters()} == {"cuda"}
    assert host.get_weight_checksum() == before
    assert all(torch.equal(x, y.cpu()) for x, y in zip(moments, optimizer_tensors(host), strict=True))
    assert host.report_device_id().startswith("GPU-")
    assert host.get_gpu_info()["device"].startswith("cuda:")
    assert host.report_node_ip_and_gpu_id() == ("127.0.0.1", 0)
