"""The policy group over local policy objects (one process, no Ray), config checks, BatchedData."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from pg_policies import OBS_DIM, MLPPolicy
from testkit import wait_until

from rlfleet import routing
from rlfleet.policygroup import (
    BUFFER_STRATEGIES,
    ROUTER_TYPES,
    BatchedData,
    PolicyConfig,
    PolicyGroup,
    PolicyGroupError,
    PolicyRole,
    TrainConfig,
    WeightBufferConfig,
)
from rlfleet.weightsync import SyncTimeoutError

STRATEGIES = [("None", "WeightBuffer"), ("Double", "WeightBuffer"), ("Shared", "CPUWeightBuffer")]


def local_group(strategy: str, kind: str, n_train: int = 2, n_eval: int = 3) -> PolicyGroup:
    cfg = PolicyConfig(
        weight_buffer=WeightBufferConfig(
            type=kind, buffer_strategy=strategy, bucket_bytes=2048, checksums=strategy != "None"
        )
    )
    train = [MLPPolicy(cfg, role="train", index=i) for i in range(n_train)]
    evals = [MLPPolicy(cfg, role="eval", index=i) for i in range(n_eval)]
    group = PolicyGroup(train, evals, cfg)
    group.init(TrainConfig(lr=1e-2))
    group.init_placement_info(is_colocated=False)
    group.init_weight_buffer()
    group.init_comm_group("gloo")  # no-op for local objects, as the seed
    return group


@pytest.mark.parametrize(("strategy", "kind"), STRATEGIES)
def test_local_sync_rollout_and_checks(strategy: str, kind: str) -> None:
    group = local_group(strategy, kind)
    try:
        group.train(None, seed=1)
        assert not group.verify_eval_weight_checksums()
        group.sync_weights()
        assert group.verify_eval_weight_checksums()
        assert group.verify_eval_weight_consistency()
        assert group.eval_weight_versions() == [1, 1, 1]
        batch = torch.randn(6, OBS_DIM).tolist()
        out = group.rollout_batch(BatchedData([f"env-{i}" for i in range(6)], batch))
        expected = group.train_list[0].model(torch.tensor(batch)).detach()
        got = torch.tensor([r["logits"] for r in out.values()])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        assert group.router.in_flight == 0
        post = group.postprocess(BatchedData(out.ids(), batch), out)
        assert post.values() == out.values()  # the default postprocess returns the response
    finally:
        group.shutdown()


class _SlowWriter(MLPPolicy):
    """A trainer whose node-buffer write takes longer than the whole sync may (while `slow`)."""

    slow = True

    def publish_shared(self, version: int, timeout_s: float) -> int:
        if self.slow:
            time.sleep(timeout_s + 0.2)  # a write slower than the whole sync may take
        return super().publish_shared(version, timeout_s)


def test_one_deadline_bounds_every_step_of_a_sync() -> None:
    """A step that starts after the sync's deadline is refused at once (it does not get a fresh
    timeout of its own), and nothing is applied: every rollout worker keeps its version."""
    cfg = PolicyConfig(
        weight_buffer=WeightBufferConfig(type="CPUWeightBuffer", buffer_strategy="Shared", bucket_bytes=2048),
        sync_timeout_s=0.5,
    )
    group = PolicyGroup([_SlowWriter(cfg, role="train")], [MLPPolicy(cfg, index=i) for i in range(3)], cfg)
    group.init(TrainConfig(lr=1e-2))
    group.init_placement_info()
    group.init_weight_buffer()
    try:
        before = [p.get_weight_checksum() for p in group.eval_list]
        group.train(None, seed=2)
        with pytest.raises(PolicyGroupError, match="the sync's deadline passed"):
            group.sync_weights()
        assert group.eval_weight_versions() == [0, 0, 0]
        assert [p.get_weight_checksum() for p in group.eval_list] == before
        report = group.last_sync_report
        assert report is not None
        assert not report.ok
        assert "deadline" in str(report.error)
        # the failed sync left version 1 (of the weights of then) in the node buffer: the next
        # sync, after more training, must not reuse that number and serve those bytes
        group.train_list[0].slow = False
        group.train(None, seed=3)
        group.sync_weights()
        assert group.eval_weight_versions() == [2, 2, 2]
        assert group.verify_eval_weight_checksums()
    finally:
        group.shutdown()


def test_local_sync_report_and_plan() -> None:
    group = local_group("Double", "WeightBuffer")
    try:
        plan = group.sync_plan
        assert plan is not None
        assert [s.transport for s in plan.steps] == ["node_buffer"]
        assert "fallback" in plan.topology_source  # no Ray here (or Ray without rates): documented defaults
        report = group.sync_weights()
        assert report is not None
        assert report.ok
        assert report.matches(plan)
        [step] = report.steps
        assert set(step.phases) >= {"pack", "land", "control"}
        info = group.transfer_info  # the seed's shape, a view of the plan
        [items] = info.values()
        assert items[0]["sender"] is group.train_list[0]
        assert items[0]["receiver"] == group.eval_list
    finally:
        group.shutdown()


def test_shared_strategy_binds_every_eval_to_one_segment() -> None:
    group = local_group("Shared", "CPUWeightBuffer")
    try:
        group.sync_weights()
        # zero-copy: every rollout worker computes straight from its read-only mapping of the node buffer
        for p in group.eval_list:
            start, end = p._weights.endpoint.data_range()
            assert all(start <= t.data_ptr() < end for t in p.model.state_dict().values())
        names = [e["shared_weight_buffer"]["name"] for e in group.shared_weight_buffer_map.values()]
        assert all(os.path.exists(os.path.join("/dev/shm", n)) for n in names)
        group.train(None, seed=9)
        group.sync_weights()  # the writer fills the other slot; readers rebind
        assert group.verify_eval_weight_checksums()
    finally:
        group.shutdown()
    assert not any(os.path.exists(os.path.join("/dev/shm", n)) for n in names)


def test_seed_calls_over_local_objects(tmp_path: object) -> None:
    group = local_group("Double", "WeightBuffer")
    try:
        assert group.update_dataset([[1, 2], [3]]) == [2, 1]
        info = group.train(None, seed=3)
        assert set(info) == {"loss"}
        group.reset_training_state(TrainConfig(lr=1e-3), seed=5)
        group.offload_eval_model()
        group.reload_eval_model()
        group.offload_model_param_and_grad()
        group.reload_model_param_and_grad()
        group.offload_model_optimizer()
        group.print_timing_summary(reset=True)
        path = os.path.join(str(tmp_path), "ckpt.pt")
        group.save_checkpoint(path)
        assert os.path.getsize(path) > 0
        extra = MLPPolicy(group.config, role="eval", index=3)
        group.push(extra, PolicyRole.EVAL)
        assert group.eval_list[-1] is extra
        assert group.pop(PolicyRole.EVAL) is extra
        group.send_weights()
        group.notify_update_weights()
        assert group.wait_for_eval_weight_update(timeout=5)
        assert group.verify_eval_weight_checksums()
    finally:
        group.shutdown()


def test_local_role_conversion_keeps_weights_consistent() -> None:
    group = local_group("Double", "WeightBuffer", n_train=2, n_eval=2)
    try:
        group.train(None, seed=4)
        group.convert_train_to_eval(1)
        assert (len(group.train_list), len(group.eval_list)) == (1, 3)
        assert group.verify_eval_weight_checksums()
        group.convert_eval_to_train(2)
        assert (len(group.train_list), len(group.eval_list)) == (3, 1)
        assert [p.role for p in group.train_list] == [PolicyRole.TRAIN] * 3
        group.train(None, seed=5)
        group.sync_weights()
        assert group.verify_eval_weight_checksums()
        with pytest.raises(ValueError, match="at least one must stay"):
            group.convert_eval_to_train(1)
    finally:
        group.shutdown()


@pytest.mark.parametrize("strategy", ["None", "Double", "Shared"])
def test_a_wire_dtype_serves_the_trainers_weights_cast_once(strategy: str) -> None:
    cfg = PolicyConfig(
        weight_buffer=WeightBufferConfig(
            buffer_strategy=strategy, bucket_bytes=2048, wire_dtype="bfloat16", delta="auto"
        )
    )
    train = [MLPPolicy(cfg, role="train", index=0)]
    evals = [MLPPolicy(cfg, role="eval", index=i) for i in range(2)]
    group = PolicyGroup(train, evals, cfg)
    try:
        group.init(TrainConfig(lr=1e-2))
        group.init_placement_info(is_colocated=False)
        group.init_weight_buffer()
        assert all(p.dtype == torch.bfloat16 for e in evals for p in e.model.parameters())
        assert all(p.dtype == torch.float32 for p in train[0].model.parameters())
        for seed in (1, 2):
            group.train(None, seed=seed)
            group.sync_weights()
            assert group.verify_eval_weight_checksums()  # the trainer's weights cast to bf16, bit for bit
        assert group.eval_weight_versions() == [2, 2]
        served = {k: v.to(torch.bfloat16) for k, v in train[0].model.state_dict().items()}
        for e in evals:
            for name, tensor in e.model.state_dict().items():
                assert torch.equal(tensor, served[name]), name
    finally:
        group.shutdown()


def test_config_combinations_are_checked() -> None:
    with pytest.raises(ValueError, match=r"'WeightBuffer' does not fit .*'Shared'.*'CPUWeightBuffer'"):
        WeightBufferConfig(type="WeightBuffer", buffer_strategy="Shared")
    with pytest.raises(ValueError, match=r"'CPUWeightBuffer' does not fit .*'ShardedWeightBuffer'"):
        WeightBufferConfig(type="CPUWeightBuffer", buffer_strategy="Sharded")
    with pytest.raises(ValueError, match=r"weight_buffer\.type 'Buffer' is unknown"):
        WeightBufferConfig(type="Buffer")
    with pytest.raises(ValueError, match="checksums must be a bool"):
        WeightBufferConfig(checksums="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer_strategy 'Triple' is unknown"):
        WeightBufferConfig(buffer_strategy="Triple")
    with pytest.raises(ValueError, match=r"weight_buffer\.wire_dtype 'int8' is not one of"):
        WeightBufferConfig(wire_dtype="int8")
    with pytest.raises(ValueError, match=r"weight_buffer\.delta must be one of"):
        WeightBufferConfig(delta="on")
    with pytest.raises(ValueError, match="rollout_mode 'batch' is unknown"):
        PolicyConfig(rollout_mode="batch")
    with pytest.raises(ValueError, match="router_type"):
        PolicyConfig(router_type="random")
    with pytest.raises(ValueError, match="sync_timeout_s"):
        PolicyConfig(sync_timeout_s=0)
    with pytest.raises(ValueError, match="component_distribution"):
        PolicyGroup([], [MLPPolicy()], PolicyConfig(router_type="node_affinity"))
    cfg = PolicyConfig(weight_buffer={"type": "CPUWeightBuffer", "buffer_strategy": "Shared"})  # type: ignore[arg-type]
    assert cfg.weight_buffer.buffer_strategy == "Shared"


@pytest.mark.parametrize("strategy", BUFFER_STRATEGIES)
def test_the_buffer_type_follows_from_the_strategy(strategy: str) -> None:
    """The seed's ``type`` names the buffer class a strategy builds: left unset, it is derived;
    the seed's value for that strategy is still accepted."""
    derived = WeightBufferConfig(buffer_strategy=strategy)
    assert derived.type == {"Shared": "CPUWeightBuffer", "Sharded": "ShardedWeightBuffer"}.get(
        strategy, "WeightBuffer"
    )
    assert WeightBufferConfig(type=derived.type, buffer_strategy=strategy).type == derived.type


