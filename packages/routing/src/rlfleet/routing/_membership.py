"""Who a router may route to: workers joining and leaving, draining, the weight version each
serves and how far behind the latest committed version it may be (`max_staleness`).

A worker is *selectable* (in the router's candidate index) while it is active, not draining and
not stale. Every change here happens under the router's exclusive lock(s) and ends with the
version groups refreshed and the waiters woken, so a waiting `select` sees it.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Hashable
from contextlib import AbstractContextManager
from typing import Any

from rlfleet.routing._draining import Draining
from rlfleet.routing._errors import DuplicateWorkerError, UnknownWorkerError
from rlfleet.routing._versions import VersionGroups
from rlfleet.routing._worker import VersionPreference, W, WorkerState, check_version


class Membership(Draining[W]):
    """Workers, draining, versions and staleness: the part of a router a rolling update drives."""

    _lock: threading.Lock
    _groups: VersionGroups
    _prefer: VersionPreference
    _cap: int | None
    _staleness: int | None  # most versions a selectable worker may be behind `_latest` (None: any)
    _latest: int | None  # the latest committed version (None: no version known yet)
    _next_index: int

    # ------------------------------------------------------------------ subclass hooks
    @abc.abstractmethod
    def _index_add(self, st: WorkerState[W]) -> None:
        """`st` became selectable (its `group` is set)."""

    @abc.abstractmethod
    def _index_remove(self, st: WorkerState[W]) -> None:
        """`st` stops being selectable (`group` still holds the old value)."""

    def _member_add(self, st: WorkerState[W]) -> None:
        """`st` joined the router (draining or not)."""

    def _member_remove(self, st: WorkerState[W]) -> None:
        """`st` left the router."""

    def _version_changed(self, st: WorkerState[W]) -> None:
        """`st` serves a new weight version."""

    def _exclusive(self) -> AbstractContextManager[Any]:
        """Lock(s) that freeze every worker's state: structural changes and snapshots."""
        return self._lock

    # ------------------------------------------------------------------ selectability
    def _get(self, worker: W, what: str) -> WorkerState[W]:
        st = self._states.get(worker)
        if st is None or not st.active:
            raise UnknownWorkerError(f"{what}({worker!r}): worker is not known to this router")
        return st

    def _make_selectable(self, st: WorkerState[W]) -> None:
        st.group = self._groups.join(st.version)
        st.selectable = True
        self._index_add(st)

    def _make_unselectable(self, st: WorkerState[W]) -> None:
        self._index_remove(st)
        st.selectable = False
        self._groups.leave(st.group)

    def _settle(self, st: WorkerState[W]) -> None:
        """Bring `st` in or out of the index after its state changed (groups refreshed by the caller)."""
        want = st.active and not st.draining and not st.stale
        if want and not st.selectable:
            self._make_selectable(st)
        elif st.selectable and not want:
            self._make_unselectable(st)

    def _is_stale(self, version: int) -> bool:
        latest, bound = self._latest, self._staleness
        return bound is not None and latest is not None and latest - version > bound

    def _raise_latest(self, version: int) -> None:
        """`version` was committed: if it is newer than the latest, every worker's staleness moves."""
        if self._latest is not None and version <= self._latest:
            return
        self._latest = version
        if self._staleness is None:
            return
        for st in self._states.values():
            if st.active:
                st.stale = self._is_stale(st.version)
                self._settle(st)

    # ------------------------------------------------------------------ membership
    def add_worker(self, worker: W, *, node: Any = None, version: int = 0) -> None:
        """Add a worker (selectable at once unless stale) on `node` at weight `version`."""
        version = check_version(version)
        with self._exclusive():
            old = self._states.get(worker)
            if old is not None:
                raise DuplicateWorkerError(
                    f"add_worker({worker!r}): worker is already in this router"
                    if old.active
                    else f"add_worker({worker!r}): worker was removed but still has {old.load} "
                    "request(s) in flight; release them (wait_drained) before adding it again"
                )
            st = WorkerState(worker, self._next_index, node, version)
            self._next_index += 1
            self._member_add(st)
            self._states[worker] = st
            self._raise_latest(version)
            st.stale = self._is_stale(version)
            self._settle(st)
            self._groups.refresh()
        self._wait.wake()

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
            self._groups.refresh()
        self._wait.wake()  # the newest version may have gone: older workers may be candidates now

    def set_draining(self, worker: W, flag: bool = True) -> None:
        """A draining worker is never selected; releases on it still count down."""
        self._set_draining(worker, flag)

    def _set_draining(self, worker: W, flag: bool) -> bool:
        with self._exclusive():
            st = self._get(worker, "set_draining")
            was = st.draining
            st.draining = bool(flag)
            if was != st.draining:
                self._settle(st)
                self._groups.refresh()
        self._wait.wake()
        return was

    def set_version(self, worker: W, version: int) -> None:
        """Record the weight version `worker` now serves (a newer one than any also becomes the
        latest committed version: see `set_latest_version`)."""
        version = check_version(version)
        with self._exclusive():
            st = self._get(worker, "set_version")
            if st.version != version:
                if st.selectable:
                    self._make_unselectable(st)  # leaves its old version's group
                st.version = version
                self._version_changed(st)
                self._raise_latest(version)
                st.stale = self._is_stale(version)
                self._settle(st)
                self._groups.refresh()
        self._wait.wake()

    def set_latest_version(self, version: int) -> None:
        """Announce that `version` is committed (the trainer's newest), before any worker serves it.

        With `max_staleness=k` no request goes to a worker more than `k` versions behind it from
        now on. The latest version never goes down: an older announcement arriving late changes
        nothing. Setting a worker's version above it (`set_version`) announces that one too.
        """
        version = check_version(version)
        with self._exclusive():
            self._raise_latest(version)
            self._groups.refresh()
        self._wait.wake()

    # ------------------------------------------------------------------ inspection
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

    @property
    def workers(self) -> list[W]:
        """Workers routed to (draining and stale ones included), in insertion order."""
        with self._exclusive():
            return [w for w, st in self._states.items() if st.active]

    @property
    def latest_version(self) -> int | None:
        """The latest committed version: the newest announced or served (None: none yet)."""
        return self._latest

    @property
    def max_staleness(self) -> int | None:
        return self._staleness

    def _why_none(self) -> str:
        with self._exclusive():
            active = [st for st in self._states.values() if st.active]
            if not active:
                return "the router has no workers"
            draining = sum(1 for st in active if st.draining)
            parts = [f"{len(active)} worker(s)", f"{draining} draining"]
            stale = sum(1 for st in active if st.stale and not st.draining)
            if stale:
                parts.append(
                    f"{stale} stale (more than max_staleness={self._staleness} version(s) behind "
                    f"the latest version {self._latest})"
                )
            if self._cap is not None:
                full = sum(1 for st in active if st.selectable and st.load >= self._cap)
                parts.append(f"{full} at max_in_flight={self._cap}")
            if self._prefer and self._groups.order:
                parts.append(f"versions {', '.join(map(str, self._groups.order))}")
            return ", ".join(parts)
