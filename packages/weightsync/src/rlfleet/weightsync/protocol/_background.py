"""Non-blocking sends: a consistent snapshot now, the bytes in the background, the newest first.

A trainer that waits for every sync idles for a full copy of the model plus the protocol. A
non-blocking send (``send(..., wait=False)`` / ``publish(..., wait=False)``) instead copies the
weights once into a private snapshot (`WeightSnapshot`: one flat block laid out like the layout;
the node buffer's free slot for `SharedBuffer`) and moves the bytes from there on a background
thread. The caller gets a `PublishHandle`: ``snapshot_done()`` is the fence a training loop
calls before its next ``optimizer.step()`` (the only thing that must wait: mutating the weights
after it never changes what is sent), ``result()`` is what the send returns, or its error.

`SendPipeline` orders them: snapshots run in the order they were asked for, one send runs at a
time, and a snapshot that is still waiting to be sent when a newer one is taken is skipped (its
handle resolves with the newer version's outcome, ``skipped=True``): a slow receiver gets the
newest version, never a queue of stale ones. A failure nobody collected with ``result()`` is
raised by the pipeline's next call, so a background send never fails silently.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import WeightSyncError
from rlfleet.weightsync.layout._copy import copy_pairs
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import bucket_starts, flat_views
from rlfleet.weightsync.protocol._stream import (
    StreamCursor,
    Weights,
    drain_on_error,
    fill_bucket,
    open_source,
)

__all__ = ["BackgroundSends", "PublishHandle", "SendPipeline", "WeightSnapshot"]

T = TypeVar("T")
_log = logging.getLogger(__name__)
#: Added to a handle's own deadline when a caller waits on it without a timeout: the background
#: thread, bound by that deadline, resolves the handle first (with its timeout error if need be).
WAIT_MARGIN_S = 5.0
#: A pipeline's snapshot and send threads leave after this long without work (and come back).
IDLE_S = 30.0


class PublishHandle(Generic[T]):
    """A version on its way in the background.

    ``snapshot_done(timeout)``: waits until the weights were copied (the fence before the next
    ``optimizer.step()``); raises the snapshot's error. ``result(timeout)``: waits for the send
    and returns its value, or raises its error. Without `timeout` both wait as long as the send's
    own deadline allows (every wait is bounded). ``skipped``: a newer version was sent instead.
    """

    def __init__(self, version: int, what: str, deadline: Deadline) -> None:
        self.version = version
        self.what = what
        self._deadline = deadline
        self._snapshot = threading.Event()
        self._snapshot_error: BaseException | None = None
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._sent: int | None = None
        self.collected = False  # result() was called: the caller saw the outcome

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "done")
        return f"PublishHandle(v{self.version} {self.what}: {state})"

    def _wait(self, event: threading.Event, timeout: float | None, what: str) -> None:
        if timeout is None:
            left = self._deadline.remaining()
            deadline = Deadline(None if left is None else left + WAIT_MARGIN_S)
        else:
            deadline = Deadline(timeout)
        deadline.wait(event, f"{self.what}: waiting for {what} of v{self.version}")

    def snapshot_done(self, timeout: float | None = None) -> None:
        """The fence: once it returns the weights may change; what is sent stays this version."""
        self._wait(self._snapshot, timeout, "the snapshot")
        if self._snapshot_error is not None:
            raise self._snapshot_error

    def result(self, timeout: float | None = None) -> T:
        """What the send returned (its error is raised here, and counts as seen)."""
        self._wait(self._done, timeout, "the send")
        self.collected = True
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the outcome without taking it (no error raised, not counted as seen);
        True once it is there, False at `timeout` (default: the send's own deadline)."""
        try:
            self._wait(self._done, timeout, "the send")
        except TimeoutError:
            return False
        return True

    def exception(self) -> BaseException | None:
        """The error of a finished send (None while running or after a success); not waiting."""
        return self._error if self._done.is_set() else None

    @property
    def snapshot_taken(self) -> bool:
        return self._snapshot.is_set() and self._snapshot_error is None

    @property
    def skipped(self) -> bool:
        """True once a newer version was sent in this one's place (its bytes never left)."""
        return self._done.is_set() and self._sent is not None and self._sent != self.version

    @property
    def sent_version(self) -> int | None:
        """The version whose send resolved this handle (this one, or the newer that replaced it)."""
        return self._sent

    # -- resolution (the pipeline's) -------------------------------------------------------
    def _snapshot_ended(self, error: BaseException | None) -> None:
        self._snapshot_error = error
        self._snapshot.set()

    def _resolve(self, sent: int, value: T | None, error: BaseException | None) -> None:
        if not self._snapshot.is_set():
            self._snapshot_ended(error)
        self._sent, self._value, self._error = sent, value, error
        self._done.set()