@pytest.mark.parametrize("router_type", routing.ROUTER_TYPES)
@pytest.mark.parametrize("rollout_mode", routing.ROLLOUT_MODES)
def test_every_router_routing_offers_is_accepted(router_type: str, rollout_mode: str) -> None:
    """The names are routing's own (imported, not copied): a router routing adds is accepted."""
    assert ROUTER_TYPES is routing.ROUTER_TYPES
    assert PolicyConfig(router_type=router_type, rollout_mode=rollout_mode).router_type == router_type


def test_layout_mismatch_names_the_parameter() -> None:
    class Wider(MLPPolicy):
        def build_model(self) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(OBS_DIM, 33))

    cfg = PolicyConfig()
    group = PolicyGroup([MLPPolicy(cfg, role="train")], [Wider(cfg)], cfg)
    group.init_placement_info()
    with pytest.raises(PolicyGroupError, match=r"layout mismatch: parameter '0\.weight'"):
        group.init_weight_buffer()


def test_batched_data() -> None:
    data = BatchedData(["a", "b"], [1, 2])
    assert (data.ids(), data.values(), len(data)) == (["a", "b"], [1, 2], 2)
    assert list(data.items()) == [("a", 1), ("b", 2)]
    with pytest.raises(ValueError, match="2 ids but 1 values"):
        BatchedData(["a", "b"], [1])


