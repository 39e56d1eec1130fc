"""Least-load routing, and the seed's batch heap assignment."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any, SupportsInt

from rlfleet.routing._errors import NoWorkerAvailableError
from rlfleet.routing._index import HeapRouter
from rlfleet.routing._public import public
from rlfleet.routing._worker import W, WorkerState, public_router


@public
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


@public_router
class LeastLoadRouter(HeapRouter[W]):
    """Send each request to the worker with the fewest requests in flight.

    Counts are kept locally (no per-batch RPC to every worker as the seed does); a decision
    costs O(log n). Ties rotate: among equally loaded workers the one whose load changed
    longest ago goes first. Keys are ignored.

    This router has no options of its own.
    """

    def _pick_in(self, key: Any, group: int | None, limit: int | None) -> WorkerState[W] | None:
        return self._heap.pop_min(group, limit)  # group None (any): not asked, LeastLoad is not sticky

    def _pick_batch(self, keys: list[Any]) -> list[WorkerState[W]]:
        order = self._groups.order
        if len(order) == 1:  # one version served: the whole batch in one heap walk
            return self._heap.pop_many(order[0], self._cap, len(keys))
        return super()._pick_batch(keys)
