"""Consistent hashing with bounded loads: sticky sessions that still balance."""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Callable, Hashable, Iterable

from rlfleet.routing._base import Router, W, _Worker
from rlfleet.routing._index import Pool, least_loaded


def stable_hash(data: str) -> int:
    """64-bit hash that is the same in every process (Python's `hash()` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8"), digest_size=8).digest(), "big")


# Session / env ids repeat request after request: remember their ring positions.
_key_hash = functools.lru_cache(maxsize=1 << 16)(stable_hash)


class ConsistentHashRouter(Router[W]):
    """Sticky routing by key (session / env id) on a hash ring with virtual nodes.

    A key goes to the first worker clockwise from its hash, so the same key keeps landing on
    the same worker (its KV cache, its environment state) and when a worker leaves only the
    keys it owned move. Bounded load (Mirrokni et al.): a worker already holding
    `ceil(load_factor * (in_flight + 1) / candidates)` requests is skipped for the next one on
    the ring, so a hot key cannot pile everything onto one worker. Draining, old-version and
    full workers are skipped the same way. A request without a key goes to the least-loaded
    candidate.

    Keys are hashed as `str(key)`, workers as `worker_id(worker)` (default `str`) with
    blake2b, so the ring is the same in every process given the same worker ids.
    """

    def __init__(
        self,
        workers: Iterable[W] = (),
        *,
        vnodes: int = 100,
        load_factor: float = 1.25,
        worker_id: Callable[[W], str] = str,
        prefer_newest_version: bool = True,
        max_in_flight: int | None = None,
    ) -> None:
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or vnodes < 1:
            raise ValueError(f"vnodes must be a positive int, got {vnodes!r}")
        if not (load_factor >= 1.0 and math.isfinite(load_factor)):
            raise ValueError(f"load_factor must be a finite number >= 1, got {load_factor!r}")
        self._vnodes = vnodes
        self._c = float(load_factor)
        self._worker_id = worker_id
        self._pool: Pool[W] = Pool()
        self._ring: list[tuple[int, int, _Worker[W]]] = []  # (hash, worker index, worker)
        self._ring_hashes: list[int] = []
        self._ring_workers: list[_Worker[W]] = []
        self._dirty = False
        super().__init__(workers, prefer_newest_version=prefer_newest_version, max_in_flight=max_in_flight)

    @property
    def load_factor(self) -> float:
        return self._c

    def _member_add(self, st: _Worker[W]) -> None:
        wid = self._worker_id(st.key)
        self._ring.extend((stable_hash(f"{wid}#{v}"), st.index, st) for v in range(self._vnodes))
        self._dirty = True

    def _member_remove(self, st: _Worker[W]) -> None:
        self._ring = [e for e in self._ring if e[2] is not st]  # stays sorted
        self._dirty = True

    def _rebuild(self) -> None:
        self._ring.sort(key=lambda e: (e[0], e[1]))  # mostly sorted: timsort merges the new run
        self._ring_hashes = [e[0] for e in self._ring]
        self._ring_workers = [e[2] for e in self._ring]
        self._dirty = False

    def _index_add(self, st: _Worker[W]) -> None:
        self._pool.add(st)

    def _index_remove(self, st: _Worker[W]) -> None:
        self._pool.remove(st)

    def bound(self, extra: int = 1) -> int:
        """Most requests one candidate may hold after `extra` more are placed (bounded load)."""
        with self._lock:
            return self._bound(extra)

    def _bound(self, extra: int) -> int:
        n = len(self._pool.lists[self._best]) if self._best is not None else 0
        if n == 0:
            return 0
        return math.ceil(self._c * (self._total + extra) / n)

    def _pick(self, key: Hashable | None) -> _Worker[W] | None:
        best = self._best
        if best is None:
            return None
        cap = self._cap
        st = least_loaded(self._pool.lists[best], cap) if key is None else self._walk(key, best, cap)
        if st is not None:
            st.load += 1
        return st

    def _walk(self, key: Hashable, best: int, cap: int | None) -> _Worker[W] | None:
        if self._dirty:
            self._rebuild()
        limit = self._bound(1)
        if cap is not None and cap < limit:
            limit = cap
        ring = self._ring_workers
        n = len(ring)
        start = bisect.bisect_left(self._ring_hashes, _key_hash(str(key)))
        for step in range(n):
            st = ring[(start + step) % n]
            if st.selectable and st.group == best and st.load < limit:
                return st
        return None

    def owner(self, key: Hashable) -> W | None:
        """The worker `key` maps to ignoring loads (its home on the ring), without selecting it."""
        with self._lock:
            best = self._best
            if best is None:
                return None
            if self._dirty:
                self._rebuild()
            ring = self._ring_workers
            n = len(ring)
            start = bisect.bisect_left(self._ring_hashes, _key_hash(str(key)))
            for step in range(n):
                st = ring[(start + step) % n]
                if st.selectable and st.group == best:
                    return st.key
            return None
