"""Consistent hashing with bounded loads: sticky sessions that still balance."""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from typing_extensions import Unpack

from rlfleet.routing._index import PoolRouter, least_loaded
from rlfleet.routing._public import public
from rlfleet.routing._worker import RouterOptions, W, WorkerState, next_ticket, public_router


@public
def stable_hash(data: str) -> int:
    """64-bit hash that is the same in every process (Python's `hash()` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8"), digest_size=8).digest(), "big")


# Session / env ids repeat request after request: remember their ring positions.
_key_hash = functools.lru_cache(maxsize=1 << 16)(stable_hash)


@public_router
class ConsistentHashRouter(PoolRouter[W]):
    """Sticky routing by key (session / env id) on a hash ring with virtual nodes.

    A key goes to the first worker clockwise from its hash, so the same key keeps landing on
    the same worker (its KV cache, its environment state) and when a worker leaves only the
    keys it owned move. Bounded load (Mirrokni et al.): a worker already holding
    `ceil(load_factor * (in_flight + 1) / candidates)` requests is skipped for the next one on
    the ring, so a hot key cannot pile everything onto one worker. Draining and full workers
    are skipped the same way; with `prefer_newest_version=True` a key keeps its worker whatever
    version it serves (see `Router`). A request without a key goes to the least-loaded
    candidate.

    Keys are hashed as `str(key)`, workers as `worker_id(worker)` (default `str`) with
    blake2b, so the ring is the same in every process given the same worker ids.

    Options of this router (keywords):
    - vnodes=100: points per worker on the ring (more: smoother shares, a slower ring rebuild).
    - worker_id=str: a worker's name on the ring; give the same ids in every process.
    """

    _sticky = True

    def __init__(
        self,
        workers: Iterable[W] = (),
        *,
        vnodes: int = 100,
        worker_id: Callable[[W], str] = str,
        **options: Unpack[RouterOptions],
    ) -> None:
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or vnodes < 1:
            raise ValueError(f"vnodes must be a positive int, got {vnodes!r}")
        self._vnodes = vnodes
        self._worker_id = worker_id
        self._ring: list[tuple[int, int, WorkerState[W]]] = []  # (hash, worker index, worker)
        self._ring_hashes: list[int] = []
        self._ring_workers: list[WorkerState[W]] = []
        self._dirty = False
        super().__init__(workers, **options)

    def _member_add(self, st: WorkerState[W]) -> None:
        wid = self._worker_id(st.key)
        self._ring.extend((stable_hash(f"{wid}#{v}"), st.index, st) for v in range(self._vnodes))
        self._dirty = True

    def _member_remove(self, st: WorkerState[W]) -> None:
        self._ring = [e for e in self._ring if e[2] is not st]  # stays sorted
        self._dirty = True

    def _rebuild(self) -> None:
        self._ring.sort(key=lambda e: (e[0], e[1]))  # mostly sorted: timsort merges the new run
        self._ring_hashes = [e[0] for e in self._ring]
        self._ring_workers = [e[2] for e in self._ring]
        self._dirty = False

    def _pick_in(self, key: Any, group: int | None, limit: int | None) -> WorkerState[W] | None:
        if key is None:
            st = least_loaded(self._members(group), limit)
        else:
            bound = self._bound(group)
            st = self._walk(key, group, bound if limit is None or bound < limit else limit)
        if st is not None:
            st.load += 1
            st.picked = next_ticket()
        return st

    def _walk(self, key: Any, group: int | None, limit: int | None) -> WorkerState[W] | None:
        """First worker of `group` (None: any recent one) clockwise from `key` under `limit`."""
        if self._dirty:
            self._rebuild()
        ring = self._ring_workers
        n = len(ring)
        start = bisect.bisect_left(self._ring_hashes, _key_hash(str(key)))
        floor = self._groups.floor
        for step in range(n):
            st = ring[(start + step) % n]
            if (
                st.selectable
                and (st.group >= floor if group is None else st.group == group)
                and (limit is None or st.load < limit)
            ):
                return st
        return None

    def owner(self, key: Any) -> W | None:
        """The worker `key` maps to ignoring loads (its home on the ring), without selecting it."""
        with self._lock:
            order = self._groups.order
            if not order:
                return None
            group = order[0] if self._prefer == "strict" else None
            st = self._walk(key, group, None)
            return None if st is None else st.key
