"""The router base class: selecting, releasing, the version preference, waiting (threads and
asyncio). Who may be selected (membership, draining, versions, staleness) is `_membership`.

A subclass only decides *which* worker of a candidate group takes a request (`_pick_in`) and
keeps its own index of candidates in step through the `_index_add` / `_index_remove` /
`_on_release` hooks. Everything else (in-flight counts, draining, the version preference,
staleness, timeouts, errors) lives here so every router behaves the same way at its edges.
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from typing_extensions import Unpack

from rlfleet.routing._errors import NotInFlightError, NoWorkerAvailableError, UnknownWorkerError
from rlfleet.routing._membership import Membership
from rlfleet.routing._request import Request
from rlfleet.routing._versions import VersionGroups
from rlfleet.routing._waiting import Waiters
from rlfleet.routing._worker import (
    Loads,
    Options,
    RouterOptions,
    VersionPreference,
    W,
    WorkerState,
    check_many,
    deadline,
    public_router,
)

PickIn = Callable[[Any, int | None, int | None], WorkerState[W] | None]


@public_router
class Router(Membership[W]):
    """Routes requests to workers (opaque hashable keys) and counts requests in flight.

    `select` picks a worker and counts the request as in flight until `release` (or use
    `with router.request(key) as worker:` / `async with`). A draining worker is never picked.
    `max_in_flight` caps the requests one worker may hold.

    `prefer_newest_version` decides how weight versions steer requests during a rolling update:
    - True (default): the newest version first, but only up to the load bound (`load_factor`
      times the mean load); workers at most `version_lag` (1) versions behind take the rest. On
      a sticky router (consistent-hash, prefix-aware, node-affinity) a keyed request keeps its
      worker while that worker is that recent, until it is drained for its own update. No
      pile-up on the first updated worker; a session may run one version behind for up to one
      rolling update.
    - "strict": only the newest version while one of its workers can take the request: least
      staleness, but the first updated worker takes every request and every session moves to it.
    - False: versions are ignored.
    Older workers (further behind, or every older one with "strict") take requests only when
    no newer one can (all at `max_in_flight`): a full newest version never pauses requests.

    `max_staleness` bounds what the preference may fall back to: a worker more than that many
    versions behind the latest committed version (`set_latest_version(v)`, announced by the
    trainer before any worker swaps, or the newest version any worker serves) takes no request
    at all; with none eligible, `select(timeout=...)` waits for one to catch up.
    """

    _sticky = False  # keyed requests keep their own worker whatever its (recent) version

    def __init__(self, workers: Iterable[W] = (), **options: Unpack[RouterOptions]) -> None:
        check_many(workers, type(self).__name__, "workers")
        opts = Options(options)
        self._prefer, self._cap, self._c, self._lag = opts.prefer, opts.cap, opts.factor, opts.lag
        self._staleness, self._latest = opts.staleness, None
        self._lock = threading.Lock()  # membership; also guards loads in single-lock routers
        self._wait = Waiters()
        self._states: dict[W, WorkerState[W]] = {}
        self._next_index = 0
        self._total = 0
        self._groups = VersionGroups(bool(self._prefer), self._lag)
        for worker in workers:
            self.add_worker(worker)

    # ------------------------------------------------------------------ subclass hooks
    @abc.abstractmethod
    def _pick_in(self, key: Any, group: int | None, limit: int | None) -> WorkerState[W] | None:
        """Choose a worker of `group` (None: any recent group, the key's own worker) holding fewer than
        `limit` requests, add one to its load and return it; None if there is none."""

    def _on_release(self, st: WorkerState[W]) -> None:
        """`st.load` just went down by one and `st` is selectable."""

    def _prepare(self, key: Any) -> Any:
        """The key as `_pick_in` wants it, computed once per request outside the lock."""
        return key

    def _in_flight_now(self) -> int:
        return self._total

    # ------------------------------------------------------------------ the version preference
    def _bound(self, group: int | None, extra: int = 1) -> int:
        """Requests one worker of `group` (None: of the recent groups) may hold by preference
        once `extra` more are placed."""
        n = self._groups.size(group)
        return math.ceil(self._c * (self._in_flight_now() + extra) / n) if n else 0

    def _choose(self, key: Any, pick_in: PickIn[W]) -> WorkerState[W] | None:
        """Apply `prefer_newest_version` over the candidate groups with `pick_in`."""
        order = self._groups.order
        cap = self._cap
        if len(order) == 1:
            return pick_in(key, order[0], cap)
        if not order:
            return None
        if self._prefer == "strict":
            for group in order:
                st = pick_in(key, group, cap)
                if st is not None:
                    return st
            return None
        limit = self._bound(None)  # the least-loaded recent worker is always under it
        if cap is not None and cap < limit:
            limit = cap
        if self._sticky and key is not None:
            st = pick_in(key, None, limit)
            if st is not None:
                return st
        recent = self._groups.recent
        for i, group in enumerate(order):
            st = pick_in(key, group, limit if i < recent else cap)
            if st is not None:
                return st
        return None

    # ------------------------------------------------------------------ selecting
    def _try_select(self, key: Any) -> W | None:
        lock = self._lock
        lock.acquire()  # acquire/release: cheaper than `with` on the hot path
        try:
            order = self._groups.order  # one version served (the usual case): no preference to apply
            st = (
                self._pick_in(key, order[0], self._cap)
                if len(order) == 1
                else self._choose(key, self._pick_in)
            )
            if st is None:
                return None
            self._total += 1
            return st.key
        finally:
            lock.release()

    def select(self, key: Any = None, *, timeout: float | None = None) -> W:
        """Pick a worker for one request (keyed by session / env id / prompt if the router uses keys).

        The request counts as in flight on the returned worker until `release(worker)`.
        Without `timeout` a request nobody can take raises `NoWorkerAvailableError` at once;
        with one, waits up to `timeout` seconds for a worker to become selectable.
        """
        due = None if timeout is None else deadline(timeout, "select")
        key = self._prepare(key)
        worker = self._try_select(key)
        if worker is not None:
            return worker
        return self._select_wait(key, due, timeout)

    def _select_wait(self, key: Any, due: float | None, timeout: float | None) -> W:
        if due is None:
            raise NoWorkerAvailableError(f"no worker can take a request for key {key!r}: {self._why_none()}")
        return self._wait.wait(lambda: self._try_select(key), due, lambda: self._timed_out(key, timeout))

    def _timed_out(self, key: Any, timeout: float | None) -> NoWorkerAvailableError:
        return NoWorkerAvailableError(
            f"timed out after {timeout}s waiting for a worker for key {key!r}: {self._why_none()}"
        )

    async def select_async(self, key: Any = None, *, timeout: float | None = None) -> W:
        """`select` for asyncio: waits without blocking the event loop.

        Cancelling the waiting task leaves nothing in flight. Prefer `async with
        router.request(key) as worker:`, which also releases when the body is cancelled.
        """
        due = None if timeout is None else deadline(timeout, "select_async")
        key = self._prepare(key)
        worker = self._try_select(key)
        if worker is not None:
            return worker
        if due is None:
            return self._select_wait(key, due, timeout)  # raises at once
        return await self._wait.wait_async(
            lambda: self._try_select(key), due, lambda: self._timed_out(key, timeout)
        )

    def request(self, key: Any = None, *, timeout: float | None = None) -> Request[W]:
        """One request as a context manager: `with` / `async with router.request(key) as worker:`.

        Entering selects (waiting up to `timeout`), leaving releases, however the body ends
        (an exception, a cancelled task).
        """
        return Request(self, key, timeout)

    def release(self, worker: W) -> None:
        """A request on `worker` finished. Works on draining and on removed workers too."""
        lock = self._lock
        lock.acquire()
        try:
            st = self._states.get(worker)
            if st is not None and st.selectable and st.load > 0:  # `_count_down`'s usual case, inlined
                st.load -= 1
                self._on_release(st)
            else:
                self._count_down(worker, st)
            self._total -= 1
        finally:
            lock.release()
        if self._wait.count:
            self._wait.wake()

    def _count_down(self, worker: W, st: WorkerState[W] | None) -> None:
        """One request fewer on `worker` (state `st`), under the lock guarding its load."""
        if st is None:
            raise UnknownWorkerError(f"release({worker!r}): worker is not known to this router")
        if st.load <= 0:
            raise NotInFlightError(f"release({worker!r}): worker has no request in flight")
        st.load -= 1
        if st.selectable:
            self._on_release(st)
        elif not st.active and st.load == 0 and self._states.get(worker) is st:
            del self._states[worker]

    def assign(self, keys: Iterable[Any] | int, *, timeout: float | None = None) -> list[W]:
        """Select a worker for each key (an int n means n requests without keys).

        All or nothing: if one request cannot be placed, those already placed are released
        and the error is raised. `timeout` bounds the whole batch.
        """
        if isinstance(keys, bool):
            raise TypeError("assign: keys must be an iterable of keys or a number of requests, got a bool")
        if not isinstance(keys, int):
            check_many(keys, "assign", "keys")  # a str would be one request per character
        if isinstance(keys, int):
            if keys < 0:
                raise ValueError(f"assign: number of requests must be >= 0, got {keys}")
            keys = [None] * keys
        due = None if timeout is None else deadline(timeout, "assign")
        prepared = [self._prepare(key) for key in keys]
        placed = self._try_assign(prepared)
        if placed is not None:
            return placed
        out: list[W] = []
        try:
            for key in prepared:
                worker = self._try_select(key)
                if worker is None:
                    worker = self._select_wait(key, due, timeout)
                out.append(worker)
        except BaseException:
            for worker in out:
                self.release(worker)
            raise
        return out

    def _try_assign(self, keys: list[Any]) -> list[W] | None:
        """The whole batch under one lock round-trip, or None (nothing placed) if one does not fit."""
        with self._lock:
            picked = self._pick_batch(keys)
            if len(picked) == len(keys):
                self._total += len(picked)
                return [st.key for st in picked]
            for st in picked:  # undo; the caller takes the general path (waits, errors)
                st.load -= 1
                self._on_release(st)
            return None

    def _pick_batch(self, keys: list[Any]) -> list[WorkerState[W]]:
        """A worker for each key in turn, under the lock; stops at the first that does not fit."""
        picked: list[WorkerState[W]] = []
        for key in keys:
            st = self._choose(key, self._pick_in)
            if st is None:
                break
            picked.append(st)
        return picked

    # ------------------------------------------------------------------ inspection
    def bound(self, extra: int = 1) -> int:
        """Most requests one worker may hold by preference (a sticky key, the newest version)
        after `extra` more are placed: `ceil(load_factor * (in_flight + extra) / candidates)`."""
        with self._exclusive():
            order = self._groups.order
            return self._bound(order[0] if self._prefer == "strict" and order else None, extra)

    @property
    def in_flight(self) -> int:
        """Requests in flight over all workers (removed ones still counting down included)."""
        with self._exclusive():
            return self._in_flight_now()

    @property
    def loads(self) -> Loads[W]:
        """Requests in flight per worker (removed ones still counting down included)."""
        with self._exclusive():
            return Loads({w: st.load for w, st in self._states.items()})

    @property
    def waiting(self) -> int:
        """Callers waiting on this router now: selects with a timeout (no worker could take them)
        and drains. A queue that grows says every worker is busy, draining or stale."""
        return self._wait.count

    @property
    def prefer_newest_version(self) -> VersionPreference:
        return self._prefer

    @property
    def max_in_flight(self) -> int | None:
        return self._cap

    @property
    def version_lag(self) -> int:
        return self._lag

    @property
    def load_factor(self) -> float:
        return self._c

    def __len__(self) -> int:
        return len(self.workers)

    def __iter__(self) -> Iterator[W]:
        return iter(self.workers)

    def __contains__(self, worker: object) -> bool:
        try:
            st = self._states.get(cast(W, worker))
        except TypeError:  # unhashable: cannot be a worker
            return False
        return st is not None and st.active

    def __repr__(self) -> str:
        return f"{type(self).__name__}(workers={len(self)}, in_flight={self.in_flight})"
