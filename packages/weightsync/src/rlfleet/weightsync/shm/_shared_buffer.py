"""Strategy "Shared": one weight buffer per node, in shared memory, read in place by every receiver.

The segment holds two slots (three on request), each a flat all-buckets copy of the model
(`pack_all` order), so version v stays readable while v+1 is written. One node writer fills a
slot, either as a `BucketConsumer` (fed by any transport: the node's receiver of a cross-node
sync) or with `publish(state_dict, version)` straight from a trainer on the node (one copy of
the bytes serves every local receiver). A trainer that `adopt`s its tensors keeps them in one
flat block laid out like a slot, and each `publish` is then a single streaming copy of that
block. Readers (`SharedBufferReader`) map the data read-only and bind their parameters to
zero-copy views of the newest committed slot, so per-node weight memory is two model copies
whatever the number of receivers. The segment layout and slot rules are in `_shared_format`.

The newest committed version is never overwritten: a version that fails (abort, a writer killed
mid-publish) leaves it readable, and a new reader binds it. With two slots the writer therefore
waits for a reader still bound to the older version to `refresh()`, no longer than its
``timeout_s`` and never past the caller's deadline (the error names that reader if it does
not); a writer whose readers may skip a version without refreshing (a reader that keeps serving
an old version for long) can take a third slot (``slots=3``, one more model copy in memory) and
never waits for a reader that is one version behind. Two is the default because node memory is
what this strategy saves.

Integrity: with ``checksums=True`` the writer stores a CRC32 per bucket of each committed slot;
a reader verifies a slot before it binds to it or copies it, so a byte corrupted in shared
memory is refused (`ChecksumMismatchError`) and nothing is applied.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Literal, overload

import numpy as np
import torch

from rlfleet.weightsync._deadline import Backoff, Deadline, current_deadline, deadline_or
from rlfleet.weightsync._errors import VersionError, WeightSyncError
from rlfleet.weightsync.buffers._buffers import BufferBase
from rlfleet.weightsync.codec._delta_state import clear_padding
from rlfleet.weightsync.layout._block import adopt, flat_block, live_tensors
from rlfleet.weightsync.layout._copy import copy_tensors
from rlfleet.weightsync.layout._integrity import bucket_checksum
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import flat_views
from rlfleet.weightsync.protocol._background import PublishHandle, SendPipeline
from rlfleet.weightsync.protocol._feed import feed
from rlfleet.weightsync.protocol._stream import StreamCursor, Weights, drain_on_error, open_source
from rlfleet.weightsync.shm._control_block import INT64_MAX, require_int_in
from rlfleet.weightsync.shm._shared_format import (
    COMMITTED,
    DEFAULT_TIMEOUT_S,
    EMPTY,
    G_CLOSED,
    G_DIGEST,
    MAX_READERS,
    MAX_SLOTS,
    MIN_SLOTS,
    R_IN_USE,
    R_PID,
    R_PIN,
    S_STATE,
    S_VERSION,
    SHARED,
    WRITING,
    SegmentPlan,
    SlotTable,
)
from rlfleet.weightsync.shm._shared_reader import SharedBufferReader
from rlfleet.weightsync.shm._shm import SharedSegment, cleanup_stale_segments, memory_fence

__all__ = ["SharedBuffer", "SharedBufferReader"]

_log = logging.getLogger(__name__)


def _lock_timeout(deadline: Deadline) -> float:
    """`deadline`'s time left as a lock's timeout (-1: no limit)."""
    left = deadline.remaining()
    return -1 if left is None else left


def _check_version_word(version: int) -> None:
    if not 0 <= version <= INT64_MAX:
        raise VersionError(f"version {version} does not fit a shared buffer's version word (0 .. 2**63 - 1)")


class SharedBuffer(BufferBase):
    """The node writer of a shared weight buffer (a `BucketConsumer`).

    ``SharedBuffer(layout, num_readers)`` creates the segment; hand `name` to the receivers on
    the node (`SharedBufferReader.attach`). `begin` waits for readers still bound to the slot it
    needs no longer than ``timeout_s`` (default 60 s) and never past the deadline of the sync
    that calls it (a transport's, `feed`'s, `publish`'s, or one passed to `begin`); a begin
    that finds another version of this buffer waiting there (another thread's sync) gives up at
    its own deadline too, naming that version. ``checksums=True`` stores a CRC32
    per bucket of every committed version, which readers verify before using it. ``slots``:
    2 (default) or 3, see the module docstring. ``reclaim`` first unlinks this user's rlfleet
    segments whose creator is dead (`cleanup_stale_segments`): the node buffer a killed run
    left behind is reclaimed by the next run's writer.
    """

    _background: SendPipeline[int] | None = None  # non-blocking publishes, at first use

    def __init__(
        self,
        layout: Layout,
        num_readers: int,
        *,
        slots: int = MIN_SLOTS,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        prefix: str = "rlfleet",
        checksums: bool = False,
        reclaim: bool = True,
    ) -> None:
        require_int_in("num_readers", num_readers, 1, MAX_READERS)
        require_int_in("slots", slots, MIN_SLOTS, MAX_SLOTS)
        super().__init__(layout)
        self.num_readers = num_readers
        self.num_slots = slots
        self.timeout_s = timeout_s
        self.checksums = bool(checksums)
        if reclaim:
            cleanup_stale_segments(prefix.split("-", 1)[0])
        layout_json = layout.to_json()
        plan = SegmentPlan.for_layout(layout, len(layout_json), slots, num_readers)
        self.slot_bytes = plan.slot_bytes
        self._segment = SharedSegment.create(plan.size, prefix=prefix)
        buf = self._segment.buffer
        self._table = SlotTable.over(buf, SHARED, slots, num_readers)
        buf[plan.layout_offset : plan.layout_offset + len(layout_json)] = layout_json
        self._table.set_digest(G_DIGEST, layout.digest)
        self._crcs = np.frombuffer(
            buf, dtype=np.int64, count=slots * plan.num_buckets, offset=plan.crc_offset
        ).reshape(slots, plan.num_buckets)
        for i in range(num_readers):
            self._table.set(self._table.reader(i, R_IN_USE), -1)
            self._table.set(self._table.reader(i, R_PIN), -1)
        self._table.fill(plan.header(self.checksums))
        size = plan.slot_bytes
        self._slots = [self._segment.tensor(plan.data_offset + j * size, size) for j in range(slots)]
        self._writing: int | None = None
        self._sealed: int | None = None  # the pending version whose slot is ready to commit
        self._begin_deadline: Deadline | None = None
        self._claiming: int | None = None  # the version whose begin holds the writer
        self._views: dict[int, list[torch.Tensor]] = {}

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def _header(self) -> SlotTable:
        """The slot table (kept under its old name for tools that inspect a writer)."""
        return self._table

    @property
    def extra_bytes(self) -> int:
        """Bytes of the node's segment (one model copy per slot, whatever the number of readers)."""
        return self._segment.size

    def latest_version(self) -> int:
        """Newest committed version in the segment (-1 if none)."""
        return self._table.newest_version()

    # -- BucketConsumer hooks -------------------------------------------------------------
    def begin(self, version: int, deadline: Deadline | float | None = None) -> None:
        """Start writing `version` into a slot no reader needs.

        Waits, if it must, for a reader to leave that slot (the error names it), no longer than
        ``timeout_s`` and never past `deadline`; without one, the deadline of the sync that
        called (`caller_deadline`).
        """
        given = Deadline.coerce(deadline) if deadline is not None else current_deadline()
        own = deadline_or(self.timeout_s, DEFAULT_TIMEOUT_S)
        wait = own if given is None else given.child(own.seconds)
        with self._writer_held(version, wait):
            self._begin_deadline, self._claiming = wait, version
            try:
                super().begin(version)
            finally:
                self._begin_deadline = self._claiming = None

    @contextlib.contextmanager
    def _writer_held(self, version: int, deadline: Deadline) -> Iterator[None]:
        """The writer's lock, waited for no longer than `deadline` (another thread's sync of this
        buffer may hold it, waiting for a reader): an error then names that sync's version."""
        if not self._state_lock.acquire(timeout=_lock_timeout(deadline)):
            holder = self._claiming if self._claiming is not None else self._pending
            raise deadline.error(
                f"shared buffer {self.name}: version {version} waited for another sync of this buffer "
                f"(version {holder}, waiting for a reader to leave the slot it needs, or being written)"
            )
        try:
            yield
        finally:
            self._state_lock.release()

    def _begin(self, version: int) -> None:
        _check_version_word(version)
        self._claim_slot(version, self._begin_deadline or deadline_or(self.timeout_s, DEFAULT_TIMEOUT_S))

    def _claim_slot(self, version: int, deadline: Deadline) -> None:
        table = self._table
        with self._segment.locked(deadline, "claiming a slot"):
            target = table.slot_to_write()
            previous = table.state(target)
            table.set(table.slot(target, S_STATE), WRITING)  # no new reader takes it from now on
        try:
            backoff = Backoff()
            while (holder := table.reader_on(target)) is not None:
                if deadline.expired:
                    pid = table.get(table.reader(holder, R_PID))
                    raise deadline.error(
                        f"shared buffer {self.name}: reader {holder} (pid {pid}) still reads slot {target} "
                        f"(version {table.version(target)}), which version {version} needs (every other slot "
                        f"is read or holds the newest version): reader {holder} must refresh()"
                    )
                backoff.sleep(deadline.remaining())
        except BaseException:
            table.set(table.slot(target, S_STATE), previous)  # untouched bytes: as it was
            raise
        self._writing = target

    def _slot_region(self, index: int) -> torch.Tensor:
        assert self._writing is not None
        start = self._starts[index]
        return self._slots[self._writing][start : start + self._layout.buckets[index].nbytes]

    def copy_base(self, index: int, out: torch.Tensor) -> bool:
        """Bucket `index` of the newest committed slot into `out` (the free slot's region, when a
        transport rebuilds a delta there), padding zeroed: a delta's base (`codec.DeltaBase`)."""
        newest = self._table.newest()
        if newest is None or self._table.version(newest) != self._version:
            return False
        start = self._starts[index]
        out.copy_(self._slots[newest][start : start + self._layout.buckets[index].nbytes])
        clear_padding(self._layout, index, out)
        return True

    def base_pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        """`copy_base`'s bytes without the copy: each tensor's range of the newest committed slot."""
        newest = self._table.newest()
        if newest is None or self._table.version(newest) != self._version:
            return None
        start = self._starts[index]
        slot = self._slots[newest]
        return [
            (spec.offset, slot[start + spec.offset : start + spec.offset + spec.nbytes])
            for spec in self._layout.buckets[index].tensors
            if spec.nbytes
        ]

    def bucket_target(self, index: int) -> torch.Tensor | None:
        """Bucket `index`'s bytes in the slot being written (a transport or `feed` lands there)."""
        with self._state_lock:
            if self._writing is None or self._pending is None or not 0 <= index < len(self._layout.buckets):
                return None
            return self._slot_region(index)

    def _stage(self, index: int, data: torch.Tensor) -> None:
        region = self._slot_region(index)
        if not (region.device == data.device and region.data_ptr() == data.data_ptr()):
            region.copy_(data)  # else the bytes were written in place

    def _prepare(self, version: int, deadline: Deadline) -> None:
        self._seal(version)

    def _seal(self, version: int) -> None:
        """Everything commit needs but its two word writes: the version checked, the checksums."""
        _check_version_word(version)
        target = self._writing
        if target is None:
            raise WeightSyncError(f"shared buffer {self.name}: no slot is written for version {version}")
        if self.checksums:  # of the bytes as they lie in the slot: what readers will check
            slot = self._slots[target]
            for bucket, start in zip(self._layout.buckets, self._starts, strict=True):
                self._crcs[target, bucket.index] = bucket_checksum(slot[start : start + bucket.nbytes])
        self._sealed = version

    def _publish(self, version: int) -> None:
        if self._sealed != version:
            self._seal(version)
        table, target = self._table, self._writing
        assert target is not None
        memory_fence()  # the slot's bytes and checksums before its version and state
        table.set(table.slot(target, S_VERSION), version)
        memory_fence()
        table.set(table.slot(target, S_STATE), COMMITTED)
        self._writing = self._sealed = None

    def _drop(self) -> None:
        if self._writing is not None:
            self._table.set(self._table.slot(self._writing, S_STATE), EMPTY)
            self._writing = self._sealed = None

    # -- direct path ------------------------------------------------------------------------
    @overload
    def publish(
        self,
        weights: Weights,
        version: int,
        deadline: Deadline | float | None = ...,
        threads: int | None = ...,
        *,
        wait: Literal[True] = ...,
    ) -> None: ...
    @overload
    def publish(
        self,
        weights: Weights,
        version: int,
        deadline: Deadline | float | None = ...,
        threads: int | None = ...,
        *,
        wait: Literal[False],
    ) -> PublishHandle[int]: ...
    def publish(
        self,
        weights: Weights,
        version: int,
        deadline: Deadline | float | None = None,
        threads: int | None = None,
        *,
        wait: bool = True,
    ) -> PublishHandle[int] | None:
        """Pack `weights` straight into a free slot and commit it as `version` (one copy).

        `weights` is a state dict or a `WeightStream` (pairs in the layout's order, each copied
        into the slot as it comes: `feed`; drained after a failure). `deadline` (default
        ``timeout_s``) bounds the wait for a free slot. A state dict's copy is shared among
        `threads` threads (default: this process's CPUs, at most 8).

        ``wait=False`` (async RL): the copy runs on a background thread and a `PublishHandle`
        comes back at once; the copy into the free slot is the snapshot, so ``snapshot_done()``
        (the fence before the trainer's next optimizer step) returns once it is committed, and
        ``result()`` gives `version`. A failure nobody collected is raised by the next publish.
        """
        deadline = deadline_or(deadline if deadline is not None else self.timeout_s, DEFAULT_TIMEOUT_S)
        if not wait:
            try:
                _check_version_word(version)
            except VersionError:  # refused before anything starts; a stream is drained
                with drain_on_error(open_source(weights, self._layout), deadline):
                    raise
            if self._background is None:
                self._background = SendPipeline(f"shared buffer {self.name}")
            return self._background.submit(  # every version committed in order: none skipped
                version,
                deadline,
                lambda _: self._publish_now(weights, version, deadline, threads),
                lambda _: version,
                coalesce=False,
            )
        if self._background is not None:  # after background publishes: their failure, then in order
            self._background.raise_failed()
            self._background.drain(deadline)
        self._publish_now(weights, version, deadline, threads)
        return None

    def _publish_now(self, weights: Weights, version: int, deadline: Deadline, threads: int | None) -> None:
        source = open_source(weights, self._layout)
        if isinstance(source, StreamCursor):
            with drain_on_error(source, deadline):
                feed(self, source.ordered(), version, deadline)
            return
        state_dict = source
        self._layout.check_state_dict(state_dict, sending=True)
        with self._writer_held(version, deadline):  # begin, copy and commit: no other sync between
            self.begin(version, deadline)
            try:
                assert self._writing is not None
                block = flat_block(self._layout, state_dict)
                if block is not None and block.device.type == "cpu":  # one streaming block copy
                    slot = self._slots[self._writing]
                    copy_tensors([slot[: block.numel()]], [block], threads)
                else:
                    targets = self._slot_views(self._writing)
                    sources = [state_dict[name].detach() for name in self._layout.names]
                    copy_tensors(targets, sources, threads)
                self._received.update(range(len(self._layout.buckets)))
                self.commit(version)
            except BaseException as exc:
                self.abort(exc)
                raise

    def adopt(self, targets: Mapping[str, torch.Tensor] | torch.nn.Module) -> None:
        """Move the writer's tensors into one block laid out like a slot (`weightsync.adopt`); a
        `publish` of them is then one contiguous copy instead of one per tensor.

        Values, Parameter objects and the optimizers that hold them are kept; pass a module or a
        ``state_dict(keep_vars=True)``. CPU tensors only. A later `publish` whose tensors are no
        longer all in the block takes the per-tensor path, with the same result.
        """
        live = live_tensors(targets) if isinstance(targets, torch.nn.Module) else targets
        on_other = sorted({t.device.type for t in live.values()} - {"cpu"})
        if on_other:
            raise ValueError(f"SharedBuffer.adopt: CPU tensors only, got tensors on {on_other}")
        adopt(live, self._layout)

    def _slot_views(self, slot: int) -> list[torch.Tensor]:
        """Typed views of every tensor inside a slot, in layout order (built once per slot)."""
        views = self._views.get(slot)
        if views is None:
            views = list(flat_views(self._layout, self._slots[slot]).values())
            self._views[slot] = views
        return views

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Tell readers the writer is gone and unlink the segment (bound readers keep their views)."""
        if self._segment.closed:
            return
        self._table.set(G_CLOSED, 1)
        self._slots = []
        self._views = {}
        self._table.detach()
        self._crcs = np.zeros((self.num_slots, len(self._layout.buckets)), dtype=np.int64)
        self._segment.close()
        self._segment.unlink()

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
