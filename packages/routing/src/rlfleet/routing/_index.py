"""Candidate indexes shared by the routers. Not thread-safe: callers hold the right lock.

Ties between equally loaded workers rotate: a heap entry carries a ticket from one shared
counter, so among equal loads the worker whose load changed longest ago goes
first; the linear scan compares `picked` stamps the same way. No worker is favoured for
having been added first.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from heapq import heapify, heappop, heappush, heapreplace
from typing import Generic

from typing_extensions import Unpack

from rlfleet.routing._base import Router
from rlfleet.routing._worker import RouterOptions, W, WorkerState, next_ticket

# Stale heap entries allowed beyond twice the live ones before a rebuild (amortised O(1)).
_SLACK = 32


class LoadHeap(Generic[W]):
    """Least-loaded worker per candidate group in O(log n): a heap with lazy invalidation.

    Entries are `(load, ticket, worker)`; an entry is live when it is its worker's latest
    (`worker.ticket == ticket`). Every member always has one live entry (pushed when it joins,
    replaced when charged, pushed again when its load goes down), at most as loaded as its
    worker, so the first live entry on top of the heap, pushed again if its load is out of
    date, is the true minimum. Leaving the group voids the worker's ticket.
    """

    __slots__ = ("heaps", "members")

    def __init__(self) -> None:
        self.heaps: dict[int, list[tuple[int, int, WorkerState[W]]]] = {}
        self.members: dict[int, set[WorkerState[W]]] = {}

    def add(self, st: WorkerState[W]) -> None:
        members = self.members.get(st.group)
        if members is None:
            members = self.members[st.group] = set()
            self.heaps[st.group] = []
        members.add(st)
        self.reindex(st)

    def remove(self, st: WorkerState[W]) -> None:
        members = self.members[st.group]
        members.discard(st)
        st.ticket = -1
        if not members:
            del self.members[st.group]
            del self.heaps[st.group]

    def reindex(self, st: WorkerState[W]) -> None:
        """`st.load` changed (or `st` joined): give it a live entry at its load."""
        heap = self.heaps[st.group]
        st.ticket = ticket = next_ticket()
        heappush(heap, (st.load, ticket, st))
        if len(heap) > 2 * len(self.members[st.group]) + _SLACK:
            self.compact(st.group)

    def pop_min(self, group: int | None, limit: int | None) -> WorkerState[W] | None:
        """Charge one request to the least-loaded member of `group` (None: none under `limit`)."""
        heap = None if group is None else self.heaps.get(group)
        while heap:  # `_live_top` and the charge, inlined: every heap router's hot path
            load, ticket, st = heap[0]
            if st.ticket != ticket:
                heappop(heap)  # stale entry
                continue
            if st.load != load:  # charged outside the heap: push it again at its true load
                st.ticket = ticket = next_ticket()
                heapreplace(heap, (st.load, ticket, st))
                continue
            if limit is not None and load >= limit:
                return None
            st.load = load + 1
            st.ticket = ticket = next_ticket()
            heapreplace(heap, (load + 1, ticket, st))
            return st
        return None

    def pop_many(self, group: int | None, limit: int | None, count: int) -> list[WorkerState[W]]:
        """Charge `count` requests one by one to the least-loaded members of `group`; stops early
        (a shorter list) when every member is at `limit`."""
        out: list[WorkerState[W]] = []
        pop, keep = self.pop_min, out.append
        for _ in range(count):
            st = pop(group, limit)
            if st is None:
                break
            keep(st)
        return out

    def peek_min(self, group: int) -> tuple[int, int] | None:
        """`(load, ticket)` of the least-loaded member of `group`, without charging it."""
        heap = self.heaps.get(group)
        top = None if heap is None else _live_top(heap)
        return None if top is None else (top[0], top[1])

    def compact(self, group: int) -> None:
        heap = self.heaps[group]
        heap[:] = [(m.load, m.ticket, m) for m in self.members[group]]
        heapify(heap)


def _live_top(heap: list[tuple[int, int, WorkerState[W]]]) -> tuple[int, int, WorkerState[W]] | None:
    """The heap's first live entry, dropping stale ones above it.

    An entry may be live with a load below its worker's (a router charged the worker without
    going through the heap, as PrefixAwareRouter does for a cache hit): it is pushed again at
    the true load. Loads only go down through `reindex`, so no entry sits below where it belongs.
    """
    while heap:
        top = heap[0]
        st = top[2]
        if st.ticket == top[1]:
            if st.load == top[0]:
                return top
            st.ticket = ticket = next_ticket()
            heapreplace(heap, (st.load, ticket, st))
        else:
            heappop(heap)
    return None  # only for an empty group


def _index_of(st: WorkerState[W]) -> int:
    return st.index


class Pool(Generic[W]):
    """Selectable workers per candidate group, each list in insertion order."""

    __slots__ = ("lists",)

    def __init__(self) -> None:
        self.lists: dict[int, list[WorkerState[W]]] = {}

    def add(self, st: WorkerState[W]) -> None:
        lst = self.lists.setdefault(st.group, [])
        bisect.insort(lst, st, key=_index_of)

    def remove(self, st: WorkerState[W]) -> None:
        lst = self.lists[st.group]
        del lst[bisect.bisect_left(lst, st.index, key=_index_of)]
        if not lst:
            del self.lists[st.group]


def least_loaded(candidates: list[WorkerState[W]], limit: int | None) -> WorkerState[W] | None:
    """Linear scan: lowest load, then picked longest ago; None if every one is at `limit`."""
    best: WorkerState[W] | None = None
    for st in candidates:
        if (limit is None or st.load < limit) and (
            best is None or st.load < best.load or (st.load == best.load and st.picked < best.picked)
        ):
            best = st
    return best


class HeapRouter(Router[W]):
    """A router whose candidates live in one `LoadHeap` (least-load first)."""

    def __init__(self, workers: Iterable[W] = (), **options: Unpack[RouterOptions]) -> None:
        self._heap: LoadHeap[W] = LoadHeap()
        super().__init__(workers, **options)

    def _index_add(self, st: WorkerState[W]) -> None:
        self._heap.add(st)

    def _index_remove(self, st: WorkerState[W]) -> None:
        self._heap.remove(st)

    def _on_release(self, st: WorkerState[W]) -> None:
        self._heap.reindex(st)


class PoolRouter(Router[W]):
    """A router whose candidates live in a `Pool` (lists in insertion order)."""

    def __init__(self, workers: Iterable[W] = (), **options: Unpack[RouterOptions]) -> None:
        self._pool: Pool[W] = Pool()
        super().__init__(workers, **options)

    def _index_add(self, st: WorkerState[W]) -> None:
        self._pool.add(st)

    def _index_remove(self, st: WorkerState[W]) -> None:
        self._pool.remove(st)

    def _members(self, group: int | None) -> list[WorkerState[W]]:
        """The selectable workers of `group` in insertion order (none for None: not sticky)."""
        return [] if group is None else self._pool.lists.get(group, [])
