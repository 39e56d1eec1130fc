"""Behaviour every router shares: counts, draining, versions, waiting, errors."""

from __future__ import annotations

import threading

import pytest
from routing_helpers import MakeRouter

from rlfleet.routing import (
    DrainTimeoutError,
    DuplicateWorkerError,
    NotInFlightError,
    NoWorkerAvailableError,
    RoutingError,
    UnknownWorkerError,
)

KEYS = [None, "env-0", "env-1", "env-7", "session-42"]


def test_select_counts_in_flight_and_release_counts_down(make_router: MakeRouter) -> None:
    r = make_router(["a", "b", "c"])
    assert r.workers == ["a", "b", "c"]
    assert r.loads == {"a": 0, "b": 0, "c": 0}
    picked = [r.select(k) for k in KEYS]
    assert all(w in {"a", "b", "c"} for w in picked)
    assert r.in_flight == len(KEYS)
    assert sum(r.loads.values()) == len(KEYS)
    for w in picked:
        r.release(w)
    assert r.in_flight == 0
    assert r.loads == {"a": 0, "b": 0, "c": 0}


def test_assign_counts_each_request(make_router: MakeRouter) -> None:
    r = make_router(range(4))
    out = r.assign(["env-1", "env-2", None, "x"])
    assert len(out) == 4
    assert r.in_flight == 4
    out += r.assign(3)
    assert r.in_flight == 7
    for w in out:
        r.release(w)
    assert r.in_flight == 0
    assert r.assign([]) == []
    with pytest.raises(ValueError, match="-1"):
        r.assign(-1)


