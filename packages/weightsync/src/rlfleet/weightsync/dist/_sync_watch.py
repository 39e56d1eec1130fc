"""Sync deadlines a controller can stand down: a watchdog enforces them, not the wire.

A deadline handed to a collective becomes the collective's own timeout, which nothing can
cancel. NeMo RL's ``stand_down_refit_watchdog`` needs the opposite: once a peer is confirmed
dead its sockets close and every wait on it ends by itself, while a deadline firing then only
does harm (it aborts communicators that are otherwise fine). So here a sync's deadline is a
`Watchdog`:

- `SyncWatch.guard(timeout_s, what)` arms one for the sync and yields its `WatchedDeadline`;
- the watched wires (`WatchedWire` for the broadcast protocol, `WatchedP2PWire` for reshard)
  have no clock of their own: a wait ends by data, by a lost peer, or by the watchdog firing
  (which also aborts the NCCL groups it watches), never by the group's timeout, which they
  lift to `WIRE_TIMEOUT_S`;
- `stand_down_armed_watchdogs()` stands the watchdog down and lifts the deadline, so the
  sync's waits end only by data or by peer loss.

A gloo wait cannot be interrupted from another thread (``abort()`` leaves a pending receive
blocked), so each wait that is not already complete runs on a helper thread. When the watchdog
fires the caller returns at once; the helper ends when the peer does, and it holds the group
until then so that the group's destructor (which joins gloo's threads) never blocks anyone.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.weightsync._deadline import Deadline, Watchdog
from rlfleet.weightsync.dist._dist import BroadcastReceiver, BroadcastSender, GroupMember, map_dist_error
from rlfleet.weightsync._errors import SyncTimeoutError
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.dist._member import MemberGroup

__all__ = [
    "WIRE_TIMEOUT_S",
    "SyncWatch",
    "WatchedBroadcastReceiver",
    "WatchedBroadcastSender",
    "WatchedDeadline",
    "WatchedP2PWire",
    "WatchedWire",
]

_log = logging.getLogger(__name__)

#: The group's own timeout while a watchdog guards its syncs: a stood-down wait that neither
#: data nor a lost peer ends still ends after this long.
WIRE_TIMEOUT_S = 24 * 3600.0


class WatchedDeadline(Deadline):
    """A sync's deadline, which its watchdog lifts when it is stood down (then it never expires)."""

    __slots__ = ("_lifted",)

    def __init__(self, seconds: float | None) -> None:
        super().__init__(seconds)
        self._lifted = False

    @property
    def lifted(self) -> bool:
        return self._lifted

    def lift(self) -> None:
        self._lifted = True

    def remaining(self) -> float | None:
        return None if self._lifted else super().remaining()

    @property
    def expired(self) -> bool:
        return not self._lifted and super().expired

    def child(self, seconds: float | None) -> Deadline:
        return Deadline(seconds) if self._lifted else super().child(seconds)

    def leaving(self, seconds: float) -> Deadline:
        return Deadline(None) if self._lifted else super().leaving(seconds)


class _SyncWatchdog(Watchdog):
    """The watchdog of one sync: standing it down also lifts the sync's deadline."""

    def __init__(self, timeout_s: float, deadline: WatchedDeadline, watch: SyncWatch, name: str) -> None:
        super().__init__(timeout_s, watch._fire, name)
        self.deadline = deadline

    def stand_down(self) -> bool:
        stood_down = super().stand_down()
        if stood_down:
            self.deadline.lift()
        return stood_down


def _backend_name(group: Any) -> str:
    try:
        return str(group.name()).lower()
    except Exception:
        return type(group).__name__.lower()


