"""Round-robin routing over the candidate workers."""

from __future__ import annotations

from typing import Any

from rlfleet.routing._index import PoolRouter
from rlfleet.routing._worker import W, WorkerState, public_router


@public_router
class RoundRobinRouter(PoolRouter[W]):
    """Hand requests to the candidate workers in turn (insertion order). Keys are ignored.

    Load-blind like the seed's per-node round-robin; workers at `max_in_flight` are skipped.

    This router has no options of its own.
    """

    _cursor = 0  # the next turn (an instance attribute once a request was placed)

    def _pick_in(self, key: Any, group: int | None, limit: int | None) -> WorkerState[W] | None:
        lst = self._members(group)
        n = len(lst)
        if not n:
            return None
        start = self._cursor % n
        for step in range(n):
            st = lst[(start + step) % n]
            if limit is None or st.load < limit:
                self._cursor = start + step + 1
                st.load += 1
                return st
        return None
