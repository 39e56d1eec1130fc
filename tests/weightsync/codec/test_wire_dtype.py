"""fp32 trainer weights sent as bf16 through the ShmRing, CUDA IPC (host slots) and reshard P2P,
across real processes (the broadcast and node buffer: `test_delta_transports`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import wire_workers as ww
from weightsync_dist_workers import run_ranks


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", ["ring", "ipc"])
def test_ring_and_ipc_carry_the_engine_dtype(transport: str, tmp_path: Path) -> None:
    results = run_ranks(ww.scenario_ring_and_ipc, 3, str(tmp_path / "name"), transport, timeout=150.0)
    for version in (1, 2, 3):
        assert results[0][f"v{version}"]["ok"], results[0]
        for rank in (1, 2):
            step = results[rank][f"v{version}"]
            assert step["ok"], (rank, version, step)
            assert step["exact"], (rank, version, step)


@pytest.mark.timeout(200)
def test_reshard_casts_fp32_shards_once_when_asked() -> None:
    results = run_ranks(ww.scenario_reshard_cast, 3, timeout=150.0)
    for rank in (0, 1):
        refused = results[rank]["refused"]
        assert not refused["ok"]
        assert "float32" in refused["message"]
        assert "bfloat16" in refused["message"]
        assert results[rank]["v1"]["ok"]
        assert results[rank]["v2"]["ok"]
    assert not results[2]["refused"]["ok"]
    assert results[2]["v1"]["exact"]
    assert results[2]["v2"]["exact"]
