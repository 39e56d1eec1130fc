"""Sticky sessions through a rolling update: the default version preference does not pile them
onto the first updated worker; "strict" does (documented trade-off)."""

from __future__ import annotations

import random
from collections import Counter, deque
from typing import Any

import pytest

from rlfleet.routing import ConsistentHashRouter, PrefixAwareRouter

WORKERS = [f"gen-{i}" for i in range(8)]


def test_one_updated_worker_does_not_take_every_session() -> None:
    """Issue 18's case: 48 sessions on 6 workers, one worker updated, every session sends a turn."""
    sessions = [f"session-{i}" for i in range(48)]
    piled: dict[object, int] = {}
    for prefer in (True, "strict"):
        r = ConsistentHashRouter([f"gen-{i}" for i in range(6)], prefer_newest_version=prefer)  # type: ignore[arg-type]
        home = {s: r.owner(s) for s in sessions}
        r.set_draining("gen-0", True)
        r.set_version("gen-0", 1)  # drained (nothing in flight), swapped
        r.set_draining("gen-0", False)
        turns = [r.select(s) for s in sessions]  # all 48 in flight at once
        piled[prefer] = Counter(turns)["gen-0"]
        moved = sum(1 for s, w in zip(sessions, turns, strict=True) if w != home[s])
        if prefer is True:
            assert max(r.loads.values()) <= r.bound(0)
            assert moved / len(sessions) <= 0.25
        else:
            assert moved == sum(1 for s in sessions if home[s] != "gen-0")
    assert piled["strict"] == 48
    assert piled[True] < 16


def moved_during_rolling_update(router: Any, sessions: int = 1024, window: int = 256, seed: int = 0) -> float:
    """Fraction of sessions a rolling update sends away from their home while home is serving.

    Home: the worker that served most of a session's requests before the update. Requests made
    while a session's home is drained for its swap must move under any policy: not counted.
    """
    rng = random.Random(seed)
    keys = [f"session-{i}" for i in range(sessions)]
    in_flight: deque[Any] = deque()
    served: dict[str, Counter[Any]] = {k: Counter() for k in keys}
    home: dict[str, Any] = {}
    away: set[str] = set()
    draining = None
    updating = False
    for phase in ["warm-up", *WORKERS]:
        if phase != "warm-up":
            if not updating:
                home = {k: c.most_common(1)[0][0] for k, c in served.items() if c}
            updating, draining = True, phase
            router.set_draining(phase, True)
        steps = sessions * 8 if phase == "warm-up" else window * 2
        for _ in range(steps):
            if len(in_flight) == window:
                router.release(in_flight.popleft())
            if draining is not None and router.loads[draining] == 0:
                router.set_version(draining, 1)
                router.set_draining(draining, False)
                draining = None
            key = keys[rng.randrange(sessions)]
            worker = router.select(key)
            in_flight.append(worker)
            if not updating:
                served[key][worker] += 1
            elif worker != home.get(key, worker) and home.get(key) != draining:
                away.add(key)
    while in_flight:
        router.release(in_flight.popleft())
    return len(away) / len(home)


@pytest.mark.timeout(120)
def test_rolling_update_moves_few_sessions_by_default() -> None:
    """Issue 18's figure: at most 0.2 of the sessions moved by a rolling update of 8 workers."""
    sticky = moved_during_rolling_update(ConsistentHashRouter(WORKERS))
    strict = moved_during_rolling_update(ConsistentHashRouter(WORKERS, prefer_newest_version="strict"))
    assert sticky <= 0.2
    assert strict >= 0.5  # the piling the default avoids
    assert {ConsistentHashRouter(WORKERS).prefer_newest_version, strict > sticky} == {True}


@pytest.mark.timeout(120)
def test_prefix_sessions_stay_on_their_cached_worker_through_an_update() -> None:
    """Once its worker is updated a session's cache is gone anywhere; until then it stays put."""
    r = PrefixAwareRouter(WORKERS)
    history = {i: f"system prompt {i % 2} " * 20 + f"session {i} " * 30 for i in range(32)}
    home = {}
    for i, prompt in history.items():
        home[i] = r.select(prompt)
        r.release(home[i])
    r.set_draining(WORKERS[0], True)
    r.set_version(WORKERS[0], 1)
    r.set_draining(WORKERS[0], False)
    for i, prompt in history.items():
        history[i] = prompt + f"turn two of {i} " * 10
        got = r.select(history[i])
        r.release(got)
        if home[i] != WORKERS[0]:
            assert got == home[i]  # its worker still caches its conversation
