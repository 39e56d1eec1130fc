"""nccl_reshard refits with ``WeightBufferConfig(delta="auto")`` on BasePolicy workers in plain
processes over gloo (training PP2 -> generation TP2): versions after the first send each
generation worker the delta of its own slices, fewer bytes than full, and every version lands
bit for bit; a reset generation worker gets full, a corrupted base is refused by digest and the
retry goes full (`reshard_delta_procs` has the steps)."""

from __future__ import annotations

from typing import Any

import pytest
import reshard_delta_procs as procs

TRAINERS, GENS = (0, 1), (2, 3)
STAGES = [0, 1]  # each generation worker's training peers


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    return procs.run()


def _ok(results: dict[int, Any], step: str) -> None:
    for r in TRAINERS + GENS:
        assert results[r][step]["ok"], (r, step, results[r][step])


def _assert_delta(stats: dict[str, Any], base: int, peers: list[int]) -> None:
    assert stats["base"] == base, stats
    assert stats["delta_peers"] == peers, stats
    assert 0 < stats["bytes"] < stats["full_bytes"], stats


def _assert_holds(result: dict[str, Any], version: int) -> None:
    """A generation worker holds `version`, bit for bit."""
    assert result["version"] == version, result
    assert result["exact"], result


def _assert_full(stats: dict[str, Any]) -> None:
    assert stats["base"] is None, stats
    assert stats["delta_peers"] == [], stats
    assert stats["bytes"] == stats["full_bytes"] > 0, stats


@pytest.mark.timeout(300)
def test_first_version_goes_full_and_is_exact(results: dict[int, Any]) -> None:
    _ok(results, "v1")
    for r in TRAINERS + GENS:
        _assert_full(results[r]["v1"]["stats"])
    for r in GENS:
        _assert_holds(results[r]["v1"], 1)


@pytest.mark.timeout(300)
def test_later_versions_move_deltas_and_stay_bit_exact(results: dict[int, Any]) -> None:
    for step, version in (("v2", 2), ("v3", 3)):
        _ok(results, step)
        for r in TRAINERS:
            _assert_delta(results[r][step]["stats"], version - 1, [0, 1])  # both generation ranks
        for r in GENS:
            _assert_delta(results[r][step]["stats"], version - 1, STAGES)
            _assert_holds(results[r][step], version)
            # the same messages weigh the same full whichever way they travel
            assert results[r][step]["stats"]["full_bytes"] == results[r]["v1"]["stats"]["full_bytes"]


@pytest.mark.timeout(300)
def test_reset_generation_worker_gets_full_the_other_deltas(results: dict[int, Any]) -> None:
    _ok(results, "v4")
    for r in TRAINERS:
        stats = results[r]["v4"]["stats"]
        assert stats["base"] == 3, stats
        assert stats["delta_peers"] == [0], stats  # not to gen rank 1
        assert stats["bytes"] < stats["full_bytes"], stats
    _assert_delta(results[2]["v4"]["stats"], 3, STAGES)
    _assert_full(results[3]["v4"]["stats"])
    for r in GENS:
        _assert_holds(results[r]["v4"], 4)


@pytest.mark.timeout(300)
def test_corrupted_base_is_refused_and_the_retry_goes_full(results: dict[int, Any]) -> None:
    corrupted, other = results[2]["v5"], results[3]["v5"]
    assert corrupted.get("type") == "ChecksumMismatchError", corrupted
    assert not other["ok"], other
    _assert_holds(other, 4)  # nothing applied
    assert corrupted["version"] == 4
    for r in TRAINERS:
        assert not results[r]["v5"]["ok"], results[r]["v5"]
        assert results[r]["v5"]["version"] == 4, results[r]["v5"]
    _ok(results, "v5_retry")
    for r in TRAINERS + GENS:
        _assert_full(results[r]["v5_retry"]["stats"])
    for r in GENS:
        _assert_holds(results[r]["v5_retry"], 5)


@pytest.mark.timeout(300)
def test_deltas_resume_after_a_full_version(results: dict[int, Any]) -> None:
    _ok(results, "v6")
    for r in TRAINERS:
        _assert_delta(results[r]["v6"]["stats"], 5, [0, 1])
    for r in GENS:
        _assert_delta(results[r]["v6"]["stats"], 5, STAGES)
        _assert_holds(results[r]["v6"], 6)
