"""Deltas in the wire dtype across real processes: bit-exact, base tracking, refusal by digest."""

from __future__ import annotations

from typing import Any

import pytest
import wire_workers as ww
from weightsync_dist_workers import run_ranks


@pytest.fixture(scope="module")
def broadcast_run() -> dict[int, Any]:
    return run_ranks(ww.scenario_broadcast, 4, ["double", "node", "direct"], timeout=200.0)


@pytest.mark.timeout(260)
def test_broadcast_deltas_are_bit_exact_in_bf16(broadcast_run: dict[int, Any]) -> None:
    sender = broadcast_run[0]
    assert sender["v1"]["ok"]
    assert sender["v1"]["value"]["base"] is None
    for v in (2, 3, 5, 8):
        assert sender[f"v{v}"]["ok"], sender[f"v{v}"]
        stats = sender[f"v{v}"]["value"]
        assert stats["base"] == v - 1
        assert stats["full_ranks"] == []
        assert stats["wire"] < 0.5 * stats["full"]
    for rank in (1, 2, 3):
        for v in (1, 2, 3, 4, 5, 7, 8):
            step = broadcast_run[rank][f"v{v}"]
            assert step["ok"], (rank, v, step)
            assert step["applied"] == v, (rank, v, step)
            assert step["exact"], (rank, v, step)


@pytest.mark.timeout(260)
def test_a_restarted_receiver_gets_full(broadcast_run: dict[int, Any]) -> None:
    assert broadcast_run[0]["v4"]["ok"]
    v4 = broadcast_run[0]["v4"]["value"]
    assert v4["base"] is None
    assert v4["full_ranks"] == [1]
    assert v4["wire"] >= 0.45 * v4["full"]


@pytest.mark.timeout(260)
def test_a_corrupted_base_is_refused_by_digest_and_the_next_version_is_full(
    broadcast_run: dict[int, Any],
) -> None:
    v6 = broadcast_run[0]["v6"]
    assert not v6["ok"]
    assert "rank 2 saw a checksum mismatch" in v6["message"], v6
    refused = broadcast_run[2]["v6"]
    assert not refused["ok"]
    assert refused["type"] == "ChecksumMismatchError"
    assert "digest" in refused["message"]
    for rank in (1, 2, 3):
        assert broadcast_run[rank]["v6"]["applied"] == 5  # everyone keeps serving 5
    assert broadcast_run[0]["v7"]["value"]["base"] is None  # the sender forgot its base: full
    assert broadcast_run[0]["v8"]["value"]["base"] == 7


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("point", "victim"), [("encode", 0), ("wire", 0), ("apply", 1), ("commit", 1)])
def test_a_process_killed_mid_delta_leaves_the_previous_version_served(point: str, victim: int) -> None:
    results = run_ranks(ww.scenario_kill_point, 3, point, timeout=150.0, expect_dead=(victim,))
    for rank in (0, 1, 2):
        if rank == victim:
            continue
        assert results[rank]["v2"]["ok"], results[rank]
        assert not results[rank]["v3"]["ok"], (point, rank, results[rank]["v3"])
    for rank in (1, 2):
        if rank != victim:
            step = results[rank]["v3"]
            assert step["applied"] == 2, (point, rank, step)
            assert step["exact"], (point, rank, step)  # still serving version 2, bit for bit
    if victim != 0:
        assert results[0]["v2"]["value"] == 1  # version 2 was a delta against 1
        assert results[0]["offer_after"] is None  # the sender forgot its base: the next version is full
