"""Deltas through the ShmRing's slots across real processes: bit-exact in bf16, a restarted
reader makes the version full, a corrupted base is refused by digest (that reader keeps its
version) and its next version is full and bit-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ring_delta_workers as rdw
from weightsync_dist_workers import run_ranks

from rlfleet.weightsync import ShmRingSender


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    path = Path(tmp_path_factory.mktemp("ring_delta")) / "name"
    return run_ranks(rdw.scenario_ring_delta, 3, str(path), timeout=200.0)


def _sent(ring_run: dict[int, Any], version: int) -> dict[str, Any]:
    step = ring_run[0][f"v{version}"]
    assert step["ok"], step
    value: dict[str, Any] = step["value"]
    return value


@pytest.mark.timeout(260)
def test_ring_deltas_are_bit_exact_in_bf16(ring_run: dict[int, Any]) -> None:
    assert _sent(ring_run, 1)["base"] is None
    for v in (2, 3, 5, 8):
        sent = _sent(ring_run, v)
        assert sent["base"] == v - 1, (v, sent)
        assert sent["lacking"] == []
        assert sent["sent"] < 0.5 * sent["full"], (v, sent)
        assert sent["outcomes"] == {"0": "committed", "1": "committed"}
    for rank in (1, 2):
        for v in (1, 2, 3, 4, 5, 7, 8):
            step = ring_run[rank][f"v{v}"]
            assert step["ok"], (rank, v, step)
            assert step["applied"] == v
            assert step["exact"], (rank, v, step)


@pytest.mark.timeout(260)
def test_a_restarted_ring_reader_makes_the_version_full(ring_run: dict[int, Any]) -> None:
    v4 = _sent(ring_run, 4)
    assert v4["base"] is None
    assert v4["lacking"] == [0]
    assert v4["sent"] == v4["full"]


@pytest.mark.timeout(260)
def test_a_corrupted_ring_base_is_refused_by_digest_and_the_next_version_is_full(
    ring_run: dict[int, Any],
) -> None:
    v6 = _sent(ring_run, 6)
    assert v6["base"] == 5
    assert v6["outcomes"] == {"0": "committed", "1": "failed"}
    refused = ring_run[2]["v6"]
    assert refused["type"] == "ChecksumMismatchError", refused
    assert "digest" in refused["message"]
    assert refused["applied"] == 5  # keeps serving 5
    assert ring_run[1]["v6"]["applied"] == 6  # readers of a ring commit one by one
    v7 = _sent(ring_run, 7)
    assert v7["base"] is None  # reader 1 holds 5, not 6: full
    assert v7["lacking"] == [1]


def test_ring_delta_is_off_by_default_and_a_bad_mode_is_named() -> None:
    import wire_workers as ww

    with pytest.raises(ValueError, match="delta must be one of"):
        ShmRingSender(ww.wire_layout(), 1, delta="on")
    assert ShmRingSender.__init__.__kwdefaults__["delta"] == "off"
