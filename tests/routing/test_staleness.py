"""`max_staleness` (issue 28 #4): no request goes to a worker more than `max_staleness` versions
behind the latest committed version; with none eligible a request waits within its deadline,
threads and asyncio alike (the loop keeps running)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
from routing_helpers import MakeRouter

from rlfleet.routing import LeastLoadRouter, NoWorkerAvailableError, Router, create_router

KEYS = [None, "env-0", "env-1", "env-7", "session-3"]


def _until(cond: Any, what: str, seconds: float = 30.0) -> None:
    """Poll `cond` within a deadline (synchronisation, not a timing assertion)."""
    due = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > due:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.001)


def test_bad_max_staleness_is_refused_and_default_is_unbounded() -> None:
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="max_staleness"):
            LeastLoadRouter(["a"], max_staleness=bad)  # type: ignore[arg-type]
    r = LeastLoadRouter(["a", "b"])
    assert r.max_staleness is None
    r.set_latest_version(100)  # unbounded: nobody is too far behind
    assert r.select() in {"a", "b"}
    with pytest.raises(TypeError, match="version must be an int"):
        r.set_latest_version(1.0)  # type: ignore[arg-type]


def test_workers_too_far_behind_the_announced_version_take_nothing(make_router: MakeRouter) -> None:
    r = make_router(["a", "b", "c"], max_staleness=1)
    assert r.latest_version == 0
    r.set_latest_version(1)  # the trainer committed version 1, before any worker swapped
    assert r.latest_version == 1
    assert {r.select(k) for k in KEYS * 4} <= {"a", "b", "c"}  # one behind: still eligible
    r.set_latest_version(2)
    with pytest.raises(NoWorkerAvailableError, match=r"3 stale .*max_staleness=1.*latest version 2"):
        r.select("env-1")
    r.set_version("b", 1)
    for key in KEYS * 4:
        assert r.select(key) == "b"
    r.set_latest_version(1)  # a late, older announcement changes nothing
    assert r.latest_version == 2
    r.set_draining("b", True)
    with pytest.raises(NoWorkerAvailableError, match="1 draining, 2 stale"):
        r.assign(["env-1", "env-2"], timeout=0)
    assert r.workers == ["a", "b", "c"]  # stale workers stay members


def test_a_worker_serving_a_newer_version_makes_it_the_latest(make_router: MakeRouter) -> None:
    r = make_router(["a", "b", "c"], max_staleness=0)
    r.set_version("c", 4)  # no announcement: the newest served version is the latest
    assert r.latest_version == 4
    assert {r.select(k) for k in KEYS * 3} == {"c"}
    r.add_worker("late", version=3)  # joins behind: not eligible
    r.set_draining("c", True)
    with pytest.raises(NoWorkerAvailableError, match=r"1 draining, 3 stale"):
        r.select("env-0")
    r.set_version("late", 4)
    assert r.select("env-0") == "late"


@pytest.mark.timeout(60)
def test_a_waiting_select_is_released_when_a_worker_catches_up(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"], max_staleness=0)
    r.set_latest_version(1)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(r.select("env-1", timeout=30)))
    waiter.start()
    _until(lambda: r.waiting == 1, "the select to wait")
    assert got == []
    r.set_version("b", 1)  # b caught up: the waiting request goes there
    waiter.join(30)
    assert not waiter.is_alive()
    assert got == ["b"]
    assert r.waiting == 0


@pytest.mark.timeout(60)
def test_a_waiting_select_raises_at_its_deadline_naming_staleness(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"], max_staleness=1)
    r.set_version("a", 5)
    r.set_draining("a", True)
    with pytest.raises(NoWorkerAvailableError, match=r"timed out after 0.05s.*1 stale .*latest version 5"):
        r.select("env-1", timeout=0.05)
    assert r.in_flight == 0


@pytest.mark.timeout(60)
def test_select_async_waits_for_a_fresh_worker_without_blocking_the_loop(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"], max_staleness=1)
    r.set_latest_version(3)

    async def main() -> None:
        ticks = 0
        stop = asyncio.Event()

        async def tick() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        waiter = asyncio.create_task(r.select_async("env-1", timeout=30))
        request_waiter = asyncio.create_task(_one_request(r))
        while ticks < 200:  # the loop runs other coroutines while both wait
            await asyncio.sleep(0)
        assert not waiter.done()
        assert not request_waiter.done()
        assert r.waiting == 2
        threading.Thread(target=r.set_version, args=("a", 2)).start()  # a worker catches up
        assert await waiter == "a"
        assert await request_waiter == "a"
        r.set_latest_version(4)  # a now 2 behind, b 4 behind
        with pytest.raises(NoWorkerAvailableError, match="2 stale"):
            await r.select_async("env-2", timeout=0.01)
        stop.set()
        await ticker

    asyncio.run(main())
    assert r.loads == {"a": 1, "b": 0}


async def _one_request(r: Router[Any]) -> Any:
    async with r.request("env-3", timeout=30) as worker:
        return worker


@pytest.mark.timeout(120)
def test_the_bound_holds_under_a_rolling_update_with_a_slow_worker(make_router: MakeRouter) -> None:
    """Versions 1..5 roll over 4 workers while clients keep sending; `slow` swaps only every
    third version. No request ever reaches a worker more than one version behind the latest
    version announced before the request was routed."""
    workers = ["w0", "w1", "w2", "slow"]
    r = make_router(workers, max_staleness=1)
    done = threading.Event()
    violations: list[str] = []
    served: dict[str, int] = dict.fromkeys(workers, 0)
    lock = threading.Lock()

    def client(c: int) -> None:
        i = 0
        while not done.is_set():
            latest = r.latest_version or 0
            w = r.select(f"env-{c}-{i % 7}", timeout=30)
            version = r.version(w)  # only grows: if it is behind now, it was behind when routed
            with lock:
                served[w] += 1
                if latest - version > 1:
                    violations.append(f"{w} at v{version} served a request routed after v{latest}")
            r.release(w)
            i += 1

    def trainer() -> None:
        try:
            for v in range(1, 6):
                r.set_latest_version(v)  # committed by the trainer: workers swap one by one
                for w in workers:
                    if w == "slow" and v % 3:
                        continue
                    r.drain([w], timeout=30)
                    r.set_version(w, v)
                    r.undrain([w])
        finally:
            done.set()

    clients = [threading.Thread(target=client, args=(c,)) for c in range(3)]
    for t in clients:
        t.start()
    trainer()
    for t in clients:
        t.join(60)
    assert not any(t.is_alive() for t in clients)
    assert violations == []
    assert sum(served.values()) > 0
    assert r.version("slow") == 3
    assert r.latest_version == 5
    r.drain(["w0", "w1", "w2"], timeout=30)
    with pytest.raises(NoWorkerAvailableError, match="1 stale"):  # slow: 2 behind
        r.select("env-x")


def test_create_router_takes_max_staleness() -> None:
    for name in ("least_load", "round_robin", "power_of_two", "consistent_hash", "prefix_aware"):
        r = create_router("async", name, ["a", "b"], max_staleness=2)
        assert r.max_staleness == 2
        r.set_version("a", 3)
        assert r.select("env-1") == "a"  # b is 3 behind
    dist: dict[Hashable, Any] = {"n0": {"env": {"ids": [0]}, "eval": {"ids": [0, 1]}}}
    na = create_router("sync", "node_affinity", ["a", "b"], component_distribution=dist, max_staleness=0)
    na.set_latest_version(1)
    na.set_version("b", 1)
    assert na.select("env-0") == "b"


def test_the_readme_snippet_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).resolve().parents[2] / "packages" / "routing" / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    (snippet,) = [b for b in blocks if "max_staleness=1" in b]
    exec(compile(snippet, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "2 stale (more than max_staleness=1 version(s) behind the latest version 2)" in printed
