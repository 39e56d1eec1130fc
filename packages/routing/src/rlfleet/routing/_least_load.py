"""Least-load routing, and the seed's batch heap assignment."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Sequence
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

    # The hot path, inlined: one lock round-trip and one heap operation per call.
    def select(self, key: Hashable | None = None, *, timeout: float | None = None) -> W:
        with self._lock:
            best = self._best
            if best is not None:
                st = self._heap.pop_min(best, self._cap)
                if st is not None:
                    self._total += 1
                    return st.key
        return super().select(key, timeout=timeout)

    def release(self, worker: W) -> None:
        with self._lock:
            st = self._states.get(worker)
            if st is not None and st.load > 0 and st.selectable:
                st.load -= 1
                self._total -= 1
                self._heap.released(st)
                fast = True
            else:
                fast = False
        if not fast:
            super().release(worker)  # errors, draining and removed workers
        elif self._waiters:
            self._wake()
