"""NeMo RL's nccl_reshard worker calls on BasePolicy workers in plain processes over gloo:
training PP2 -> generation TP2, one group per training pipeline stage, bit-exact shards, kv
scales delivered, and a stalled trainer that leaves the generation weights as they were."""

from __future__ import annotations

from typing import Any

import pytest
import reshard_worker_procs as procs

from rlfleet.policygroup import BasePolicy


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    return procs.run()


@pytest.mark.timeout(300)
def test_prepare_reports_the_plan(results: dict[int, Any]) -> None:
    infos = [results[r]["info"] for r in range(4)]
    assert len({i["digest"] for i in infos}) == 1
    assert [i["role"] for i in infos] == ["train", "train", "gen", "gen"]
    for gen in infos[2:]:
        assert gen["bytes"] == gen["own_shard_bytes"]
        assert gen["peers"] == [0, 1]  # both pipeline stages send to each generation rank
    assert infos[0]["train"]["pp"] == 2
    assert infos[2]["gen"]["tp"] == 2


@pytest.mark.timeout(300)
def test_refit_is_bit_exact_and_carries_kv_scales(results: dict[int, Any]) -> None:
    for r in (0, 1):
        assert results[r]["v1"]["ok"], results[r]["v1"]
    for r in (2, 3):
        gen = results[r]
        assert gen["v1"]["ok"], gen["v1"]
        assert gen["v1_exact"]
        assert gen["version"] == 1
        assert gen["k_scale"] == 0.25
        assert gen["kv_scales"] == {"k_scale": 0.25}


@pytest.mark.timeout(300)
def test_stalled_trainer_times_out_and_old_weights_stay(results: dict[int, Any]) -> None:
    for r in (2, 3):
        gen = results[r]
        assert gen["stall"]["type"] == "SyncTimeoutError", gen["stall"]
        assert gen["intact"]
        assert gen["version_after"] == 1
    for r in (0, 1):
        assert not results[r]["stall"]["ok"]


def test_base_policy_speaks_the_reshard_calls() -> None:
    for name in ("init_nccl_reshard_comm_group", "prepare_nccl_reshard_refit_info", "nccl_reshard_refit"):
        assert callable(getattr(BasePolicy, name))
