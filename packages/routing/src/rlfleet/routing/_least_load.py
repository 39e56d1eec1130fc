"""Least-load routing, and the seed's batch heap assignment."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Sequence
from heapq import heappop, heappush, heapreplace
from typing import SupportsInt

from rlfleet.routing._base import Router, W, _Worker
from rlfleet.routing._errors import NoWorkerAvailableError
from rlfleet.routing._index import LoadHeap


def least_load_assign(current_loads: Sequence[SupportsInt], num_tasks: int) -> list[int]:
    """Indices of the workers `num_tasks` requests go to, given each worker's load.

    Exactly the seed's async router: a heap of `(load, index)`, pop the minimum, assign,
    push `(load + 1, index)`; ties go to the lowest index.
    """
    if isinstance(num_tasks, bool) or not isinstance(num_tasks, int):
        raise TypeError(f"num_tasks must be an int, got {num_tasks!r}")
    if num_tasks < 0:
        raise ValueError(f"num_tasks must be >= 0, got {num_tasks}")
    heap = [(int(load), i) for i, load in enumerate(current_loads)]
    if not heap:
        if num_tasks == 0:
            return []
        raise NoWorkerAvailableError(f"cannot assign {num_tasks} task(s): current_loads is empty")
    heapq.heapify(heap)
    out: list[int] = []
    append = out.append
    for _ in range(num_tasks):
        load, idx = heap[0]
        append(idx)
        heapq.heapreplace(heap, (load + 1, idx))  # same result as heappop then heappush
    return out


class LeastLoadRouter(Router[W]):
    """Send each request to the worker with the fewest requests in flight.

    Counts are kept locally (no per-batch RPC to every worker as the seed does); a decision
    costs O(log n). Ties go to the worker added first, like the seed's heap. Keys are ignored.
    """

    def __init__(
        self,
        workers: Iterable[W] = (),
        *,
        prefer_newest_version: bool = True,
        max_in_flight: int | None = None,
    ) -> None:
        self._heap: LoadHeap[W] = LoadHeap()
        super().__init__(workers, prefer_newest_version=prefer_newest_version, max_in_flight=max_in_flight)

    def _pick(self, key: Hashable | None) -> _Worker[W] | None:
        best = self._best
        if best is None:
            return None
        return self._heap.pop_min(best, self._cap)

    def _index_add(self, st: _Worker[W]) -> None:
        self._heap.add(st)

    def _index_remove(self, st: _Worker[W]) -> None:
        self._heap.remove(st)

    def _on_release(self, st: _Worker[W]) -> None:
        self._heap.released(st)

    # The hot path, inlined (LoadHeap.pop_min / LoadHeap.released): one lock round-trip and
    # one heap operation per call; acquire/release is cheaper than `with` on CPython.
    def select(self, key: Hashable | None = None, *, timeout: float | None = None) -> W:
        lock = self._lock
        lock.acquire()
        try:
            best = self._best
            if best is not None:
                heap = self._heap.heaps[best]
                members = self._heap.members[best]
                cap = self._cap
                while heap:
                    load, idx = heap[0]
                    st = members.get(idx)
                    if st is not None and st.load == load:
                        if cap is not None and load >= cap:
                            break
                        st.load = load + 1
                        heapreplace(heap, (load + 1, idx))
                        self._total += 1
                        return st.key
                    heappop(heap)  # stale entry
        finally:
            lock.release()
        return super().select(key, timeout=timeout)

    def assign(self, keys: Iterable[Hashable | None] | int, *, timeout: float | None = None) -> list[W]:
        # One lock round-trip for the whole batch when every request fits right away.
        batch: list[Hashable | None] | int
        if isinstance(keys, int):
            batch = count = keys
        else:
            batch = list(keys)
            count = len(batch)
        if count > 0 and not isinstance(keys, bool):
            with self._lock:
                best = self._best
                if best is not None:
                    pop_min = self._heap.pop_min
                    cap = self._cap
                    picked: list[_Worker[W]] = []
                    for _ in range(count):
                        st = pop_min(best, cap)
                        if st is None:
                            break
                        picked.append(st)
                    if len(picked) == count:
                        self._total += count
                        return [st.key for st in picked]
                    released = self._heap.released
                    for st in picked:  # undo, then take the general path (waits, errors)
                        st.load -= 1
                        released(st)
        return super().assign(batch, timeout=timeout)

    def release(self, worker: W) -> None:
        lock = self._lock
        lock.acquire()
        try:
            fast = False
            st = self._states.get(worker)
            if st is not None and st.load > 0 and st.selectable:
                fast = True
                st.load = load = st.load - 1
                self._total -= 1
                heap = self._heap.heaps[st.group]
                heappush(heap, (load, st.index))
                if len(heap) > self._heap.limit(st.group):
                    self._heap.compact(st.group)
        finally:
            lock.release()
        if not fast:
            super().release(worker)  # errors, draining and removed workers
        elif self._waiters:
            self._wake()
