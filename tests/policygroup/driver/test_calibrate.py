"""`PolicyGroup.calibrate` on a local group: the probes' terms and a few real syncs, fitted, and the
host copy rate the probe measured kept as evidence (not discarded by the fit)."""

from __future__ import annotations

import math

import torch

from rlfleet.placement import CostModel
from rlfleet.policygroup import BasePolicy, PolicyConfig, PolicyGroup, WeightBufferConfig


class _Wide(BasePolicy):
    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])


def test_calibrate_fits_real_syncs_anchored_on_the_probed_copy_rate() -> None:
    config = PolicyConfig(weight_buffer=WeightBufferConfig(buffer_strategy="Shared", bucket_bytes=1 << 16))
    group = PolicyGroup([_Wide(config, "train")], [_Wide(config, "eval", index=i) for i in range(2)], config)
    try:
        group.init_placement_info()
        group.init_weight_buffer()
        model = group.calibrate(syncs=2)
        assert isinstance(model, CostModel)
        assert model.source.startswith("calibrate(): control round trip")
        assert "fit_cost_model: NNLS over" in model.source
        assert "anchored on measured memcpy_s_per_byte" in model.source
        assert math.isfinite(model.memcpy_bytes_per_s)
        assert model.memcpy_bytes_per_s > 0
    finally:
        group.shutdown()
