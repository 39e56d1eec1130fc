"""Many threads selecting and releasing at once: counts stay exact and never go negative."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from routing_helpers import MakeRouter

from rlfleet.routing import NoWorkerAvailableError, Router

THREADS = 8
ROUNDS = 15
OPS_PER_ROUND = 300  # 8 threads x 15 rounds x 300 = 36k select/release operations per router
KEYS = [None, *(f"env-{i}" for i in range(64))]


def _check(r: Router[Any], held: list[list[Any]], errors: list[str]) -> None:
    loads = r.loads
    expected = sum(len(h) for h in held)
    if sum(loads.values()) != expected or r.in_flight != expected:
        errors.append(f"sum(loads)={sum(loads.values())} in_flight={r.in_flight} expected={expected}")
    if min(loads.values(), default=0) < 0:
        errors.append(f"negative load: {loads}")
    per_worker: dict[Any, int] = {}
    for h in held:
        for w in h:
            per_worker[w] = per_worker.get(w, 0) + 1
    if any(loads.get(w, 0) != n for w, n in per_worker.items()):
        errors.append("per-worker loads differ from what the threads hold")


@pytest.mark.timeout(120)
def test_counts_stay_exact_under_threads(make_router: MakeRouter) -> None:
    workers = [f"w{i}" for i in range(16)]
    r = make_router(workers, max_in_flight=40)
    r.set_draining("w3", True)  # never selected, whatever the interleaving
    held: list[list[Any]] = [[] for _ in range(THREADS)]
    errors: list[str] = []
    barrier = threading.Barrier(THREADS, action=lambda: _check(r, held, errors), timeout=60)
    monitor_stop = threading.Event()

    def monitor() -> None:
        while not monitor_stop.is_set():
            if min(r.loads.values(), default=0) < 0:
                errors.append("negative load seen by the monitor")

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        mine = held[tid]
        for _ in range(ROUNDS):
            for _ in range(OPS_PER_ROUND):
                if mine and (len(mine) > 30 or rng.random() < 0.45):
                    r.release(mine.pop(rng.randrange(len(mine))))
                else:
                    try:
                        w = r.select(rng.choice(KEYS), timeout=5)
                    except NoWorkerAvailableError as e:  # pragma: no cover - would be a bug
                        errors.append(str(e))
                        continue
                    if w == "w3":
                        errors.append("selected a draining worker")
                    mine.append(w)
            barrier.wait()  # every thread paused: loads must equal what they hold
        for w in mine:
            r.release(w)
        mine.clear()

    mon = threading.Thread(target=monitor)
    mon.start()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    monitor_stop.set()
    mon.join(10)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert r.in_flight == 0
    assert set(r.loads.values()) == {0}


@pytest.mark.timeout(120)
def test_membership_changes_while_threads_route(make_router: MakeRouter) -> None:
    """Draining, version bumps, removals and additions racing with select/release."""
    r = make_router([f"w{i}" for i in range(8)])
    stop = threading.Event()
    errors: list[str] = []

    def router_thread(tid: int) -> None:
        rng = random.Random(100 + tid)
        mine: list[Any] = []
        while not stop.is_set():
            if mine and rng.random() < 0.5:
                r.release(mine.pop())
            else:
                try:
                    mine.append(r.select(rng.choice(KEYS), timeout=5))
                except NoWorkerAvailableError as e:  # pragma: no cover - would be a bug
                    errors.append(str(e))
        for w in mine:
            r.release(w)

    def admin() -> None:
        rng = random.Random(7)
        version = 0
        extra = 0
        for step in range(400):
            w = f"w{rng.randrange(8)}"
            op = step % 4
            if op == 0:
                r.set_draining(w, True)
                r.set_draining(w, False)
            elif op == 1:
                version += 1
                r.set_version(w, version)
            elif op == 2:
                name = f"x{extra}"
                extra += 1
                r.add_worker(name, node=rng.randrange(2))
            else:
                victims = [x for x in r.workers if str(x).startswith("x")]
                if victims:
                    r.remove_worker(victims[0])
        stop.set()

    threads = [threading.Thread(target=router_thread, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    admin()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert r.in_flight == 0
    assert all(v == 0 for v in r.loads.values())
    assert set(r.loads) == set(r.workers)  # removed workers are gone once drained
