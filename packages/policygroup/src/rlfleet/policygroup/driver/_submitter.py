"""`TaskSubmitter`: at most k tasks in flight per actor, without a lock shared by all actors.

The seed kept one lock for every actor and blocked in `ray.wait` while holding it, so one
saturated actor stalled every submitting thread. Here each actor has its own slot (lock and
pending refs): a thread waits only behind the actor it submits to, and every wait has a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from rlfleet.policygroup._errors import TaskTimeoutError


def actor_of(fn: Any) -> Any | None:
    """The actor handle behind a bound remote method (`handle.method`), or None for a local callable."""
    actor = getattr(fn, "_actor", None)
    if actor is not None and hasattr(fn, "remote"):
        return actor
    return None


def actor_key(actor: Any) -> Any:
    """A hashable identity of an actor handle (its actor id) or of a local object."""
    actor_id = getattr(actor, "_actor_id", None)
    return actor_id if actor_id is not None else id(actor)


def is_remote(policy: Any) -> bool:
    """True for a Ray actor handle, False for a local policy object."""
    return isinstance(policy, ray.actor.ActorHandle)


@dataclass
class _Slot:
    """One actor's lock and the refs of its tasks in flight."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[ray.ObjectRef[Any]] = field(default_factory=list)


class TaskSubmitter:
    """Submit calls to policies (Ray actors or local objects), at most k in flight per actor.

    `submit(policy.method, *args, _block=False, **kwargs)`: for an actor method returns its
    ObjectRef (or, with `_block=True`, its result); a local callable runs at once and its
    result is returned either way (the seed's contract). When the actor already has k tasks
    in flight the call waits for one of them, up to `timeout_s` (`TaskTimeoutError`).
    """

    def __init__(self, max_pending_tasks_each_worker: int = 8, timeout_s: float = 120.0) -> None:
        k = max_pending_tasks_each_worker
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"max_pending_tasks_each_worker must be an int >= 1, got {max_pending_tasks_each_worker!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.max_pending, self.timeout_s = k, float(timeout_s)
        self._slots: dict[Any, _Slot] = {}
        self._slots_lock = threading.Lock()  # only guards the dict, never held while waiting

    def _slot(self, key: Any) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            with self._slots_lock:
                slot = self._slots.setdefault(key, _Slot())
        return slot

    @staticmethod
    def _prune(slot: _Slot) -> None:
        if slot.pending:
            _, slot.pending = ray.wait(
                slot.pending, num_returns=len(slot.pending), timeout=0, fetch_local=False
            )

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        _block: bool = False,
        _timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        actor = actor_of(fn)
        if actor is None:
            return fn(*args, **kwargs)
        timeout = self.timeout_s if _timeout is None else float(_timeout)
        end = time.monotonic() + timeout
        slot = self._slot(actor_key(actor))
        with slot.lock:  # only callers of this actor queue here
            self._prune(slot)
            while len(slot.pending) >= self.max_pending:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise TaskTimeoutError(
                        f"{getattr(fn, '_method_name', fn)!r}: actor {actor_key(actor)} still had "
                        f"{len(slot.pending)} task(s) in flight after {timeout:.1f}s"
                    )
                _, slot.pending = ray.wait(
                    slot.pending, num_returns=1, timeout=min(remaining, 1.0), fetch_local=False
                )
            ref = fn.remote(*args, **kwargs)  # type: ignore[attr-defined]
            slot.pending.append(ref)
        if _block:
            return get(ref, max(0.0, end - time.monotonic()), what=getattr(fn, "_method_name", None))
        return ref

    def pending(self, actor: Any) -> int:
        """Tasks still in flight on `actor` (after pruning finished ones)."""
        slot = self._slots.get(actor_key(actor))
        if slot is None:
            return 0
        with slot.lock:
            self._prune(slot)
            return len(slot.pending)

    def forget(self, actor: Any) -> None:
        """Drop an actor's bookkeeping (it died or left the group)."""
        with self._slots_lock:
            self._slots.pop(actor_key(actor), None)


def get(refs: Any, timeout: float, what: str | None = None) -> Any:
    """`ray.get` with a deadline, raising TaskTimeoutError that names the call."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TaskTimeoutError(f"{what or 'ray.get'} did not finish within {timeout:.1f}s") from None