def _device_of(group: Any) -> torch.device:
    if "nccl" in _backend_name(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def lift_group_timeout(group: Any) -> None:
    """Make `WIRE_TIMEOUT_S` the timeout of the group's later collectives (the watchdog is the deadline)."""
    with contextlib.suppress(AttributeError, RuntimeError):
        group.set_timeout(timedelta(seconds=WIRE_TIMEOUT_S))


class SyncWatch:
    """The deadline watchdog of the sync in flight over one transport's groups.

    One sync at a time: `guard` arms a watchdog for it; the wires built with this watch wait
    until data, a lost peer, or that watchdog firing. `fired` / `stood_down` count outcomes.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.fired = 0
        self.stood_down = 0
        self._lock = threading.Lock()
        self._groups: list[weakref.ref[Any]] = []
        self._watchdog: _SyncWatchdog | None = None
        self._in_flight: str | None = None
        self._wakes: set[threading.Event] = set()

    def watch_group(self, group: Any) -> None:
        """Abort `group` (NCCL; gloo has no abort that unblocks a wait) when a watchdog fires.

        Held weakly: a group its owner dropped is destroyed as usual (its sockets close, which
        is how its peers learn that it is gone).
        """
        with self._lock:
            self._groups = [ref for ref in self._groups if ref() is not None and ref() is not group]
            self._groups.append(weakref.ref(group))

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @contextlib.contextmanager
    def guard(self, timeout_s: float | None, what: str) -> Iterator[WatchedDeadline]:
        """Arm a watchdog of `timeout_s` around one sync; yields the deadline it enforces.

        ``None`` or ``math.inf``: no limit and no watchdog (the caller asked for none).
        """
        deadline = WatchedDeadline(timeout_s)
        name = f"{self.name}: {what}"
        watchdog = None if deadline.seconds is None else _SyncWatchdog(deadline.seconds, deadline, self, name)
        with self._lock:
            if self._in_flight is not None:
                raise RuntimeError(f"{self.name}: {what} while {self._in_flight!r} is still in flight")
            self._in_flight, self._watchdog = what, watchdog
        if watchdog is not None:
            watchdog.arm()
        try:
            yield deadline
        finally:
            if watchdog is not None:
                watchdog.disarm()
            with self._lock:
                self._in_flight = self._watchdog = None
                self.fired += watchdog is not None and watchdog.fired
                self.stood_down += watchdog is not None and watchdog.stood_down

    def _fire(self) -> None:
        with self._lock:
            wakes, groups = list(self._wakes), [ref() for ref in self._groups]
        for group in groups:
            if group is not None and "nccl" in _backend_name(group):  # pragma: no cover - needs GPUs
                try:
                    group.abort()
                except Exception:
                    _log.exception("%s: aborting %r failed", self.name, group)
        for wake in wakes:
            wake.set()

    def _fired_error(self, watchdog: _SyncWatchdog, what: str) -> SyncTimeoutError:
        return SyncTimeoutError(
            f"{what} timed out: the {watchdog.timeout_s:.3f}s deadline of {watchdog.name!r} passed "
            "(its watchdog fired)"
        )

    def wait(self, work: Any, deadline: Deadline, what: str, *, p2p: bool, group: Any) -> None:
        """Wait for a posted torch `work` of `group`: it ends by data, a lost peer or the watchdog.

        With no sync in flight (no `guard`), `deadline` bounds the wait instead. `p2p`: a send
        or receive, whose gloo wait takes an explicit timeout (the group's is fixed at creation).
        """
        watchdog = self._watchdog
        if watchdog is not None and watchdog.fired:
            raise self._fired_error(watchdog, what)
        if not p2p and "gloo" in _backend_name(group):
            error = self._wait_in_slices(work, deadline, what, watchdog)
        else:
            error = self._wait_on_helper(work, deadline, what, p2p, group, watchdog)["error"]
        if error is not None:
            raise map_dist_error(error, what) from error
        if watchdog is not None and watchdog.fired:  # an aborted NCCL collective may return quietly
            raise self._fired_error(watchdog, what)

    def _wait_in_slices(
        self, work: Any, deadline: Deadline, what: str, watchdog: _SyncWatchdog | None
    ) -> BaseException | None:
        """A gloo collective: its wait may time out and be waited again, so it needs no helper.

        Each slice ends where the deadline does; then either the watchdog fired (a timeout) or
        it was stood down (the next slice has no clock but the group's own).
        """
        limit = deadline if watchdog is None else watchdog.deadline
        while True:
            left = limit.remaining()
            if left is not None and left <= 0:
                raise deadline.error(what) if watchdog is None else self._fired_error(watchdog, what)
            try:
                work.wait(timedelta(seconds=WIRE_TIMEOUT_S if left is None else max(left, 0.001)))
                return None
            except Exception as exc:
                if work.is_completed():  # the collective itself failed (not our slice)
                    return exc

    def _wait_on_helper(
        self, work: Any, deadline: Deadline, what: str, p2p: bool, group: Any, watchdog: _SyncWatchdog | None
    ) -> dict[str, BaseException | None]:
        """A wait that cannot be sliced (gloo's send and receive close the pair when a timed wait
        ends; NCCL's) runs on a helper; the caller wakes on its end or on the watchdog firing."""
        if work.is_completed():
            done: dict[str, BaseException | None] = {}
            _finish(work, p2p, done)
            return done
        wake = threading.Event()
        outcome: dict[str, BaseException | None] = {}

        def run(keep: Any = group) -> None:  # holds the group until its work ends
            try:
                _finish(work, p2p, outcome)
            finally:
                wake.set()

        with self._lock:
            self._wakes.add(wake)
        try:
            _HELPERS.run(run)
            limit = WIRE_TIMEOUT_S if watchdog is not None else deadline.remaining_or(WIRE_TIMEOUT_S)
            wake.wait(limit)
        finally:
            with self._lock:
                self._wakes.discard(wake)
        if "error" in outcome:
            return outcome
        if watchdog is not None and watchdog.fired:
            raise self._fired_error(watchdog, what)
        if watchdog is None and deadline.expired:
            raise deadline.error(what)
        raise SyncTimeoutError(f"{what} timed out: the group's own {WIRE_TIMEOUT_S:.0f}s timeout passed")


class _Helpers:
    """Daemon threads that wait on torch works, reused from one wait to the next.

    Daemon threads, and not an executor's: a wait abandoned to a fired watchdog may block until
    its peer goes, and must not hold up the interpreter's exit.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            reuse = self._idle > 0
            self._idle -= reuse
        if reuse:
            self._jobs.put(job)
        else:
            threading.Thread(target=self._loop, args=(job,), name="rlfleet-wire-wait", daemon=True).start()

    def _loop(self, job: Callable[[], None] | None) -> None:
        while job is not None:
            job()
            job = None  # drop its references (a group among them) before idling
            with self._lock:
                self._idle += 1
            job = self._jobs.get()


_HELPERS = _Helpers()


def _finish(work: Any, p2p: bool, outcome: dict[str, BaseException | None]) -> None:
    try:
        if p2p:
            work.wait(timedelta(seconds=WIRE_TIMEOUT_S))
        else:
            work.wait()
    except BaseException as exc:
        outcome["error"] = exc
    else:
        outcome["error"] = None


class _WatchedWork:
    """A posted torch Work whose `wait` is its `SyncWatch`'s (the deadline is the watchdog's)."""

    __slots__ = ("_group", "_p2p", "_watch", "_work")

    def __init__(self, watch: SyncWatch, work: Any, group: Any, p2p: bool) -> None:
        self._watch = watch
        self._work = work
        self._group = group
        self._p2p = p2p

    def wait(self, deadline: Deadline, what: str) -> None:
        self._watch.wait(self._work, deadline, what, p2p=self._p2p, group=self._group)


class _WatchedMember(GroupMember):
    """A member of a torch group whose waits a `SyncWatch` guards (timeout of the group lifted)."""

    def __init__(self, group: Any, watch: SyncWatch, device: str | torch.device | None) -> None:
        backend = group.process_group if isinstance(group, MemberGroup) else group
        dev = torch.device(device) if device is not None else _device_of(backend)
        super().__init__(dev, int(backend.rank()), int(backend.size()))
        self.group: Any = backend
        self.watch = watch
        lift_group_timeout(backend)
        watch.watch_group(backend)

    def _post(self, post: Any, what: str, p2p: bool) -> _WatchedWork:
        try:
            work = post()
        except Exception as exc:
            raise map_dist_error(exc, what) from exc
        return _WatchedWork(self.watch, work, self.group, p2p)

    def all_reduce_sum(self, tensor: torch.Tensor) -> _WatchedWork:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        return self._post(lambda: self.group.allreduce([tensor], opts), "all_reduce", False)


class WatchedWire(_WatchedMember):
    """A `MemberGroup` (or torch backend) as the broadcast protocol's wire, watched by `watch`."""

    def __init__(
        self, group: Any, src: int, watch: SyncWatch, device: str | torch.device | None = None
    ) -> None:
        super().__init__(group, watch, device)
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.size:
            raise ValueError(f"source rank {src!r} is not a rank of the group (0..{self.size - 1})")
        self._src = src

    @property
    def src(self) -> int:
        return self._src

    def broadcast(self, tensor: torch.Tensor) -> _WatchedWork:
        opts = dist.BroadcastOptions()
        opts.rootRank = self._src
        opts.rootTensor = 0
        return self._post(lambda: self.group.broadcast([tensor], opts), "broadcast", False)


class WatchedP2PWire(_WatchedMember):
    """A `MemberGroup` (or torch backend) as reshard's point-to-point wire, watched by `watch`."""

    def __init__(self, group: Any, watch: SyncWatch, device: str | torch.device | None = None) -> None:
        super().__init__(group, watch, device)

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _WatchedWork:
        return self._post(lambda: self.group.send([tensor], peer, tag), f"send to group rank {peer}", True)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _WatchedWork:
        what = f"receive from group rank {peer}"
        return self._post(lambda: self.group.recv([tensor], peer, tag), what, True)


class WatchedBroadcastSender(BroadcastSender):
    """`BroadcastSender` over a `WatchedWire`: its deadline is `watch`'s watchdog (see `SyncWatch.guard`)."""

    def __init__(
        self, layout: Layout, group: Any, src: int, watch: SyncWatch, checksums: bool = False
    ) -> None:
        super(BroadcastSender, self).__init__(layout, WatchedWire(group, src, watch), checksums)


class WatchedBroadcastReceiver(BroadcastReceiver):
    """`BroadcastReceiver` over a `WatchedWire` (the sender's group rank `src`)."""

    def __init__(self, layout: Layout, group: Any, src: int, watch: SyncWatch) -> None:
        super(BroadcastReceiver, self).__init__(layout, WatchedWire(group, src, watch))