class _Entry(Generic[T]):
    __slots__ = ("absorbed", "eager", "handle", "send", "slot", "snapshot_over", "started")

    def __init__(self, handle: PublishHandle[T], slot: int, send: Callable[[int], T], eager: bool) -> None:
        self.handle, self.slot, self.send, self.eager = handle, slot, send, eager
        self.absorbed: list[PublishHandle[T]] = []  # older handles this one replaced
        self.started = False  # its `start` ran: the snapshot was asked for
        self.snapshot_over = False

    @property
    def sendable(self) -> bool:
        return self.started and (self.snapshot_over or self.eager)


class SendPipeline(Generic[T]):
    """Snapshots in order, one send at a time, the newest waiting snapshot sent next.

    ``submit(version, deadline, snapshot, send)``: ``snapshot(slot)`` copies the weights into
    snapshot slot 0 or 1 (never the slot a running send reads, when coalescing) on a thread of
    its own; ``send(slot)`` sends that slot once the previous send finished. `what` names the
    sender.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._cond = threading.Condition()
        self._pending: deque[_Entry[T]] = deque()  # one entry when coalescing (the newest)
        self._running: _Entry[T] | None = None
        #: snapshots to take, in the order asked (one thread takes them: a slot has one writer)
        self._snapshots: deque[tuple[_Entry[T], Callable[[int], None], BaseException | None]] = deque()
        self._taking = 0  # snapshots queued or being taken
        self._threads: dict[str, threading.Thread] = {}  # "snapshot", "send": started at first use
        self._failed: PublishHandle[T] | None = None  # the last failure, until someone sees it

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy()

    def raise_failed(self) -> None:
        """Raise the last background failure that no caller collected (once)."""
        with self._cond:
            failed, self._failed = self._failed, None
        if failed is not None and not failed.collected:
            failed.collected = True
            raise failed._error  # type: ignore[misc]

    def drain(self, deadline: Deadline) -> None:
        """Wait until nothing is pending or running (a synchronous send after background ones)."""
        with self._cond:
            deadline.wait(self._cond, f"{self.what}: waiting for background sends", lambda: not self._busy())

    def _busy(self) -> bool:
        return bool(self._pending) or self._running is not None or self._taking > 0

    def submit(
        self,
        version: int,
        deadline: Deadline,
        snapshot: Callable[[int], None],
        send: Callable[[int], T],
        start: Callable[[int], None] | None = None,
        eager: bool = False,
        coalesce: bool = True,
    ) -> PublishHandle[T]:
        """Take a snapshot of `version` now and send it after the running send (unless a newer
        one comes first); raises an earlier failure nobody collected instead.

        ``start(slot)``, when given, runs before this returns (a snapshot whose beginning the
        caller must be sure of: another process told to take it); ``snapshot(slot)`` then
        finishes it on the snapshot thread. An error in `start` is raised here, and the
        version is not sent. ``eager``: the send may begin before the snapshot is over (its
        reader waits for the snapshot itself: another process's, told in `start`).
        ``coalesce=False``: every version is sent, in order (a snapshot that is itself the
        commit, as a node buffer's publish, skips nothing); with one already waiting, this
        waits for it to start sending (each needs a slot of its own).
        """
        self.raise_failed()
        handle: PublishHandle[T] = PublishHandle(version, self.what, deadline)
        with self._cond:
            if not coalesce:  # every version is sent from its own slot: the running send's and
                # the other, so a third waits (within its deadline) until the one waiting starts
                deadline.wait(
                    self._cond,
                    f"{self.what}: v{version} waiting for a snapshot slot (every version is sent)",
                    lambda: not self._pending,
                )
            slot = 1 - self._running.slot if self._running is not None else 0
            entry = _Entry(handle, slot, send, eager)
            if coalesce:  # those waiting are never sent: the newer version goes instead
                for older in self._pending:
                    entry.absorbed += [*older.absorbed, older.handle]
                self._pending.clear()
            self._pending.append(entry)
            self._taking += 1
        began: BaseException | None = None
        if start is not None:
            try:
                start(slot)
            except BaseException as exc:
                began = exc
                handle.collected = True  # raised to the caller below: seen
        with self._cond:
            entry.started = True
            self._snapshots.append((entry, snapshot, began))
            for role, loop in (("snapshot", self._snapshot_loop), ("send", self._send_loop)):
                if role not in self._threads:  # the threads stay while busy, leave when idle
                    thread = threading.Thread(target=loop, name=f"{self.what}-{role}", daemon=True)
                    self._threads[role] = thread
                    thread.start()
            self._cond.notify_all()
        if began is not None:
            raise began
        return handle

    def _idle(self, role: str, ready: Callable[[], bool]) -> bool:
        """Wait (lock held) until `ready`; True when the thread should leave (idle for long)."""
        if self._cond.wait_for(ready, IDLE_S):
            return False
        del self._threads[role]
        return True

    def _snapshot_loop(self) -> None:
        while True:
            with self._cond:
                if self._idle("snapshot", lambda: bool(self._snapshots)):
                    return
                entry, snapshot, began = self._snapshots.popleft()
            error = began
            if error is None:
                try:
                    snapshot(entry.slot)
                except BaseException as exc:
                    error = exc
            entry.handle._snapshot_ended(error)
            with self._cond:
                entry.snapshot_over = True
                self._taking -= 1
                self._cond.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                if self._idle("send", lambda: bool(self._pending) and self._pending[0].sendable):
                    return
                entry = self._running = self._pending.popleft()
                self._cond.notify_all()  # its slot is the running one now: a submit may go on
            self._run(entry)
            with self._cond:
                self._running = None
                self._cond.notify_all()

    def _run(self, entry: _Entry[T]) -> None:
        handle = entry.handle
        value: T | None = None
        error = None if entry.eager else handle._snapshot_error
        if error is None:
            try:
                value = entry.send(entry.slot)
            except BaseException as exc:
                error = exc
        if error is not None and not handle.collected:
            _log.warning("%s: background send of v%d failed: %s", self.what, handle.version, error)
            with self._cond:
                self._failed = handle
        for h in (*entry.absorbed, handle):
            h._resolve(handle.version, value, error)


class WeightSnapshot:
    """Private copies of a model's weights, laid out like `layout`, one flat block per slot.

    ``take(slot, weights)`` copies a state dict or a `WeightStream` (in the layout's order) into
    slot `slot` on the weights' device and returns once the copy is complete (a CUDA copy is
    synchronised); ``state_dict(slot)`` gives the copy as tensors viewing that block, what a
    sender sends while the live weights move on. ``buckets``: only that share is copied.
    """

    def __init__(self, layout: Layout, slots: int = 2) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"WeightSnapshot slots must be an int >= 1, got {slots!r}")
        self.layout = layout
        self._blocks: list[torch.Tensor | None] = [None] * slots
        self._views: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._names: list[tuple[str, ...]] = [() for _ in range(slots)]

    @property
    def nbytes(self) -> int:
        """Bytes held (one model copy per slot used so far)."""
        return sum(b.numel() for b in self._blocks if b is not None)

    def _block(self, slot: int, device: torch.device) -> torch.Tensor:
        if not 0 <= slot < len(self._blocks):
            raise ValueError(f"snapshot slot {slot} does not exist (0 .. {len(self._blocks) - 1})")
        block = self._blocks[slot]
        if block is None or block.device != device:
            block = torch.empty(self.layout.padded_bytes, dtype=torch.uint8, device=device)
            self._blocks[slot] = block
            self._views[slot] = flat_views(self.layout, block)
        return block

    def take(
        self,
        slot: int,
        weights: Weights,
        buckets: Sequence[int] | None = None,
        deadline: Deadline | None = None,
    ) -> dict[str, torch.Tensor]:
        """Copy `weights` (the tensors of `buckets`; None: all) into `slot`; the copy's views."""
        source = open_source(weights, self.layout, buckets)
        indices = list(range(len(self.layout.buckets))) if buckets is None else sorted(buckets)
        names = tuple(t.name for k in indices for t in self.layout.buckets[k].tensors)
        if isinstance(source, StreamCursor):
            with drain_on_error(source, deadline or Deadline(None)):
                self._take_stream(slot, source, indices)
        else:
            self._take_dict(slot, source, buckets, names)
        self._names[slot] = names
        return self.state_dict(slot)

    def _take_dict(
        self,
        slot: int,
        state_dict: Mapping[str, torch.Tensor],
        buckets: Sequence[int] | None,
        names: tuple[str, ...],
    ) -> None:
        self.layout.check_state_dict(state_dict, buckets=buckets, sending=True)
        if not names:
            return
        sources = [state_dict[n].detach() for n in names]
        block = self._block(slot, sources[0].device)
        views = self._views[slot]
        copy_pairs([views[n] for n in names], sources)
        _synchronize(block.device)

    def _take_stream(self, slot: int, cursor: StreamCursor, indices: list[int]) -> None:
        starts = bucket_starts(self.layout)
        block: torch.Tensor | None = self._blocks[slot]
        for k in indices:
            bucket = self.layout.buckets[k]
            if block is None:  # the stream's device, known at its first tensor: CPU until then
                block = self._block(slot, torch.device("cpu"))
            fill_bucket(cursor, k, block[starts[k] : starts[k] + bucket.nbytes], self._views[slot])
        cursor.finish()
        if block is not None:
            _synchronize(block.device)

    def state_dict(self, slot: int) -> dict[str, torch.Tensor]:
        """The tensors of the last `take` into `slot` (views of its block)."""
        if not self._names[slot]:
            raise WeightSyncError(f"snapshot slot {slot} holds nothing yet")
        views = self._views[slot]
        return {n: views[n] for n in self._names[slot]}

    def release(self) -> None:
        self._blocks = [None] * len(self._blocks)
        self._views = [{} for _ in self._blocks]
        self._names = [() for _ in self._blocks]


class BackgroundSends(Generic[T]):
    """A sender's non-blocking sends: a `SendPipeline` over a two-slot `WeightSnapshot`.

    ``start(weights, version, deadline, send_now)`` snapshots `weights` and runs
    ``send_now(snapshot_state_dict)`` in the background; ``settle(deadline)`` is what a
    synchronous send of the same sender calls first (an uncollected failure is raised, then it
    waits for the background sends, so the wire carries one version at a time).
    """

    def __init__(self, layout: Layout, what: str) -> None:
        self.snapshot = WeightSnapshot(layout)
        self.pipeline: SendPipeline[T] = SendPipeline(what)

    def start(
        self,
        weights: Weights,
        version: int,
        deadline: Deadline,
        send_now: Callable[[dict[str, torch.Tensor]], T],
        buckets: Sequence[int] | None = None,
    ) -> PublishHandle[T]:
        snap = self.snapshot

        def take(slot: int) -> None:
            snap.take(slot, weights, buckets, deadline)

        return self.pipeline.submit(version, deadline, take, lambda slot: send_now(snap.state_dict(slot)))

    def settle(self, deadline: Deadline) -> None:
        self.pipeline.raise_failed()
        self.pipeline.drain(deadline)


def _synchronize(device: torch.device) -> None:
    """A device copy is queued on its stream: the snapshot is taken only once it ran."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
