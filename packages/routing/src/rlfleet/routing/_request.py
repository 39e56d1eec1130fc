"""One request as a context manager: the in-flight slot is released however the body ends."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, cast

from rlfleet.routing._public import public
from rlfleet.routing._worker import W

if TYPE_CHECKING:
    from rlfleet.routing._base import Router


@public
class Request(Generic[W]):
    """`with router.request(key) as worker:` or `async with ...`: select on entry, release on exit.

    The async form waits without blocking the event loop. A task cancelled while waiting holds
    nothing; one cancelled inside the body releases its worker on the way out.
    """

    __slots__ = ("_held", "_key", "_router", "_timeout", "worker")

    def __init__(self, router: Router[W], key: Any, timeout: float | None) -> None:
        self._router = router
        self._key = key
        self._timeout = timeout
        self.worker: W | None = None  # the worker while the request is in flight
        self._held = False

    def _check_idle(self) -> None:
        if self._held:
            raise RuntimeError(f"this request is already in flight on {self.worker!r}: enter it once")

    def _finish(self) -> None:
        worker, held = self.worker, self._held
        self.worker, self._held = None, False
        if held:
            self._router.release(cast(W, worker))

    def __enter__(self) -> W:
        self._check_idle()
        self.worker = worker = self._router.select(self._key, timeout=self._timeout)
        self._held = True
        return worker

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._finish()

    async def __aenter__(self) -> W:
        self._check_idle()
        self.worker = worker = await self._router.select_async(self._key, timeout=self._timeout)
        self._held = True
        return worker

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._finish()

    def __repr__(self) -> str:
        state = f"in flight on {self.worker!r}" if self._held else "not in flight"
        return f"Request(key={self._key!r}, {state})"