def test_sharded_needs_ray_actors() -> None:
    with pytest.raises(PolicyGroupError, match="'Sharded' needs Ray actors"):
        local_group("Sharded", "ShardedWeightBuffer")


class _GatedPolicy(MLPPolicy):
    """A rollout worker whose rollouts wait on a gate, so a test controls when one finishes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.started = threading.Event()

    def rollout_step(self, env_ret: object) -> dict[str, object]:
        if env_ret == "wait":
            self.started.set()
            assert self.gate.wait(30)
            return {"version": self.get_weight_version()}
        return super().rollout_step(env_ret)


def _scaled_state(policy: MLPPolicy, factor: float) -> dict[str, torch.Tensor]:
    return {k: v.detach() * factor for k, v in policy.model.state_dict().items()}


def test_a_weight_swap_waits_for_in_flight_rollouts_and_new_ones_wait_for_it() -> None:
    cfg = PolicyConfig(drain_timeout_s=0.3)
    policy = _GatedPolicy(cfg, role="eval", index=0)
    before = _scaled_state(policy, 1.0)
    slow = threading.Thread(target=policy._rollout, args=("wait",))
    slow.start()
    try:
        assert policy.started.wait(10)
        # a rollout holds the model: the swap gives up at its drain deadline, weights untouched
        with pytest.raises(SyncTimeoutError, match="in-flight requests"):
            policy.recv_weights_ipc(_scaled_state(policy, 2.0), version=7)
        assert policy.get_weight_version() == 0
        for name, t in policy.model.state_dict().items():
            assert torch.equal(t, before[name])

        # with room to drain, the swap waits; a rollout arriving meanwhile waits for the swap
        policy.config.drain_timeout_s = 30.0
        swap = threading.Thread(target=policy.recv_weights_ipc, args=(_scaled_state(policy, 2.0), 7))
        swap.start()
        wait_until(lambda: policy._serve._waiting_writers == 1, 10, "the swap waits for the model")
        seen: list[object] = []
        late = threading.Thread(target=lambda: seen.append(policy._rollout(torch.zeros(OBS_DIM).tolist())))
        late.start()
        wait_until(lambda: policy.get_num_requests() == 2, 10, "the late rollout asked to be served")
        assert not seen  # held back behind the waiting swap (which waits for the gated rollout)
        policy.gate.set()
        for t in (slow, swap, late):
            t.join(10)
            assert not t.is_alive()
        assert [r["version"] for r in seen] == [7]  # type: ignore[index]
        assert policy.get_weight_version() == 7
    finally:
        policy.gate.set()
        slow.join(10)
