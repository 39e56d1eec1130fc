"""The worker surface and a local sync on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch
from pg_policies import OBS_DIM, MLPPolicy

from rlfleet.policygroup import BatchedData, PolicyConfig, PolicyGroup, TrainConfig, WeightBufferConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_device_facts_on_gpu() -> None:
    policy = MLPPolicy(PolicyConfig(train_num_gpus=1), role="train")
    assert policy.device.type == "cuda"
    info = policy.get_gpu_info()
    assert info["device"].startswith("cuda")
    assert info["total_memory"] >= info["free_memory"] > 0
    assert policy.report_device_id().startswith("GPU-")
    assert 0 < policy.get_free_memory_bytes() <= info["total_memory"]
    policy.reset_peak_memory_stats()
    policy.start_gpu_profiling()
    policy.train(None, seed=1)
    assert policy.stop_gpu_profiling() is not None


@pytest.mark.parametrize("strategy", ["None", "Double"])
def test_local_sync_on_gpu(strategy: str) -> None:
    cfg = PolicyConfig(
        train_num_gpus=1, eval_num_gpus=1, weight_buffer=WeightBufferConfig(buffer_strategy=strategy)
    )
    group = PolicyGroup([MLPPolicy(cfg, role="train")], [MLPPolicy(cfg, index=i) for i in range(2)], cfg)
    group.init(TrainConfig())
    group.init_placement_info()
    group.init_weight_buffer()
    group.train(None, seed=2)
    group.sync_weights()
    assert group.verify_eval_weight_checksums()
    out = group.rollout_batch(BatchedData(["env-0"], [torch.zeros(OBS_DIM).tolist()]))
    assert out.values()[0]["version"] == 1
    group.shutdown()
