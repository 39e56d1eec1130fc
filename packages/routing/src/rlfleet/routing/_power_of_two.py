"""Power-of-two-choices routing."""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable

from rlfleet.routing._base import Router, W, _Worker
from rlfleet.routing._index import Pool, least_loaded


class PowerOfTwoRouter(Router[W]):
    """Sample two distinct candidates at random, send the request to the less loaded one.

    Near least-load balance at O(1) per decision with no shared ordering structure. The RNG is
    seeded (`seed`) so runs are reproducible. Keys are ignored.
    """

    def __init__(
        self,
        workers: Iterable[W] = (),
        *,
        seed: int | None = 0,
        prefer_newest_version: bool = True,
        max_in_flight: int | None = None,
    ) -> None:
        self._pool: Pool[W] = Pool()
        self._rng = random.Random(seed)
        super().__init__(workers, prefer_newest_version=prefer_newest_version, max_in_flight=max_in_flight)

    def _pick(self, key: Hashable | None) -> _Worker[W] | None:
        best = self._best
        if best is None:
            return None
        lst = self._pool.lists[best]
        n = len(lst)
        if n == 1:
            st = lst[0]
        else:
            rand = self._rng.randrange
            i = rand(n)
            j = rand(n - 1)
            if j >= i:
                j += 1
            a, b = lst[i], lst[j]
            st = a if (a.load, a.index) <= (b.load, b.index) else b
        cap = self._cap
        if cap is not None and st.load >= cap:
            found = least_loaded(lst, cap)  # both samples full: look at everyone
            if found is None:
                return None
            st = found
        st.load += 1
        return st

    def _index_add(self, st: _Worker[W]) -> None:
        self._pool.add(st)

    def _index_remove(self, st: _Worker[W]) -> None:
        self._pool.remove(st)
