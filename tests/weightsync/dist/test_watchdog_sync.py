"""Sync deadlines a controller can stand down (`SyncWatch`): the watchdog enforces the deadline,
the wire waits only for data or a lost peer. In-process checks of the deadline and the watchdog,
then real gloo in spawned processes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import watchdog_workers as ww
import weightsync_dist_workers as w
from testkit import wait_until

from rlfleet.weightsync import (
    Deadline,
    SyncWatch,
    WatchedDeadline,
    armed_watchdogs,
    stand_down_armed_watchdogs,
)


def test_a_lifted_deadline_never_expires() -> None:
    deadline = WatchedDeadline(0.01)
    wait_until(lambda: deadline.expired, 10, "a 10 ms deadline expired")
    assert deadline.remaining() == 0.0
    deadline.lift()
    assert deadline.lifted
    assert not deadline.expired
    assert deadline.remaining() is None
    deadline.check("anything")  # does not raise
    assert deadline.child(5.0).remaining() == pytest.approx(5.0, abs=0.5)
    assert deadline.leaving(1.0).remaining() is None


def test_guard_arms_a_watchdog_that_stand_down_lifts() -> None:
    watch = SyncWatch("unit")
    with watch.guard(30.0, "a sync") as deadline:
        assert watch.in_flight
        assert any(d.name == "unit: a sync" for d in armed_watchdogs())
        assert stand_down_armed_watchdogs() >= 1
        assert deadline.lifted
        assert deadline.remaining() is None
        assert stand_down_armed_watchdogs() == 0  # nothing armed is left
    assert not watch.in_flight
    assert (watch.fired, watch.stood_down) == (0, 1)


def test_a_guard_whose_watchdog_fires_counts_it() -> None:
    watch = SyncWatch("unit")
    with watch.guard(0.05, "a slow sync") as deadline:  # the sync outlives it: its watchdog fires

        def fired() -> bool:  # a fired watchdog is no longer armed
            return not any(d.name == "unit: a slow sync" for d in armed_watchdogs())

        wait_until(fired, 10, "the 50 ms watchdog fired")
        assert deadline.expired
    assert (watch.fired, watch.stood_down) == (1, 0)


def test_one_sync_at_a_time_per_watch() -> None:
    watch = SyncWatch("unit")
    with watch.guard(30.0, "first"), pytest.raises(RuntimeError, match="still in flight"):  # noqa: SIM117
        with watch.guard(30.0, "second"):
            pass
    with watch.guard(30.0, "third"):  # the failed second guard left the watch usable
        pass


def test_a_guard_without_a_limit_arms_nothing() -> None:
    watch = SyncWatch("unit")
    for unlimited in (None, math.inf):
        with watch.guard(unlimited, "no limit") as deadline:
            assert watch.in_flight
            assert deadline.remaining() is None
            assert not any(d.name == "unit: no limit" for d in armed_watchdogs())
    assert (watch.fired, watch.stood_down) == (0, 0)


def test_a_stood_down_guard_keeps_a_plain_deadline_plain() -> None:
    plain = Deadline(30.0)
    watch = SyncWatch("unit")
    with watch.guard(30.0, "sync"):
        stand_down_armed_watchdogs()
    assert plain.remaining() is not None  # only the sync's own deadline is lifted


@pytest.mark.timeout(180)
def test_watched_and_plain_ends_speak_one_protocol_bit_exact() -> None:
    res = w.run_ranks(ww.scenario_broadcast, 3)
    for rank in (1, 2):
        assert (res[rank]["v1"], res[rank]["v2"]) == (True, True)
    for rank in (0, 2):
        assert (res[rank]["fired"], res[rank]["stood_down"]) == (0, 0)


@pytest.fixture(scope="module")
def stalls() -> dict[str, dict[str, Any]]:
    return {mode: w.run_ranks(ww.scenario_stall, 2, mode)[1] for mode in ("guard", "stand_down", "deadline")}


@pytest.mark.timeout(240)
def test_a_stalled_peer_ends_the_wait_at_the_watchdogs_deadline(stalls: dict[str, dict[str, Any]]) -> None:
    out = stalls["guard"]
    assert out["error"] == "SyncTimeoutError", out
    assert "its watchdog fired" in out["message"]
    assert out["fired"] == 1
    assert ww.PEER_EXITS_AFTER_S > out["seconds"] >= 1.0


@pytest.mark.timeout(240)
def test_stood_down_the_wait_ends_only_by_the_lost_peer(stalls: dict[str, dict[str, Any]]) -> None:
    out = stalls["stand_down"]
    assert out["stood_down_count"] == 1
    assert out["error"] == "PeerLostError", out
    assert out["lifted"]
    assert (out["fired"], out["stood_down"]) == (0, 1)
    assert out["seconds"] >= ww.PEER_EXITS_AFTER_S  # past the 1 s deadline: the peer's exit ended it


@pytest.mark.timeout(240)
def test_without_a_guard_the_callers_deadline_bounds_the_wait(stalls: dict[str, dict[str, Any]]) -> None:
    out = stalls["deadline"]
    assert out["error"] == "SyncTimeoutError", out
    assert ww.PEER_EXITS_AFTER_S > out["seconds"] >= 1.0


@pytest.mark.timeout(240)
def test_a_watched_wire_lifts_the_groups_own_timeout(stalls: dict[str, dict[str, Any]]) -> None:
    assert stalls["guard"]["timeout_after_lift"].startswith("1 day")
