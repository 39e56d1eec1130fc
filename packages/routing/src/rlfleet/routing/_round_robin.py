"""Round-robin routing over the candidate workers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from typing_extensions import Unpack

from rlfleet.routing._index import PoolRouter
from rlfleet.routing._worker import RouterOptions, W, _Worker


class RoundRobinRouter(PoolRouter[W]):
    """Hand requests to the candidate workers in turn (insertion order). Keys are ignored.

    Load-blind like the seed's per-node round-robin; workers at `max_in_flight` are skipped.
    """

    def __init__(self, workers: Iterable[W] = (), **options: Unpack[RouterOptions]) -> None:
        self._cursor = 0
        super().__init__(workers, **options)

    def _pick_in(self, key: Any, group: int | None, limit: int | None) -> _Worker[W] | None:
        lst = self._pool.lists.get(group) if group is not None else None
        if not lst:
            return None
        n = len(lst)
        start = self._cursor % n
        for step in range(n):
            st = lst[(start + step) % n]
            if limit is None or st.load < limit:
                self._cursor = start + step + 1
                st.load += 1
                return st
        return None
