"""The router base class: worker bookkeeping, draining, versions, waiting.

A subclass only decides *which* selectable worker takes a request (`_pick`) and keeps its own
index of candidates in step through the `_index_add` / `_index_remove` / `_on_release` hooks.
Everything else (in-flight counts, draining, weight versions, timeouts, errors) lives here
so every router behaves the same way at its edges.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Hashable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar, cast

from rlfleet.routing._errors import (
    DrainTimeoutError,
    DuplicateWorkerError,
    NotInFlightError,
    NoWorkerAvailableError,
    UnknownWorkerError,
)

W = TypeVar("W", bound=Hashable)


class _Worker(Generic[W]):
    """One worker's state. Guarded by the router's lock (by its node's lock in NodeAffinityRouter)."""

    __slots__ = (
        "active",
        "draining",
        "group",
        "index",
        "key",
        "load",
        "node",
        "selectable",
        "slot",
        "version",
    )

    def __init__(self, key: W, index: int, node: Hashable | None, version: int) -> None:
        self.key = key
        self.index = index  # insertion order: the deterministic tie-break
        self.node = node
        self.version = version
        self.load = 0  # requests in flight
        self.draining = False
        self.active = True  # False once removed (kept only while requests are still in flight)
        self.selectable = False  # active and not draining: in the subclass's index
        self.group = 0  # candidate group: the version when preferring the newest, else 0
        self.slot: Any = None  # subclass-private (NodeAffinityRouter: the node record)


def _check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an int, got {version!r}")
    return version


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout != timeout:  # NaN
        raise ValueError("timeout must be a number of seconds, got nan")
    return time.monotonic() + max(0.0, float(timeout))


class Router(Generic[W], abc.ABC):
    """Routes requests to workers (opaque hashable keys) and counts requests in flight.

    `select` picks a worker and counts the request as in flight until `release`. A draining
    worker is never picked; with `prefer_newest_version` only workers at the newest weight
    version among the selectable ones are candidates, so a rolling update moves traffic to
    updated workers wave by wave without a global pause. `max_in_flight` caps the requests
    one worker may hold (a worker at the cap is not selectable until a release).
    """

    def __init__(
        self,
        workers: Iterable[W] = (),
        *,
        prefer_newest_version: bool = True,
        max_in_flight: int | None = None,
    ) -> None:
        if max_in_flight is not None and (
            isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1
        ):
            raise ValueError(f"max_in_flight must be a positive int or None, got {max_in_flight!r}")
        self._prefer_newest = bool(prefer_newest_version)
        self._cap: int | None = max_in_flight
        self._lock = threading.Lock()  # membership; also guards loads in single-lock routers
        self._cond = threading.Condition(threading.Lock())  # waiters of select / wait_drained
        self._waiters = 0
        self._states: dict[W, _Worker[W]] = {}
        self._next_index = 0
        self._total = 0
        self._group_counts: dict[int, int] = {}  # selectable workers per candidate group
        self._best: int | None = None  # the candidate group (None: nothing selectable)
        for worker in workers:
            self.add_worker(worker)

    # ------------------------------------------------------------------ subclass hooks
    @abc.abstractmethod
    def _pick(self, key: Hashable | None) -> _Worker[W] | None:
        """Choose a candidate, add one to its load and return it; None if no candidate.

        Called with the router's lock held (single-lock routers only).
        """

    @abc.abstractmethod
    def _index_add(self, st: _Worker[W]) -> None:
        """`st` became selectable (its `group` is set)."""

    @abc.abstractmethod
    def _index_remove(self, st: _Worker[W]) -> None:
        """`st` stops being selectable (`group` still holds the old value)."""

    def _on_release(self, st: _Worker[W]) -> None:
        """`st.load` just went down by one and `st` is selectable."""

    def _member_add(self, st: _Worker[W]) -> None:
        """`st` joined the router (draining or not)."""

    def _member_remove(self, st: _Worker[W]) -> None:
        """`st` left the router."""

    def _exclusive(self) -> AbstractContextManager[Any]:
        """Lock(s) that freeze every worker's state: structural changes and snapshots."""
        return self._lock

    # ------------------------------------------------------------------ hot path
    def _try_select(self, key: Hashable | None) -> W | None:
        lock = self._lock
        lock.acquire()  # acquire/release: cheaper than `with` on the hot path
        try:
            st = self._pick(key)
            if st is None:
                return None
            self._total += 1
            return st.key
        finally:
            lock.release()

    def select(self, key: Hashable | None = None, *, timeout: float | None = None) -> W:
        """Pick a worker for one request (keyed by session / env id if the router uses keys).

        The request counts as in flight on the returned worker until `release(worker)`.
        Without `timeout` a request nobody can take raises `NoWorkerAvailableError` at once;
        with one, waits up to `timeout` seconds for a worker to become selectable.
        """
        worker = self._try_select(key)
        if worker is not None:
            return worker
        return self._select_slow(key, _deadline(timeout), timeout)

    def _select_slow(self, key: Hashable | None, deadline: float | None, timeout: float | None) -> W:
        if deadline is None:
            raise NoWorkerAvailableError(f"no worker can take a request for key {key!r}: {self._why_none()}")
        with self._cond:
            self._waiters += 1
            try:
                while True:
                    # The waiter count is raised before this retry, so a release that happens
                    # after it is seen here or notifies us below: no lost wake-up.
                    worker = self._try_select(key)
                    if worker is not None:
                        return worker
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise NoWorkerAvailableError(
                            f"timed out after {timeout}s waiting for a worker for key {key!r}: "
                            f"{self._why_none()}"
                        )
                    self._cond.wait(remaining)
            finally:
                self._waiters -= 1

    def release(self, worker: W) -> None:
        """A request on `worker` finished. Works on draining and on removed workers too."""
        lock = self._lock
        lock.acquire()
        try:
            st = self._states.get(worker)
            if st is None:
                raise UnknownWorkerError(f"release({worker!r}): worker is not known to this router")
            if st.load <= 0:
                raise NotInFlightError(f"release({worker!r}): worker has no request in flight")
            st.load -= 1
            self._total -= 1
            if st.selectable:
                self._on_release(st)
            elif not st.active and st.load == 0:
                del self._states[worker]
        finally:
            lock.release()
        if self._waiters:
            self._wake()

    def assign(self, keys: Iterable[Hashable | None] | int, *, timeout: float | None = None) -> list[W]:
        """Select a worker for each key (an int n means n requests without keys).

        All or nothing: if one request cannot be placed, those already placed are released
        and the error is raised. `timeout` bounds the whole batch.
        """
        if isinstance(keys, bool):
            raise TypeError("assign: keys must be an iterable of keys or a number of requests, got a bool")
        if isinstance(keys, int):
            if keys < 0:
                raise ValueError(f"assign: number of requests must be >= 0, got {keys}")
            keys = [None] * keys
        deadline = _deadline(timeout)
        out: list[W] = []
        try:
            for key in keys:
                worker = self._try_select(key)
                if worker is None:
                    worker = self._select_slow(key, deadline, timeout)
                out.append(worker)
        except BaseException:
            for worker in out:
                self.release(worker)
            raise
        return out

    # ------------------------------------------------------------------ membership
    def _get(self, worker: W, what: str) -> _Worker[W]:
        st = self._states.get(worker)
        if st is None or not st.active:
            raise UnknownWorkerError(f"{what}({worker!r}): worker is not known to this router")
        return st

    def _make_selectable(self, st: _Worker[W]) -> None:
        st.group = st.version if self._prefer_newest else 0
        st.selectable = True
        self._group_counts[st.group] = self._group_counts.get(st.group, 0) + 1
        self._index_add(st)

    def _make_unselectable(self, st: _Worker[W]) -> None:
        self._index_remove(st)
        st.selectable = False
        left = self._group_counts[st.group] - 1
        if left:
            self._group_counts[st.group] = left
        else:
            del self._group_counts[st.group]

    def _refresh_best(self) -> None:
        self._best = max(self._group_counts) if self._group_counts else None

    def _new_state(self, worker: W, node: Hashable | None, version: int) -> _Worker[W]:
        old = self._states.get(worker)
        if old is not None:
            if old.active:
                raise DuplicateWorkerError(f"add_worker({worker!r}): worker is already in this router")
            raise DuplicateWorkerError(
                f"add_worker({worker!r}): worker was removed but still has {old.load} request(s) in "
                "flight; release them (wait_drained) before adding it again"
            )
        st = _Worker(worker, self._next_index, node, version)
        self._next_index += 1
        return st

    def add_worker(self, worker: W, *, node: Hashable | None = None, version: int = 0) -> None:
        """Add a worker (selectable at once) on `node` at weight `version`."""
        version = _check_version(version)
        with self._exclusive():
            st = self._new_state(worker, node, version)
            self._member_add(st)
            self._states[worker] = st
            self._make_selectable(st)
            self._refresh_best()
        self._wake()

    def remove_worker(self, worker: W) -> None:
        """Stop routing to `worker`. Requests still in flight on it can still be released."""
        with self._exclusive():
            st = self._get(worker, "remove_worker")
            if st.selectable:
                self._make_unselectable(st)
            self._member_remove(st)
            st.active = False
            if st.load == 0:
                del self._states[worker]
            self._refresh_best()
        self._wake()  # the newest version may have gone: older workers may be candidates now

    def set_draining(self, worker: W, flag: bool = True) -> None:
        """A draining worker is never selected; releases on it still count down."""
        with self._exclusive():
            st = self._get(worker, "set_draining")
            flag = bool(flag)
            if st.draining != flag:
                st.draining = flag
                if flag:
                    self._make_unselectable(st)
                else:
                    self._make_selectable(st)
                self._refresh_best()
        self._wake()

    def set_version(self, worker: W, version: int) -> None:
        """Record the weight version `worker` now serves."""
        version = _check_version(version)
        with self._exclusive():
            st = self._get(worker, "set_version")
            if st.version != version:
                if st.selectable:
                    self._make_unselectable(st)
                    st.version = version
                    self._make_selectable(st)
                else:
                    st.version = version
                self._refresh_best()
        self._wake()

    def version(self, worker: W) -> int:
        """The weight version `worker` serves."""
        with self._lock:
            return self._get(worker, "version").version

    def is_draining(self, worker: W) -> bool:
        with self._lock:
            return self._get(worker, "is_draining").draining

    def node(self, worker: W) -> Hashable | None:
        """The node `worker` was added on (None if not given)."""
        with self._lock:
            return self._get(worker, "node").node

    # ------------------------------------------------------------------ inspection
    @property
    def workers(self) -> list[W]:
        """Workers routed to (draining ones included), in insertion order."""
        with self._exclusive():
            return [w for w, st in self._states.items() if st.active]

    @property
    def in_flight(self) -> int:
        """Requests in flight over all workers (removed ones still counting down included)."""
        with self._exclusive():
            return self._total

    @property
    def prefer_newest_version(self) -> bool:
        return self._prefer_newest

    @property
    def max_in_flight(self) -> int | None:
        return self._cap

    def loads(self) -> dict[W, int]:
        """Requests in flight per worker, as one consistent snapshot."""
        with self._exclusive():
            return {w: st.load for w, st in self._states.items()}

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
        n = len(self.workers)
        return f"{type(self).__name__}(workers={n}, in_flight={self.in_flight})"

    # ------------------------------------------------------------------ waiting
    def _wake(self) -> None:
        if self._waiters:
            with self._cond:
                self._cond.notify_all()

    def wait_drained(self, worker: W, timeout: float) -> None:
        """Block until `worker` has no request in flight (rolling updates: drain, wait, swap).

        Raises `DrainTimeoutError` if requests are still in flight after `timeout` seconds.
        """
        st = self._states.get(worker)
        if st is None:
            raise UnknownWorkerError(f"wait_drained({worker!r}): worker is not known to this router")
        if timeout is None:
            raise ValueError("wait_drained needs a timeout: every blocking call has a deadline")
        deadline = _deadline(timeout)
        assert deadline is not None
        if st.load == 0:
            return
        with self._cond:
            self._waiters += 1
            try:
                while st.load > 0:  # an int read is atomic; every release wakes us while we wait
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise DrainTimeoutError(
                            f"wait_drained({worker!r}): {st.load} request(s) still in flight after {timeout}s"
                        )
                    self._cond.wait(remaining)
            finally:
                self._waiters -= 1

    def _why_none(self) -> str:
        with self._exclusive():
            active = [st for st in self._states.values() if st.active]
            if not active:
                return "the router has no workers"
            draining = sum(1 for st in active if st.draining)
            parts = [f"{len(active)} worker(s)", f"{draining} draining"]
            if self._cap is not None:
                full = sum(1 for st in active if not st.draining and st.load >= self._cap)
                parts.append(f"{full} at max_in_flight={self._cap}")
            if self._prefer_newest and self._best is not None:
                parts.append(f"newest version {self._best}")
            return ", ".join(parts)