def test_assign_is_all_or_nothing(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"], max_in_flight=1)
    with pytest.raises(NoWorkerAvailableError):
        r.assign(3)
    assert r.in_flight == 0
    assert r.loads == {"a": 0, "b": 0}
    assert sorted(r.assign(2)) == ["a", "b"]


def test_no_worker_raises_clearly(make_router: MakeRouter) -> None:
    r = make_router()
    with pytest.raises(NoWorkerAvailableError, match="no workers"):
        r.select()
    r.add_worker("a")
    r.set_draining("a", True)
    with pytest.raises(NoWorkerAvailableError, match="1 draining"):
        r.select("env-3")


def test_draining_worker_is_never_selected(make_router: MakeRouter) -> None:
    r = make_router(["a", "b", "c"])
    held = r.assign(6)
    r.set_draining("b", True)
    assert r.is_draining("b")
    for key in KEYS * 20:
        w = r.select(key)
        assert w != "b"
        r.release(w)
    # Releases on a draining worker still count down.
    for w in held:
        r.release(w)
    assert r.loads == {"a": 0, "b": 0, "c": 0}
    r.set_draining("b", False)
    r.set_draining("a", True)
    r.set_draining("c", True)
    assert {r.select(k) for k in KEYS} == {"b"}


def test_strict_version_preference_routes_to_updated_workers(make_router: MakeRouter) -> None:
    r = make_router(["a", "b", "c", "d"], prefer_newest_version="strict")
    assert r.prefer_newest_version == "strict"
    r.set_version("c", 1)
    r.set_version("d", 1)
    assert r.version("c") == 1
    assert r.version("a") == 0
    for key in KEYS * 10:
        w = r.select(key)
        assert w in {"c", "d"}
        r.release(w)
    # Draining every new worker makes the old version the newest selectable one again.
    r.set_draining("c", True)
    r.set_draining("d", True)
    for key in KEYS * 10:
        w = r.select(key)
        assert w in {"a", "b"}
        r.release(w)
    # A worker added at a newer version takes everything.
    r.add_worker("e", version=2)
    assert {r.select(k) for k in KEYS} == {"e"}


def test_default_version_preference_fills_the_newest_up_to_the_bound(make_router: MakeRouter) -> None:
    """No pile-up: updated workers take requests up to the load bound, older ones the rest."""
    r = make_router(["a", "b", "c", "d"])
    assert r.prefer_newest_version is True
    r.set_version("c", 1)
    r.set_version("d", 1)
    for _ in range(8):
        r.select()  # keyless: the version decides
        loads = r.loads
        assert max(loads["c"], loads["d"]) <= r.bound(0)
    loads = r.loads
    assert min(loads["c"], loads["d"]) >= max(loads["a"], loads["b"])
    assert loads["a"] + loads["b"] > 0
    # With nothing in flight the newest version takes a keyless request.
    for w, n in loads.items():
        for _ in range(n):
            r.release(w)
    assert r.select() in {"c", "d"}


@pytest.mark.parametrize("prefer", [True, "strict"])
def test_a_worker_far_behind_serves_only_when_no_recent_one_can(
    make_router: MakeRouter, prefer: bool | str
) -> None:
    """A restarted worker still at its initial weights must not take overflow by default."""
    r = make_router(["a", "b"], max_in_flight=4, prefer_newest_version=prefer)
    assert r.version_lag == 1
    r.set_version("a", 5)
    r.set_version("b", 5)
    r.add_worker("c", version=0)
    got = [r.select(f"env-{i}") for i in range(8)]
    assert sorted(got) == ["a"] * 4 + ["b"] * 4
    assert r.select("env-9") == "c"  # every recent worker full: an old one rather than a pause
    r.add_worker("d", version=4)  # one version behind: within the lag
    assert r.select("env-10") == "d"


@pytest.mark.parametrize("prefer", [True, "strict"])
def test_newest_version_at_max_in_flight_falls_back_to_older_workers(
    make_router: MakeRouter, prefer: bool | str
) -> None:
    """Issue 15 item 21: a full newest version must not pause every request."""
    r = make_router(["a", "b", "c"], max_in_flight=1, prefer_newest_version=prefer)
    r.set_version("a", 1)
    got = [r.select("k"), r.select("k2"), r.select("k3")]
    assert sorted(got) == ["a", "b", "c"]
    if prefer == "strict":
        assert got[0] == "a"
    with pytest.raises(NoWorkerAvailableError, match="3 at max_in_flight=1"):
        r.select("k4")
    r.release("b")
    assert r.select("k5", timeout=5) == "b"


def test_prefer_newest_version_off_uses_every_version(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"], prefer_newest_version=False)
    r.set_version("b", 5)
    seen = set(r.assign(["env-0", "env-1", None, None, "x", "y", "z", "w"]))
    assert seen == {"a", "b"}


def test_rolling_update_drain_wait_swap_undrain(make_router: MakeRouter) -> None:
    workers = ["a", "b", "c"]
    r = make_router(workers)
    held = r.assign(9)
    for i, w in enumerate(workers):
        r.set_draining(w, True)
        for h in [h for h in held if h == w]:
            r.release(h)
            held.remove(h)
        r.wait_drained(w, timeout=5)
        assert r.loads[w] == 0
        r.set_version(w, 1)
        r.set_draining(w, False)
        got = r.select()
        # Only updated workers serve once one exists.
        assert r.version(got) == 1
        assert got in workers[: i + 1]
        r.release(got)
    for h in held:
        r.release(h)
    assert r.in_flight == 0


@pytest.mark.timeout(30)
def test_wait_drained_blocks_until_last_release(make_router: MakeRouter) -> None:
    r = make_router(["a"])
    held = r.assign(3)
    r.set_draining("a", True)
    releaser_may_go = threading.Event()

    def releaser() -> None:
        releaser_may_go.wait(10)
        for w in held:
            r.release(w)

    t = threading.Thread(target=releaser)
    t.start()
    releaser_may_go.set()
    r.wait_drained("a", timeout=20)
    assert r.loads["a"] == 0
    t.join()


@pytest.mark.timeout(30)
def test_wait_drained_times_out_with_a_clear_error(make_router: MakeRouter) -> None:
    r = make_router(["a"])
    r.select()
    with pytest.raises(DrainTimeoutError, match="1 request"):
        r.wait_drained("a", timeout=0.05)
    with pytest.raises(TimeoutError):
        r.wait_drained("a", timeout=0)
    with pytest.raises(ValueError, match="deadline"):
        r.wait_drained("a", timeout=None)  # type: ignore[arg-type]
    with pytest.raises(UnknownWorkerError):
        r.wait_drained("zz", timeout=1)
    r.release("a")
    r.wait_drained("a", timeout=0)


@pytest.mark.timeout(30)
def test_select_with_timeout_waits_for_a_release(make_router: MakeRouter) -> None:
    r = make_router(["a"], max_in_flight=1)
    assert r.select("env-0") == "a"
    with pytest.raises(NoWorkerAvailableError, match="max_in_flight=1"):
        r.select("env-0")
    got: list[str] = []
    waiting = threading.Event()

    def waiter() -> None:
        waiting.set()
        got.append(r.select("env-0", timeout=20))

    t = threading.Thread(target=waiter)
    t.start()
    waiting.wait(10)
    r.release("a")
    t.join(25)
    assert got == ["a"]
    assert r.loads == {"a": 1}


@pytest.mark.timeout(30)
def test_select_with_timeout_waits_for_an_undrain_or_a_new_worker(make_router: MakeRouter) -> None:
    r = make_router(["a"])
    r.set_draining("a", True)
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(r.select(timeout=20)))
    t.start()
    r.set_draining("a", False)
    t.join(25)
    assert got == ["a"]

    r2 = make_router()
    t = threading.Thread(target=lambda: got.append(r2.select("env-1", timeout=20)))
    t.start()
    r2.add_worker("b")
    t.join(25)
    assert got == ["a", "b"]


@pytest.mark.timeout(30)
def test_select_timeout_runs_out_with_a_clear_error(make_router: MakeRouter) -> None:
    r = make_router(["a"])
    r.set_draining("a", True)
    with pytest.raises(NoWorkerAvailableError, match="timed out"):
        r.select(timeout=0.05)
    with pytest.raises(NoWorkerAvailableError, match="timed out"):
        r.assign(2, timeout=0.01)
    assert r.in_flight == 0


def test_release_errors_and_counts_never_go_negative(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"])
    with pytest.raises(UnknownWorkerError, match="'zz'"):
        r.release("zz")
    with pytest.raises(NotInFlightError, match="'a'"):
        r.release("a")
    w = r.select()
    r.release(w)
    with pytest.raises(NotInFlightError):
        r.release(w)
    assert min(r.loads.values()) == 0
    assert r.in_flight == 0
    # The error classes are RoutingErrors and the matching builtins.
    assert issubclass(UnknownWorkerError, LookupError)
    assert issubclass(NotInFlightError, ValueError)
    assert issubclass(NoWorkerAvailableError, RoutingError)


def test_membership_errors(make_router: MakeRouter) -> None:
    r = make_router(["a"])
    with pytest.raises(DuplicateWorkerError, match="'a'"):
        r.add_worker("a")
    for call in (r.remove_worker, r.version, r.is_draining):
        with pytest.raises(UnknownWorkerError, match="'zz'"):
            call("zz")
    with pytest.raises(UnknownWorkerError):
        r.set_draining("zz", True)
    with pytest.raises(UnknownWorkerError):
        r.set_version("zz", 1)
    with pytest.raises(TypeError, match="version"):
        r.set_version("a", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="version"):
        r.add_worker("b", version="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_in_flight"):
        make_router(max_in_flight=0)
    assert "a" in r
    assert "zz" not in r
    assert [] not in r
    assert len(r) == 1
    assert list(r) == ["a"]
    assert "workers=1" in repr(r)


def test_removed_worker_keeps_counting_down_then_disappears(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"])
    held = r.assign(4)
    n_a = held.count("a")
    assert n_a > 0
    r.remove_worker("a")
    assert r.workers == ["b"]
    assert "a" not in r
    assert r.loads["a"] == n_a  # still counted until released
    assert r.in_flight == 4
    for key in KEYS * 5:
        w = r.select(key)
        assert w == "b"
        r.release(w)
    with pytest.raises(DuplicateWorkerError, match="still has"):
        r.add_worker("a")
    for w in held:
        r.release(w)
    assert r.loads == {"b": 0}
    with pytest.raises(UnknownWorkerError):
        r.release("a")
    r.add_worker("a")  # back, at the end of the insertion order
    assert r.workers == ["b", "a"]


def test_remove_then_add_and_remove_everything(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"])
    r.remove_worker("a")
    r.remove_worker("b")
    with pytest.raises(NoWorkerAvailableError):
        r.select("env-0")
    r.add_worker("c", node=0)
    assert r.select("env-0") == "c"
    assert r.node("c") == 0


def test_max_in_flight_caps_each_worker(make_router: MakeRouter) -> None:
    r = make_router(["a", "b", "c"], max_in_flight=2)
    assert r.max_in_flight == 2
    out = r.assign(["env-0"] * 6)
    assert sorted(out) == ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(NoWorkerAvailableError):
        r.select()
    r.release("b")
    assert r.select("env-5") == "b"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seconds", [1e10, 1e300])
def test_very_long_timeouts_wait_like_any_other(make_router: MakeRouter, seconds: float) -> None:
    """Issue 15 item 14: a timeout past the OS limit is waited out, not a raw OverflowError."""
    r = make_router(["a"], max_in_flight=1)
    r.select("env-0")
    threading.Timer(0.2, r.release, args=("a",)).start()  # after the call below starts waiting
    assert r.select("env-1", timeout=seconds) == "a"
    threading.Timer(0.2, r.release, args=("a",)).start()
    r.set_draining("a", True)
    r.wait_drained("a", timeout=seconds)
    assert r.in_flight == 0
    assert r.assign(0, timeout=seconds) == []


def test_infinite_and_malformed_timeouts_are_refused_clearly(make_router: MakeRouter) -> None:
    r = make_router(["a"])
    for call in (
        lambda t: r.select(timeout=t),
        lambda t: r.assign(1, timeout=t),
        lambda t: r.wait_drained("a", timeout=t),
    ):
        with pytest.raises(ValueError, match="finite number of seconds, got inf"):
            call(float("inf"))
        with pytest.raises(ValueError, match="got nan"):
            call(float("nan"))
        with pytest.raises(TypeError, match="number of seconds"):
            call("5")
    assert r.in_flight == 0


def test_accessors_are_properties_and_loads_call_still_works(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"], max_in_flight=3, load_factor=1.5)
    r.select()
    assert (r.workers, r.in_flight, r.max_in_flight, r.load_factor) == (["a", "b"], 1, 3, 1.5)
    assert sum(r.loads.values()) == 1
    with pytest.warns(DeprecationWarning, match="property"):
        assert r.loads() == r.loads  # the old method form, kept one release
    with pytest.raises(TypeError, match="unknown router option"):
        make_router(["a"], prefer_newest=True)
    with pytest.raises(ValueError, match="prefer_newest_version"):
        make_router(["a"], prefer_newest_version="newest")
    with pytest.raises(ValueError, match="load_factor"):
        make_router(["a"], load_factor=0.9)
    with pytest.raises(ValueError, match="version_lag"):
        make_router(["a"], version_lag=-1)


def test_drain_waits_for_every_worker_within_one_deadline_and_skips_removed_ones(
    make_router: MakeRouter,
) -> None:
    r = make_router(["a", "b", "c"])
    r.remove_worker("c")
    r.assign(2)  # on "a" and "b"
    busy = [w for w, n in r.loads.items() if n for _ in range(n)]
    timer = threading.Timer(0.2, lambda: [r.release(w) for w in busy])
    timer.start()
    r.drain(["a", "b", "c"], timeout=30)  # "c" was removed: skipped
    assert r.in_flight == 0  # drain returned only once both were released
    timer.join()
    assert [r.is_draining(w) for w in ("a", "b")] == [True, True]
    with pytest.raises(NoWorkerAvailableError):
        r.select(timeout=0)
    r.undrain(["a", "b", "c"])
    assert r.select(timeout=0) in {"a", "b"}


def test_drain_that_times_out_leaves_its_workers_selectable(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"])
    held = r.select()
    with pytest.raises(DrainTimeoutError, match="still in flight"):
        r.drain(["a", "b"], timeout=0.05)
    assert [r.is_draining(w) for w in ("a", "b")] == [False, False]
    r.release(held)


def test_a_drain_that_times_out_restores_each_workers_previous_draining_state(
    make_router: MakeRouter,
) -> None:
    """Issue 25 #6: a worker draining before the drain (a joining worker still at its initial
    weights) stays draining when the drain times out; only those the drain set go back."""
    r = make_router(["a", "b", "joining"])
    r.set_draining("joining", True)
    busy = r.select("env-0")
    with pytest.raises(DrainTimeoutError, match="still in flight"):
        r.drain(["a", "b", busy, "joining"], timeout=0.05)  # `busy` named twice
    assert {w: r.is_draining(w) for w in ("a", "b", "joining")} == {"a": False, "b": False, "joining": True}
    for key in KEYS * 10:
        w = r.select(key)
        assert w != "joining"
        r.release(w)
    r.release(busy)
    r.drain(["a", "joining"], timeout=5)  # a drain that succeeds leaves all of them draining
    assert [r.is_draining(w) for w in ("a", "joining")] == [True, True]
