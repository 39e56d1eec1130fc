"""Threads and coroutines waiting for a router's state to change.

A router calls `wake` after every change that can let a waiter through (a release, a worker
added, undrained, updated). Threads wait on a condition variable; coroutines await a future
that `wake` resolves through its event loop, so the loop never blocks. Both register before
they look at the router's state and look again after every wake, so no wake-up is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from rlfleet.routing._worker import LONGEST_WAIT

T = TypeVar("T")


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Waiters:
    """The waiting room of one router."""

    __slots__ = ("_cond", "_futures", "count")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._futures: set[asyncio.Future[None]] = set()
        self.count = 0  # threads and coroutines waiting; read without the lock on hot paths

    def wake(self) -> None:
        """Wake every waiter (a no-op when nobody waits)."""
        if not self.count:
            return
        with self._cond:
            self._cond.notify_all()
            futures, self._futures = self._futures, set()
        for future in futures:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits it any more
                future.get_loop().call_soon_threadsafe(_resolve, future)

    def wait(self, ready: Callable[[], T | None], deadline: float, expired: Callable[[], Exception]) -> T:
        """Block until `ready()` returns a value; raise `expired()` at `deadline`."""
        with self._cond:
            self.count += 1
            try:
                while True:
                    # Registered (count) and holding the condition: a change after this look
                    # notifies us in wait(), a change before it is seen here.
                    got = ready()
                    if got is not None:
                        return got
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise expired()
                    self._cond.wait(min(remaining, LONGEST_WAIT))
            finally:
                self.count -= 1

    async def wait_async(
        self, ready: Callable[[], T | None], deadline: float, expired: Callable[[], Exception]
    ) -> T:
        """`wait` for coroutines: awaits a future instead of blocking; cancellable at every await."""
        loop = asyncio.get_running_loop()
        with self._cond:
            self.count += 1
        try:
            while True:
                future: asyncio.Future[None] = loop.create_future()
                with self._cond:
                    self._futures.add(future)
                timer: asyncio.TimerHandle | None = None
                try:
                    got = ready()  # after registering: a change from here on resolves `future`
                    if got is not None:
                        return got
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise expired()
                    timer = loop.call_later(min(remaining, LONGEST_WAIT), _resolve, future)
                    await future
                finally:
                    if timer is not None:
                        timer.cancel()
                    with self._cond:
                        self._futures.discard(future)
        finally:
            with self._cond:
                self.count -= 1
