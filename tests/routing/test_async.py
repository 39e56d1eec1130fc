"""The asyncio API: select_async, wait_drained_async, `async with router.request(key)`.

Every test runs a real event loop (asyncio.run); releases also come from plain threads.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from routing_helpers import MakeRouter

from rlfleet.routing import DrainTimeoutError, NoWorkerAvailableError


async def _tick_until(flag: asyncio.Event, counter: list[int]) -> None:
    while not flag.is_set():
        counter[0] += 1
        await asyncio.sleep(0)


@pytest.mark.timeout(60)
def test_request_selects_on_entry_and_releases_on_exit(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"])

    async def main() -> None:
        async with r.request("env-1") as worker:
            assert worker in {"a", "b"}
            assert r.in_flight == 1
        assert r.in_flight == 0
        with pytest.raises(RuntimeError, match="boom"):
            async with r.request("env-2"):
                raise RuntimeError("boom")
        assert r.in_flight == 0
        assert await r.select_async("env-3") in {"a", "b"}
        assert r.in_flight == 1

    asyncio.run(main())
    with r.request("env-4") as worker:  # the threaded form of the same object
        assert r.loads[worker] >= 1
    assert r.in_flight == 1
    req = r.request()
    with req, pytest.raises(RuntimeError, match="enter it once"), req:
        pass
    assert r.in_flight == 1


@pytest.mark.timeout(60)
def test_a_waiting_select_never_blocks_the_loop(make_router: MakeRouter) -> None:
    r = make_router(["a"], max_in_flight=1)
    r.select()

    async def main() -> None:
        stop = asyncio.Event()
        ticks = [0]
        ticker = asyncio.create_task(_tick_until(stop, ticks))
        waiter = asyncio.create_task(r.select_async("env-0", timeout=30))
        while ticks[0] < 100:  # the loop keeps running other tasks while the select waits
            await asyncio.sleep(0)
        assert not waiter.done()
        threading.Thread(target=r.release, args=("a",)).start()  # a release from another thread
        assert await waiter == "a"
        stop.set()
        await ticker

    asyncio.run(main())
    assert r.loads == {"a": 1}


@pytest.mark.timeout(60)
def test_cancelling_a_waiter_takes_nothing(make_router: MakeRouter) -> None:
    r = make_router(["a"], max_in_flight=1)
    r.select()

    async def main() -> None:
        waiters = [asyncio.create_task(r.select_async(f"env-{i}", timeout=30)) for i in range(5)]
        await asyncio.sleep(0)  # every waiter is waiting now
        waiters[0].cancel()
        r.release("a")  # the wake-up and the cancellations in the same loop iteration
        waiters[1].cancel()
        done, pending = await asyncio.wait(waiters[2:], return_when=asyncio.FIRST_COMPLETED)
        assert [t.result() for t in done] == ["a"]  # the one free slot went to one waiter
        for t in pending:
            t.cancel()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert sum(1 for x in results if x == "a") == 1
        assert all(isinstance(x, asyncio.CancelledError) for x in results if x != "a")

    asyncio.run(main())
    assert r.in_flight == 1  # the winner's request, nothing from the cancelled ones
    assert r._wait.count == 0


@pytest.mark.timeout(60)
def test_cancelling_the_body_releases_the_worker(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"])

    async def main() -> None:
        entered = asyncio.Event()

        async def request() -> None:
            async with r.request("env-1"):
                entered.set()
                await asyncio.Event().wait()  # a response that never comes

        task = asyncio.create_task(request())
        await entered.wait()
        assert r.in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert r.in_flight == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_wait_drained_async_with_releases_from_the_loop_and_threads(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"])

    async def main() -> None:
        held = r.assign(6)  # keyless: spread by load over both
        on_a = [w for w in held if w == "a"]
        r.set_draining("a", True)
        stop = asyncio.Event()
        ticks = [0]
        ticker = asyncio.create_task(_tick_until(stop, ticks))
        drained = asyncio.create_task(r.wait_drained_async("a", timeout=30))
        await asyncio.sleep(0)
        for w in on_a[:-1]:
            r.release(w)  # from the loop
            await asyncio.sleep(0)
            assert not drained.done()
        t = threading.Thread(target=r.release, args=(on_a[-1],))
        t.start()
        await drained
        t.join(10)
        assert r.loads["a"] == 0
        assert ticks[0] > 0
        stop.set()
        await ticker
        for w in held:
            if w != "a":
                r.release(w)

    asyncio.run(main())
    assert r.in_flight == 0


@pytest.mark.timeout(60)
def test_async_timeouts_end_with_clear_errors(make_router: MakeRouter) -> None:
    r = make_router(["a"], max_in_flight=1)

    async def main() -> None:
        r.select()
        with pytest.raises(NoWorkerAvailableError, match=r"timed out after 0\.05s"):
            await r.select_async("env-0", timeout=0.05)
        with pytest.raises(NoWorkerAvailableError, match="max_in_flight=1"):
            await r.select_async("env-0")  # no timeout: at once
        with pytest.raises(NoWorkerAvailableError, match="timed out"):
            async with r.request("env-0", timeout=0.01):
                pass
        r.set_draining("a", True)
        with pytest.raises(DrainTimeoutError, match="1 request"):
            await r.wait_drained_async("a", timeout=0.05)
        with pytest.raises(ValueError, match="finite"):
            await r.wait_drained_async("a", timeout=float("inf"))
        with pytest.raises(ValueError, match="finite"):
            await r.select_async(timeout=float("inf"))
        threading.Timer(0.2, r.release, args=("a",)).start()
        await r.wait_drained_async("a", timeout=1e10)  # very long: waits like any other

    asyncio.run(main())
    assert r.in_flight == 0
    assert r._wait.count == 0


@pytest.mark.timeout(120)
def test_a_loop_of_requests_with_cancellations_and_a_rolling_update(make_router: MakeRouter) -> None:
    """Issue 18: many requests, random cancellations, drains and swaps, a thread routing too."""
    workers = [f"w{i}" for i in range(6)]
    r = make_router(workers, max_in_flight=3)
    served: list[str] = []
    errors: list[str] = []
    stop_thread = threading.Event()

    def thread_traffic() -> None:
        rng = random.Random(9)
        while not stop_thread.is_set():
            try:
                with r.request(f"env-{rng.randrange(64)}", timeout=10):
                    pass
            except NoWorkerAvailableError as e:  # pragma: no cover - would be a bug
                errors.append(str(e))

    async def one(i: int, rng: random.Random) -> None:
        async with r.request(f"env-{i % 64}", timeout=30) as worker:
            if r.is_draining(worker):
                errors.append(f"request {i} got draining {worker}")
            for _ in range(rng.randrange(4)):
                await asyncio.sleep(0)  # a cancellation here releases on the way out
            served.append(worker)

    async def update() -> None:
        for version, worker in enumerate(workers, start=1):
            r.set_draining(worker, True)
            await r.wait_drained_async(worker, timeout=30)
            assert r.loads[worker] == 0
            r.set_version(worker, version)
            r.set_draining(worker, False)
            await asyncio.sleep(0)

    async def main() -> None:
        rng = random.Random(0)
        tasks = [asyncio.create_task(one(i, rng)) for i in range(600)]
        updater = asyncio.create_task(update())
        cancelled = 0
        for _ in range(150):
            await asyncio.sleep(0)
            victim = tasks[rng.randrange(len(tasks))]
            if not victim.done():
                victim.cancel()
                cancelled += 1
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await updater
        finished = sum(1 for x in results if x is None)
        assert finished + sum(isinstance(x, asyncio.CancelledError) for x in results) == len(tasks)
        assert finished == len(served)
        assert cancelled > 0

    t = threading.Thread(target=thread_traffic)
    t.start()
    try:
        asyncio.run(main())
    finally:
        stop_thread.set()
        t.join(30)
    assert errors == []
    assert r.in_flight == 0
    assert set(r.loads.values()) == {0}
    assert r._wait.count == 0
    assert {r.version(w) for w in workers} == set(range(1, 7))
