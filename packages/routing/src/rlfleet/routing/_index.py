"""Candidate indexes shared by the routers. Not thread-safe: callers hold the right lock."""

from __future__ import annotations

import bisect
from heapq import heapify, heappop, heappush, heapreplace
from typing import Generic

from rlfleet.routing._base import W, _Worker

# Stale heap entries allowed beyond twice the live ones before a rebuild (amortised O(1)).
_SLACK = 32


class LoadHeap(Generic[W]):
    """Least-loaded worker per candidate group in O(log n): a heap with lazy invalidation.

    Entries are `(load, index)`; an entry is live when its worker is a member of the group and
    its load still equals the entry's. Every member always has one live entry (pushed when it
    joins, replaced on select, pushed again on release), so the first live entry on top of the
    heap is the true minimum, ties broken by lowest index exactly as the seed's heap does.
    """

    __slots__ = ("heaps", "members")

    def __init__(self) -> None:
        self.heaps: dict[int, list[tuple[int, int]]] = {}
        self.members: dict[int, dict[int, _Worker[W]]] = {}

    def add(self, st: _Worker[W]) -> None:
        g = st.group
        members = self.members.get(g)
        if members is None:
            members = self.members[g] = {}
            self.heaps[g] = []
        members[st.index] = st
        heappush(self.heaps[g], (st.load, st.index))

    def remove(self, st: _Worker[W]) -> None:
        g = st.group
        members = self.members[g]
        del members[st.index]
        if not members:
            del self.members[g]
            del self.heaps[g]

    def pop_min(self, group: int, cap: int | None) -> _Worker[W] | None:
        """Charge one request to the least-loaded member of `group` (None: none under `cap`)."""
        heap = self.heaps.get(group)
        if heap is None:
            return None
        members = self.members[group]
        while heap:
            load, idx = heap[0]
            st = members.get(idx)
            if st is not None and st.load == load:
                if cap is not None and load >= cap:
                    return None
                st.load = load + 1
                heapreplace(heap, (load + 1, idx))
                return st
            heappop(heap)
        return None  # unreachable while the invariant holds

    def peek_min(self, group: int) -> tuple[int, int] | None:
        """`(load, index)` of the least-loaded member of `group`, without charging it."""
        heap = self.heaps.get(group)
        if heap is None:
            return None
        members = self.members[group]
        while heap:
            load, idx = heap[0]
            st = members.get(idx)
            if st is not None and st.load == load:
                return load, idx
            heappop(heap)
        return None

    def released(self, st: _Worker[W]) -> None:
        """`st.load` went down by one: give it a live entry at the new load."""
        heap = self.heaps[st.group]
        heappush(heap, (st.load, st.index))
        if len(heap) > 2 * len(self.members[st.group]) + _SLACK:
            self.compact(st.group)

    def limit(self, group: int) -> int:
        """Heap length above which `group`'s heap is rebuilt without stale entries."""
        return 2 * len(self.members[group]) + _SLACK

    def compact(self, group: int) -> None:
        heap = self.heaps[group]
        heap[:] = [(m.load, i) for i, m in self.members[group].items()]
        heapify(heap)


def _index_of(st: _Worker[W]) -> int:
    return st.index


class Pool(Generic[W]):
    """Selectable workers per candidate group, each list in insertion order."""

    __slots__ = ("lists",)

    def __init__(self) -> None:
        self.lists: dict[int, list[_Worker[W]]] = {}

    def add(self, st: _Worker[W]) -> None:
        lst = self.lists.setdefault(st.group, [])
        bisect.insort(lst, st, key=_index_of)

    def remove(self, st: _Worker[W]) -> None:
        lst = self.lists[st.group]
        del lst[bisect.bisect_left(lst, st.index, key=_index_of)]
        if not lst:
            del self.lists[st.group]


def least_loaded(candidates: list[_Worker[W]], cap: int | None) -> _Worker[W] | None:
    """Linear scan: lowest load, then lowest index; None if every candidate is at `cap`."""
    best: _Worker[W] | None = None
    for st in candidates:
        if (cap is None or st.load < cap) and (
            best is None or st.load < best.load or (st.load == best.load and st.index < best.index)
        ):
            best = st
    return best
