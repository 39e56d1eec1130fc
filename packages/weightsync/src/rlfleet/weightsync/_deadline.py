"""Deadlines and watchdogs: every blocking step of a sync ends, with an error that names it.

`Deadline` is a point on the monotonic clock that a whole sync shares, so nested waits cannot
each take the full timeout. `Watchdog` covers a call that cannot take a timeout itself (a
collective): when it expires it runs abort callbacks (e.g. abort the communicator) and marks
itself `fired`. An aborted collective may return without raising, so the caller checks
`fired` afterwards (`raise_if_fired`). `stand_down_armed_watchdogs` is NeMo RL's
`stand_down_refit_watchdog`: when a peer is known dead its sockets close and survivors unblock
on their own, while firing would abort a healthy communicator; it disarms every armed watchdog
in the process, without blocking, and returns how many.

Every blocking call of the package takes a deadline and has a finite default:
`DEFAULT_SYNC_TIMEOUT_S` for a whole sync (a send, a receive, a gather) and
`DEFAULT_SERVING_TIMEOUT_S` for the serving lock (a request waiting for a commit, a commit
waiting for requests). ``None`` still means "no limit", but only when a caller passes it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

from rlfleet.weightsync._errors import SyncAbortedError, SyncTimeoutError

__all__ = [
    "DEFAULT_SERVING_TIMEOUT_S",
    "DEFAULT_SYNC_TIMEOUT_S",
    "MAX_DEADLINE_S",
    "Backoff",
    "Deadline",
    "Watchdog",
    "armed_watchdogs",
    "caller_deadline",
    "current_deadline",
    "deadline_or",
    "stand_down_armed_watchdogs",
]

_log = logging.getLogger(__name__)

#: Default deadline of one whole sync (send, receive, gather): generous for a large model over a
#: slow link, short enough that a silent peer is named within minutes, not never.
DEFAULT_SYNC_TIMEOUT_S = 600.0
#: Default wait on a serving lock: a request for a commit to finish, a commit for requests.
DEFAULT_SERVING_TIMEOUT_S = 60.0
#: Longer deadlines are held as this many seconds (about 31 years): the clocks and the waits
#: underneath (thread locks, timedelta, torch's millisecond timeouts) overflow far above it.
MAX_DEADLINE_S = 1e9


class Deadline:
    """A fixed point on the monotonic clock, ``seconds`` from creation; ``None`` never expires.

    ``inf`` is no limit, like ``None``; a finite number above `MAX_DEADLINE_S` is held as
    `MAX_DEADLINE_S` (so every wait underneath stays in range).
    """

    __slots__ = ("_end", "_start", "seconds")

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None:
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or math.isnan(seconds):
                raise ValueError(f"deadline seconds must be a number or None, got {seconds!r}")
            if seconds < 0:
                raise ValueError(f"deadline seconds must be >= 0, got {seconds!r}")
        self.seconds = None if seconds is None or math.isinf(seconds) else min(float(seconds), MAX_DEADLINE_S)
        self._start = time.monotonic()
        self._end = None if self.seconds is None else self._start + self.seconds

    @classmethod
    def coerce(cls, value: Deadline | float | None) -> Deadline:
        """Accept a Deadline (shared as is), a number of seconds, or None (no limit)."""
        return value if isinstance(value, Deadline) else cls(value)

    def child(self, seconds: float | None) -> Deadline:
        """A deadline ``seconds`` from now, but never later than this one (for one sub-step)."""
        inner = Deadline(seconds)
        if self._end is not None and (inner._end is None or inner._end > self._end):
            inner.seconds = self.seconds
            inner._start = self._start
            inner._end = self._end
        return inner

    def leaving(self, seconds: float) -> Deadline:
        """A deadline `seconds` before this one (for a step that must leave time for the next)."""
        inner = Deadline(None)
        if self._end is not None and self.seconds is not None:
            inner.seconds = max(0.0, self.seconds - seconds)
            inner._start = self._start
            inner._end = self._end - seconds
        return inner

    def remaining(self) -> float | None:
        """Seconds left (>= 0), or None for no limit: the convention of `Event.wait(timeout)`."""
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())

    def remaining_or(self, cap: float) -> float:
        """Seconds left, at most `cap` (a finite number for APIs that do not take None)."""
        left = self.remaining()
        return cap if left is None else min(cap, left)

    @property
    def expired(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def error(self, what: str) -> SyncTimeoutError:
        """The SyncTimeoutError for `what` (for callers that detect expiry themselves)."""
        return SyncTimeoutError(
            f"{what} timed out after {self.elapsed:.3f}s (deadline {self.seconds:.3f}s)"
            if self.seconds is not None
            else f"{what} timed out"
        )

    def check(self, what: str) -> None:
        """Raise SyncTimeoutError naming `what` if the deadline has passed."""
        if self.expired:
            raise self.error(what)

    def wait(
        self,
        waitable: threading.Event | threading.Condition,
        what: str,
        predicate: Callable[[], bool] | None = None,
    ) -> None:
        """Wait for an Event to be set, or (lock held) for a Condition's `predicate`; else time out.

        With a Condition and no predicate, one notification (or the deadline) ends the wait.
        """
        if isinstance(waitable, threading.Event):
            if not waitable.wait(self.remaining()):
                raise self.error(what)
            return
        if predicate is None:
            if not waitable.wait(self.remaining()):
                raise self.error(what)
            return
        if not waitable.wait_for(predicate, self.remaining()):
            raise self.error(what)

    def poll(
        self,
        predicate: Callable[[], bool],
        what: str,
        *,
        backoff: Backoff | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        """Spin on `predicate` with a short backoff (20 µs .. 1 ms) until true; else time out.

        `on_wait` runs between tries (e.g. a liveness check that raises PeerLostError).
        """
        backoff = backoff or Backoff()
        while not predicate():
            if on_wait is not None:
                on_wait()
            self.check(what)
            backoff.sleep(self.remaining())

    def __repr__(self) -> str:
        left = self.remaining()
        return "Deadline(None)" if left is None else f"Deadline({self.seconds}, remaining={left:.3f})"


class Backoff:
    """Sleeps that start short (a bucket is usually ready within microseconds) and grow to a cap."""

    __slots__ = ("_delay", "factor", "initial", "maximum")

    def __init__(self, initial: float = 20e-6, maximum: float = 1e-3, factor: float = 2.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self._delay = initial

    def reset(self) -> None:
        self._delay = self.initial

    def sleep(self, limit: float | None = None) -> None:
        delay = self._delay if limit is None else min(self._delay, limit)
        if delay > 0:
            time.sleep(delay)
        self._delay = min(self.maximum, self._delay * self.factor)


# -- watchdogs --------------------------------------------------------------------------------

_registry_lock = threading.Lock()
_armed: weakref.WeakSet[Watchdog] = weakref.WeakSet()

_IDLE, _ARMED, _FIRED, _DISARMED, _STOOD_DOWN = "idle", "armed", "fired", "disarmed", "stood down"


class Watchdog:
    """Abort callbacks that run once if a guarded step outlives ``timeout_s``.

    Use as a context manager (arms on enter, disarms on exit) around a call that cannot take a
    timeout. The callbacks run on a timer thread and must not block for long; their exceptions
    are logged, not raised. After the guarded call, `raise_if_fired()` turns a silent abort into
    SyncAbortedError. A watchdog can be re-armed after it is disarmed.
    """

    def __init__(
        self,
        timeout_s: float,
        on_fire: Callable[[], Any] | Iterable[Callable[[], Any]] = (),
        name: str = "watchdog",
    ) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"watchdog {name!r}: timeout_s must be a positive number, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.name = name
        self._callbacks: list[Callable[[], Any]] = [on_fire] if callable(on_fire) else list(on_fire)
        self._lock = threading.Lock()
        self._state = _IDLE
        self._timer: threading.Timer | None = None

    # -- state ----------------------------------------------------------------------------
    @property
    def fired(self) -> bool:
        """True once the timeout expired and the abort callbacks ran (until re-armed)."""
        return self._state == _FIRED

    @property
    def armed(self) -> bool:
        return self._state == _ARMED

    @property
    def stood_down(self) -> bool:
        return self._state == _STOOD_DOWN

    def add_callback(self, callback: Callable[[], Any]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    # -- arming ---------------------------------------------------------------------------
    def arm(self) -> Watchdog:
        with self._lock:
            if self._state == _ARMED:
                raise RuntimeError(f"watchdog {self.name!r} is already armed")
            self._state = _ARMED
            timer = threading.Timer(self.timeout_s, self._fire)
            timer.daemon = True
            timer.name = f"rlfleet-watchdog-{self.name}"
            self._timer = timer
        with _registry_lock:
            _armed.add(self)
        timer.start()
        return self

    def disarm(self) -> bool:
        """Cancel the timer; True if it was armed (i.e. had not fired or been stood down)."""
        return self._cancel(_DISARMED)

    def stand_down(self) -> bool:
        """Disarm because a peer is known dead; never blocks. True if it was armed."""
        return self._cancel(_STOOD_DOWN)

    def _cancel(self, state: str) -> bool:
        with self._lock:
            was_armed = self._state == _ARMED
            if was_armed:
                self._state = state
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()  # only sets the timer's event: does not wait for the thread
        with _registry_lock:
            _armed.discard(self)
        return was_armed

    def _fire(self) -> None:
        with self._lock:
            if self._state != _ARMED:
                return
            self._state = _FIRED
            callbacks = list(self._callbacks)
        with _registry_lock:
            _armed.discard(self)
        _log.warning(
            "watchdog %r fired after %.3fs; running %d abort callbacks",
            self.name,
            self.timeout_s,
            len(callbacks),
        )
        for callback in callbacks:
            try:
                callback()
            except Exception:
                _log.exception("watchdog %r: abort callback %r failed", self.name, callback)

    def raise_if_fired(self, what: str | None = None) -> None:
        """Raise SyncAbortedError if the watchdog fired (a collective it aborted may not raise)."""
        if self.fired:
            raise SyncAbortedError(
                f"{what or self.name} was aborted by watchdog {self.name!r} after {self.timeout_s:.3f}s"
            )

    # -- context manager ------------------------------------------------------------------
    def __enter__(self) -> Watchdog:
        return self.arm()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.disarm()

    def __repr__(self) -> str:
        return f"Watchdog({self.name!r}, timeout_s={self.timeout_s}, state={self._state})"


def armed_watchdogs() -> list[Watchdog]:
    """The watchdogs armed in this process right now."""
    with _registry_lock:
        return list(_armed)


def stand_down_armed_watchdogs() -> int:
    """Disarm every armed watchdog in this process without firing it; returns how many.

    Called when a peer is confirmed dead. Takes only short internal locks, never waits for a
    timer thread or a collective.
    """
    return sum(1 for watchdog in armed_watchdogs() if watchdog.stand_down())


# -- the caller's deadline, for hooks whose signature has none ----------------------------------

_caller_deadline: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "rlfleet_weightsync_caller_deadline", default=None
)


@contextlib.contextmanager
def caller_deadline(deadline: Deadline) -> Iterator[Deadline]:
    """Within the block, `current_deadline()` is `deadline` (in this thread / task).

    A transport wraps the consumer calls of one sync in it, so a hook whose signature carries
    no deadline (`BucketConsumer.begin`) waits under the deadline of the sync that called it,
    through any adapter consumers in between, instead of a timeout of its own.
    """
    token = _caller_deadline.set(deadline)
    try:
        yield deadline
    finally:
        _caller_deadline.reset(token)


def current_deadline() -> Deadline | None:
    """The deadline of the innermost `caller_deadline` block, or None outside one."""
    return _caller_deadline.get()


def deadline_or(value: Deadline | float | None, default_s: float) -> Deadline:
    """A Deadline from a caller's argument: a Deadline as is, seconds, or None for `default_s`.

    Every blocking call has a finite deadline by default; a caller who wants none says so
    (``math.inf``).
    """
    return Deadline.coerce(default_s if value is None else value)
