"""Power-of-two-choices routing."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from typing_extensions import Unpack

from rlfleet.routing._index import PoolRouter, least_loaded
from rlfleet.routing._worker import RouterOptions, W, WorkerState, next_ticket, public_router


@public_router
class PowerOfTwoRouter(PoolRouter[W]):
    """Sample two distinct candidates at random, send the request to the less loaded one.

    Near least-load balance at O(1) per decision with no shared ordering structure. The RNG is
    seeded (`seed`) so runs are reproducible. Keys are ignored.

    Options of this router (keywords):
    - seed=0: seed of the router's own random.Random (None: from the OS, not reproducible).
    """

    def __init__(
        self, workers: Iterable[W] = (), *, seed: int | None = 0, **options: Unpack[RouterOptions]
    ) -> None:
        self._rng = random.Random(seed)
        super().__init__(workers, **options)

    def _pick_in(self, key: Any, group: int | None, limit: int | None) -> WorkerState[W] | None:
        lst = self._members(group)
        n = len(lst)
        if n <= 1:
            if not n:
                return None
            st = lst[0]
        else:
            rand = self._rng.randrange
            i = rand(n)
            j = rand(n - 1)
            if j >= i:
                j += 1
            a, b = lst[i], lst[j]
            st = a if (a.load, a.picked) <= (b.load, b.picked) else b
        if limit is not None and st.load >= limit:
            found = least_loaded(lst, limit)  # both samples full: look at everyone
            if found is None:
                return None
            st = found
        st.load += 1
        st.picked = next_ticket()
        return st
