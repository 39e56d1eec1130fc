"""Reshard deltas over real gloo between spawned processes: each generation rank gets the delta
of its own slices from each training rank, bit-exact in bf16; base tracking per destination
(a restarted rank and one that missed a version get full, the others deltas); a corrupted base
refused by digest, the previous version kept, the next version full and bit-exact."""

from __future__ import annotations

from typing import Any

import pytest
import reshard_delta_workers as rdw
import reshard_workers as rw
from weightsync_dist_workers import run_ranks

from rlfleet.weightsync import ReshardSender

TRAINS, GENS = (0, 1), (2, 3)


@pytest.fixture(scope="module")
def delta_run() -> dict[int, Any]:
    return run_ranks(rdw.scenario_reshard_delta, 4, timeout=200.0)


def _ok(step: dict[str, Any]) -> dict[str, Any]:
    assert step["ok"], step
    value: dict[str, Any] = step["value"]
    return value


@pytest.mark.timeout(260)
def test_reshard_deltas_are_bit_exact_in_bf16_per_destination(delta_run: dict[int, Any]) -> None:
    for t in TRAINS:
        first = _ok(delta_run[t]["v1"])
        assert first["base"] is None
        assert first["delta_peers"] == []
        for v in (2, 3, 8):
            stats = _ok(delta_run[t][f"v{v}"])
            assert stats["base"] == v - 1, (t, v, stats)
            assert stats["delta_peers"] == [0, 1]  # both generation ranks, each its own slices
            assert stats["nbytes"] < 0.5 * stats["full_bytes"], (t, v, stats)  # control words included
        assert delta_run[t]["base_bytes"] >= _ok(delta_run[t]["v1"])["full_bytes"]
    for r in GENS:
        for v in (1, 2, 3, 4, 5, 7, 8):
            step = delta_run[r][f"v{v}"]
            assert step["ok"], (r, v, step)
            assert step["applied"] == v, (r, v, step)
            assert step["exact"], (r, v, step)
        for v in (2, 3, 8):
            assert delta_run[r][f"v{v}"]["value"]["delta_peers"] == list(TRAINS)  # from both


@pytest.mark.timeout(260)
def test_a_restarted_generation_rank_gets_full_and_the_other_deltas(delta_run: dict[int, Any]) -> None:
    for t in TRAINS:
        v4 = _ok(delta_run[t]["v4"])
        assert v4["base"] == 3
        assert v4["delta_peers"] == [1]  # generation rank 0 restarted: full to it
    assert _ok(delta_run[2]["v4"])["delta_peers"] == []
    assert _ok(delta_run[3]["v4"])["delta_peers"] == list(TRAINS)


@pytest.mark.timeout(260)
def test_a_generation_rank_that_missed_a_version_gets_full(delta_run: dict[int, Any]) -> None:
    for t in TRAINS:
        v5 = _ok(delta_run[t]["v5"])
        assert v5["base"] == 4
        assert v5["delta_peers"] == [1]  # generation rank 0 holds 3, not 4
    assert _ok(delta_run[2]["v5"])["delta_peers"] == []
    assert delta_run[2]["v5"]["exact"]


@pytest.mark.timeout(260)
def test_a_corrupted_base_is_refused_by_digest_and_the_next_version_is_full(
    delta_run: dict[int, Any],
) -> None:
    for t in TRAINS:
        v6 = delta_run[t]["v6"]
        assert not v6["ok"]
        assert v6["type"] == "SyncAbortedError", v6
        assert "gen rank 1 saw a checksum mismatch" in v6["message"], v6
    refused = delta_run[3]["v6"]
    assert refused["type"] == "ChecksumMismatchError", refused
    assert "digest" in refused["message"]
    assert "(embed)" in refused["message"]
    assert not delta_run[2]["v6"]["ok"]
    for r in GENS:
        assert delta_run[r]["v6"]["applied"] == 5  # everybody keeps serving 5
    assert delta_run[2]["v6"]["exact"]  # bit for bit (rank 1 serves its corrupted 5)
    for t in TRAINS:
        v7 = _ok(delta_run[t]["v7"])
        assert v7["base"] is None  # the bases were forgotten: full
        assert v7["delta_peers"] == []
        assert _ok(delta_run[t]["v8"])["base"] == 7


def test_delta_is_off_by_default_and_a_bad_mode_is_named() -> None:
    train, _ = rw.programs(rw.model(False), rw.model(True), rdw.CASE.train, rdw.CASE.gen)
    with pytest.raises(ValueError, match="delta must be one of"):
        ReshardSender(train[0], [], delta="on")
    assert ReshardSender.__init__.__kwdefaults__["delta"] == "off"


def test_a_control_word_that_does_not_fit_its_message_is_refused() -> None:
    from rlfleet.weightsync import MetadataError, RankProgram
    from rlfleet.weightsync.protocol._frames import Control
    from rlfleet.weightsync.reshard._reshard_delta import MessageDeltas, check_control, padded

    train, _ = rw.programs(rw.model(False), rw.model(True), rdw.CASE.train, rdw.CASE.gen)
    msg = RankProgram.from_dict(train[0]).messages(rw.BUCKET, rw.DIRECT_MIN)[0]
    assert check_control(Control(msg.index, msg.nbytes), msg).kind == "full"
    assert check_control(Control(msg.index, 64, kind="sparse", digest=5), msg).nbytes == 64
    with pytest.raises(MetadataError, match=f"message {msg.index} from train rank 0"):
        check_control(Control(msg.index, msg.nbytes + 1), msg)
    with pytest.raises(MetadataError, match="is a sparse payload"):
        check_control(Control(msg.index, padded(msg.nbytes), kind="sparse", digest=5), msg)
    with pytest.raises(MetadataError, match="names message"):
        check_control(Control(msg.index + 1, msg.nbytes), msg)
    with pytest.raises(ValueError, match="delta max_fraction"):
        MessageDeltas([msg], "auto", 0.0)
