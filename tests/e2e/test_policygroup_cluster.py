"""End to end on a 3-node Ray cluster: build_policy_group from a rlfleet.placement plan, then train,
sync with rlfleet.weightsync layouts and checks, route with rlfleet.routing."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

ray = pytest.importorskip("ray")

from rlfleet.policygroup import (  # noqa: E402
    BasePolicy,
    BatchedData,
    PolicyConfig,
    PolicyGroup,
    TrainConfig,
    WeightBufferConfig,
    build_policy_group,
)

pytestmark = pytest.mark.timeout(400)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # TinyPolicy lives in this module
OBS = 6


class TinyPolicy(BasePolicy):
    def build_model(self) -> nn.Module:
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(OBS, 16), nn.ReLU(), nn.Linear(16, 3))

    def rollout_step(self, env_ret: Any) -> dict[str, Any]:
        logits = self.model(torch.as_tensor(env_ret, dtype=torch.float32)[None])[0]
        return {"logits": logits.tolist(), "version": self.get_weight_version(), "node": self._get_node_id()}

    def train_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        assert self.optimizer is not None
        g = torch.Generator().manual_seed(int(kwargs.get("seed", 0)))
        x, y = torch.randn(8, OBS, generator=g), torch.randn(8, 3, generator=g)
        self.optimizer.zero_grad()
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        self.allreduce_gradients()
        self.optimizer.step()
        return {"loss": float(loss.detach())}


def cfg(strategy: str, kind: str, **kw: Any) -> PolicyConfig:
    return PolicyConfig(
        weight_buffer=WeightBufferConfig(type=kind, buffer_strategy=strategy, bucket_bytes=1024),
        group_timeout_s=30.0,
        sync_timeout_s=60.0,
        rpc_timeout_s=90.0,
        **kw,
    )


def step_and_check(group: PolicyGroup, seed: int) -> None:
    group.train(None, seed=seed)
    group.sync_weights()
    assert group.verify_eval_weight_checksums()
    assert group.verify_eval_weight_consistency()
    assert group.eval_weight_versions() == [group.weight_version] * len(group.eval_list)
    x = torch.randn(10, OBS, generator=torch.Generator().manual_seed(seed)).tolist()
    out = ray.get(group.rollout_batch(BatchedData([f"env-{i}" for i in range(10)], x)).values(), timeout=60)
    model = TinyPolicy().model
    model.load_state_dict(ray.get(group.train_list[0].get_state_dict.remote(), timeout=60))
    with torch.no_grad():
        expected = model(torch.tensor(x))
    torch.testing.assert_close(torch.tensor([r["logits"] for r in out]), expected, rtol=0, atol=1e-6)
    assert {r["version"] for r in out} == {group.weight_version}


def test_built_disaggregated_group_places_syncs_and_routes(cluster: Any, tmp_path: Any) -> None:
    group = build_policy_group(TinyPolicy, 2, 4, cfg("Shared", "CPUWeightBuffer", rollout_mode="async"))
    try:
        placement = group.placement
        assert placement is not None
        planned = {w.worker_id: w.node for w in placement.workers}
        for i, p in enumerate(group.train_list):
            assert group.node_of(p) == planned[f"train-{i}"]
        for i, p in enumerate(group.eval_list):
            assert group.node_of(p) == planned[f"eval-{i}"]
        assert len(set(planned.values())) == 3
        # eval nodes hold no trainer: weights cross nodes by broadcast
        assert any(s.transport == "broadcast" for s in group._sync.steps)
        for seed in (1, 2, 3):
            step_and_check(group, seed)
        path = str(tmp_path / "ckpt.pt")
        group.save_checkpoint(path)
        saved = torch.load(path, weights_only=True)["model"]
        assert saved.keys() == TinyPolicy().model.state_dict().keys()
    finally:
        group.shutdown()


def test_built_colocated_group_in_a_placement_group(cluster: Any) -> None:
    group = build_policy_group(
        TinyPolicy, 2, 2, cfg("Double", "WeightBuffer"), colocated=True, scheduling="placement_group"
    )
    try:
        for t, e in zip(group.train_list, group.eval_list, strict=True):
            assert group.node_of(t) == group.node_of(e)  # eval i shares train i's bundle
        step_and_check(group, 4)
        group.reset_training_state(TrainConfig(lr=1e-2), seed=3)  # barrier over the train group
        group.offload_model_param_and_grad()
        group.reload_model_param_and_grad()
        group.offload_eval_model()
        group.reload_eval_model()
        group.print_timing_summary(reset=True)
        step_and_check(group, 5)
    finally:
        group.shutdown()
