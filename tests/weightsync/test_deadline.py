"""Deadlines and watchdogs: expiry names what timed out; watchdogs fire once or stand down."""

from __future__ import annotations

import threading

import pytest

from rlfleet.weightsync import (
    Deadline,
    SyncAbortedError,
    SyncTimeoutError,
    Watchdog,
    armed_watchdogs,
    stand_down_armed_watchdogs,
)


def test_unbounded_deadline_never_expires() -> None:
    deadline = Deadline(None)
    assert deadline.remaining() is None
    assert not deadline.expired
    deadline.check("anything")
    assert deadline.remaining_or(5.0) == 5.0


def test_expired_deadline_names_what_timed_out() -> None:
    deadline = Deadline(0)
    assert deadline.expired
    assert deadline.remaining() == 0.0
    with pytest.raises(SyncTimeoutError, match="bucket 3 from the trainer"):
        deadline.check("bucket 3 from the trainer")


def test_timeout_error_is_also_a_builtin_timeout() -> None:
    with pytest.raises(TimeoutError):
        Deadline(0).check("x")


@pytest.mark.parametrize("bad", [-1, float("nan"), "3", True])
def test_bad_seconds_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="deadline seconds"):
        Deadline(bad)  # type: ignore[arg-type]


def test_child_never_outlives_parent() -> None:
    parent = Deadline(0)
    assert parent.child(100).expired
    assert Deadline(None).child(None).remaining() is None
    child = Deadline(100).child(0)
    assert child.expired


def test_coerce_shares_a_deadline_object() -> None:
    deadline = Deadline(10)
    assert Deadline.coerce(deadline) is deadline
    assert Deadline.coerce(None).remaining() is None
    remaining = Deadline.coerce(5).remaining()
    assert remaining is not None
    assert remaining <= 5


def test_wait_on_event() -> None:
    event = threading.Event()
    with pytest.raises(SyncTimeoutError, match="ready signal"):
        Deadline(0.01).wait(event, "ready signal")
    event.set()
    Deadline(0).wait(event, "ready signal")


def test_wait_on_condition_with_predicate() -> None:
    cond = threading.Condition()
    box: list[int] = []

    def producer() -> None:
        with cond:
            box.append(1)
            cond.notify_all()

    thread = threading.Thread(target=producer)
    with cond:
        thread.start()
        Deadline(30).wait(cond, "producer", predicate=lambda: bool(box))
    thread.join()
    with cond, pytest.raises(SyncTimeoutError, match="never"):
        Deadline(0.01).wait(cond, "never", predicate=lambda: False)


def test_poll_runs_liveness_check_and_times_out() -> None:
    calls: list[int] = []
    with pytest.raises(SyncTimeoutError, match="slot 1"):
        Deadline(0.01).poll(lambda: False, "slot 1", on_wait=lambda: calls.append(1))
    assert calls
    counter = iter(range(10))
    Deadline(None).poll(lambda: next(counter) >= 3, "counter")


def test_watchdog_fires_callbacks_once() -> None:
    hits: list[str] = []
    done = threading.Event()

    def abort() -> None:
        hits.append("abort")
        done.set()

    dog = Watchdog(0.01, on_fire=[abort], name="refit")
    dog.add_callback(lambda: hits.append("second"))  # e.g. a communicator built after the watchdog
    with dog:
        assert done.wait(30)
    assert dog.fired
    assert hits == ["abort", "second"]
    with pytest.raises(SyncAbortedError, match="refit"):
        dog.raise_if_fired()
    assert dog not in armed_watchdogs()


def test_watchdog_callback_errors_do_not_escape() -> None:
    done = threading.Event()

    def bad() -> None:
        raise RuntimeError("boom")

    dog = Watchdog(0.01, on_fire=[bad, done.set], name="bad-callback")
    dog.arm()
    assert done.wait(30)
    assert dog.fired


def test_disarmed_watchdog_does_not_fire_and_can_rearm() -> None:
    hits: list[int] = []
    dog = Watchdog(3600, on_fire=lambda: hits.append(1), name="long")
    with dog:
        assert dog.armed
        assert dog in armed_watchdogs()
    assert not dog.armed
    assert not dog.fired
    dog.raise_if_fired()
    with dog:
        assert dog.armed
    assert hits == []
    with pytest.raises(RuntimeError, match="already armed"):
        dog.arm().arm()
    dog.disarm()


def test_stand_down_disarms_every_armed_watchdog() -> None:
    hits: list[int] = []
    dogs = [Watchdog(3600, on_fire=lambda: hits.append(1), name=f"dog{i}") for i in range(3)]
    for dog in dogs[:2]:
        dog.arm()
    assert stand_down_armed_watchdogs() == 2
    assert all(d.stood_down for d in dogs[:2])
    assert not dogs[2].stood_down
    assert stand_down_armed_watchdogs() == 0
    assert not any(d.fired for d in dogs)
    assert hits == []


def test_watchdog_validates_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        Watchdog(0, name="zero")


@pytest.mark.parametrize("seconds", [float("inf"), 1e10, 1e300, 10**30])
def test_huge_timeouts_are_very_long_and_never_overflow(seconds: float) -> None:
    deadline = Deadline(seconds)
    left = deadline.remaining()
    assert left is None or left > 1e8
    event = threading.Event()
    threading.Timer(0.05, event.set).start()
    deadline.wait(event, "an event set soon")  # Event.wait(1e10) itself raises OverflowError
    cond = threading.Condition()
    ready: list[bool] = []

    def notify() -> None:
        with cond:
            ready.append(True)
            cond.notify_all()

    threading.Timer(0.05, notify).start()
    with cond:
        deadline.wait(cond, "a predicate true soon", lambda: bool(ready))
    assert not deadline.child(seconds).expired
    assert Deadline(5).child(seconds).remaining() <= 5  # type: ignore[operator]


def test_leaving_ends_earlier_and_keeps_no_limit() -> None:
    deadline = Deadline(10)
    earlier = deadline.leaving(4)
    assert earlier.remaining() <= 6  # type: ignore[operator]
    assert Deadline(1).leaving(5).expired
    assert Deadline(None).leaving(5).remaining() is None
