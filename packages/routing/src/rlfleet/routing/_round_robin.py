"""Round-robin routing over the candidate workers."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from rlfleet.routing._base import Router, W, _Worker
from rlfleet.routing._index import Pool


class RoundRobinRouter(Router[W]):
    """Hand requests to the candidate workers in turn (insertion order). Keys are ignored.

    Load-blind like the seed's per-node round-robin; workers at `max_in_flight` are skipped.
    """

    def __init__(
        self,
        workers: Iterable[W] = (),
        *,
        prefer_newest_version: bool = True,
        max_in_flight: int | None = None,
    ) -> None:
        self._pool: Pool[W] = Pool()
        self._cursor = 0
        super().__init__(workers, prefer_newest_version=prefer_newest_version, max_in_flight=max_in_flight)

    def _pick(self, key: Hashable | None) -> _Worker[W] | None:
        best = self._best
        if best is None:
            return None
        lst = self._pool.lists[best]
        n = len(lst)
        start = self._cursor % n
        cap = self._cap
        for step in range(n):
            st = lst[(start + step) % n]
            if cap is None or st.load < cap:
                self._cursor = start + step + 1
                st.load += 1
                return st
        return None

    def _index_add(self, st: _Worker[W]) -> None:
        self._pool.add(st)

    def _index_remove(self, st: _Worker[W]) -> None:
        self._pool.remove(st)
