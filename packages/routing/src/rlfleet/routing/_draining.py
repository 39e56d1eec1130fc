"""Draining, the part of a router a rolling update uses: stop selecting a worker, wait until its
requests finished (threads or asyncio), select it again. Every wait has a deadline."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Generic

from rlfleet.routing._errors import DrainTimeoutError, UnknownWorkerError
from rlfleet.routing._waiting import Waiters
from rlfleet.routing._worker import W, WorkerState, deadline


class Draining(Generic[W], abc.ABC):
    """`wait_drained`, `drain`, `undrain` over a router's worker states (`Router` inherits it)."""

    _states: dict[W, WorkerState[W]]
    _wait: Waiters

    @abc.abstractmethod
    def _set_draining(self, worker: W, flag: bool) -> bool:
        """Set `worker` draining or not (the router's bookkeeping); whether it was draining before."""

    def _drain_wait(self, worker: W, timeout: float, what: str) -> tuple[Callable[[], bool | None], float]:
        st = self._states.get(worker)
        if st is None:
            raise UnknownWorkerError(f"{what}({worker!r}): worker is not known to this router")
        if timeout is None:
            raise ValueError(f"{what} needs a timeout: every blocking call has a deadline")
        due = deadline(timeout, what)
        assert due is not None
        return (lambda: True if st.load == 0 else None), due

    def _drain_expired(self, worker: W, timeout: float, what: str) -> DrainTimeoutError:
        st = self._states.get(worker)
        left = st.load if st is not None else 0
        return DrainTimeoutError(f"{what}({worker!r}): {left} request(s) still in flight after {timeout}s")

    def wait_drained(self, worker: W, timeout: float) -> None:
        """Block until `worker` has no request in flight (rolling updates: drain, wait, swap).

        Raises `DrainTimeoutError` if requests are still in flight after `timeout` seconds.
        """
        drained, due = self._drain_wait(worker, timeout, "wait_drained")
        if not drained():
            self._wait.wait(drained, due, lambda: self._drain_expired(worker, timeout, "wait_drained"))

    def drain(self, workers: Iterable[W], timeout: float) -> None:
        """Stop selecting `workers` and wait until none has a request in flight, all within one
        `timeout` (a rolling update's drain of one worker or of a group swapping together).

        Workers no longer routed to (removed meanwhile) are skipped. If they do not drain in
        time `DrainTimeoutError` is raised and each worker is as it was before the call: those
        this drain set draining are selectable again, those already draining (a joining worker
        still at its initial weights, one drained by another update) stay draining.
        """
        workers = list(workers)
        due = deadline(timeout, "drain")
        assert due is not None
        was: dict[W, bool] = {}  # each worker's draining state before this call
        for worker in workers:
            if worker not in was:
                with suppress(UnknownWorkerError):
                    was[worker] = self._set_draining(worker, True)
        try:
            for worker in was:
                with suppress(UnknownWorkerError):
                    self.wait_drained(worker, max(0.0, due - time.monotonic()))
        except BaseException:
            # A failed drain must not leave workers unroutable, nor route to one that was not.
            self.undrain([w for w, draining in was.items() if not draining])
            raise

    def undrain(self, workers: Iterable[W]) -> None:
        """Select `workers` again (those no longer routed to are skipped)."""
        for worker in workers:
            with suppress(UnknownWorkerError):
                self._set_draining(worker, False)

    async def wait_drained_async(self, worker: W, timeout: float) -> None:
        """`wait_drained` for asyncio: waits without blocking the event loop."""
        drained, due = self._drain_wait(worker, timeout, "wait_drained_async")
        if not drained():
            await self._wait.wait_async(
                drained, due, lambda: self._drain_expired(worker, timeout, "wait_drained_async")
            )
