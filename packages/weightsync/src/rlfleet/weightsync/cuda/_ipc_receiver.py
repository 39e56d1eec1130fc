"""A reader of a CUDA IPC channel (see `_cuda_ipc` for the protocol and the stream contract).

A session that offers a delta base is first told whether this reader's consumer holds it; a
delta slot is rebuilt where the full bucket would land (the consumer's landing zone on the
slots' device, else a bucket buffer there) and checked against the sender's digest before the
consumer sees it (`_ipc_sender`). A refused rebuild fails this reader's vote: nobody applies the
version, and this reader keeps serving its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

import rlfleet.weightsync.cuda._ipc_control as ipc
from rlfleet.weightsync._deadline import Backoff, Deadline, caller_deadline
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    LayoutMismatchError,
    MetadataError,
    PeerLostError,
    SyncAbortedError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync.codec._delta import DELTA_KINDS, FULL
from rlfleet.weightsync.codec._delta_state import holds_base
from rlfleet.weightsync.cuda._cupy import import_cupy
from rlfleet.weightsync.cuda._ipc_control import ChannelBlock, decode_meta
from rlfleet.weightsync.cuda._ipc_slots import CudaOpened, HostOpened
from rlfleet.weightsync.layout._integrity import bucket_checksum
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._core import prepare
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.protocol._wire_base import DeltaRebuilder, fitting_target
from rlfleet.weightsync.shm._control_block import INT64_MAX, Every
from rlfleet.weightsync.shm._ring_format import word_digest
from rlfleet.weightsync.shm._shm import (
    SHM_DIR,
    SharedSegment,
    memory_fence,
    process_alive,
    process_identity,
    segment_creator,
)

__all__ = ["CudaIpcReceiver"]

DEFAULT_RECEIVE_DEADLINE_S = 120.0

_log = logging.getLogger(__name__)


class CudaIpcReceiver:
    """One reader of an IPC channel: ``receive(consumer, deadline)`` once per version."""

    def __init__(
        self,
        segment: SharedSegment,
        cb: ChannelBlock,
        index: int,
        slots: CudaOpened | HostOpened,
        sender_layout: Layout,
        last_session: int,
    ) -> None:
        self._segment = segment
        self._cb = cb
        self.index = index
        self._slots = slots
        self.sender_layout = sender_layout
        # Read before R_ATTACHED is set (see ShmRingReceiver): a session started after that
        # includes this reader and must not be taken for an old one.
        self._last_session = last_session
        self._liveness = Every()
        self._rebuilder = DeltaRebuilder(slots.device)  # where a delta bucket is rebuilt

    @property
    def name(self) -> str:
        return self._segment.name

    @classmethod
    def attach(cls, name: str, index: int, device: str | torch.device | None = None) -> CudaIpcReceiver:
        """Join channel `name` as reader `index`: open the slot handles once."""
        segment = SharedSegment.attach(name, map_whole=False)
        try:
            cb, raw_meta = ChannelBlock.of(segment)
            num_readers = cb.num_readers
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_readers:
                raise ValueError(f"reader index {index!r} out of range: channel {name!r} has {num_readers}")
            meta = decode_meta(raw_meta)
            holder = cb.get(cb.reader(index, ipc.R_PID))
            me, my_start = process_identity()
            if cb.get(cb.reader(index, ipc.R_ATTACHED)) and holder != me and cb.reader_alive(index):
                raise WeightSyncError(
                    f"IPC channel {name!r}: reader index {index} is held by live pid {holder}"
                )
            slots = _open_slots(cb, meta, name, device, (me, my_start))
            fresh = {ipc.R_ATTACHED: 0, ipc.R_PID: me, ipc.R_START: my_start, ipc.R_ACK: 0, ipc.R_READING: 0}
            fresh[ipc.R_HELD_SESSION] = 0  # a report of an earlier holder of this index is not ours
            for field, value in fresh.items():
                cb.set(cb.reader(index, field), value)
            cb.set(cb.reader(index, ipc.R_EPOCH), (cb.get(cb.reader(index, ipc.R_EPOCH)) + 1) & INT64_MAX)
            last_session = cb.get(ipc.G_SESSION)
            memory_fence()
            cb.set(cb.reader(index, ipc.R_ATTACHED), 1)
            return cls(segment, cb, index, slots, meta["layout"], last_session)
        except BaseException:
            segment.close()
            raise

    def _check_writer(self, what: str) -> None:
        cb = self._cb
        if cb.get(ipc.G_CLOSED):
            raise PeerLostError(f"IPC channel {self.name} was closed by its sender while {what}")
        if self._liveness.due() and not cb.writer_alive():
            self._unlink_orphans()
            raise PeerLostError(f"IPC sender (pid {cb.get(ipc.G_WRITER_PID)}) died while {what}")

    def _unlink_orphans(self) -> None:
        """The sender died without unlinking its segments: remove their names (mappings stay valid)."""
        names = [self._segment.name]
        if isinstance(self._slots, HostOpened):
            names.append(self._slots.name)
        for name in names:
            creator = segment_creator(name)
            if creator is not None and not process_alive(*creator):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(SHM_DIR / name)

    def _wait(self, done: Callable[[], bool], session: int | None, deadline: Deadline, what: str) -> None:
        cb = self._cb
        backoff = Backoff()
        while not done():
            if session is not None and cb.get(ipc.G_ABORT) == session:
                raise SyncAbortedError(
                    f"IPC channel {self.name}: the sender aborted while we waited for {what}"
                )
            self._check_writer(f"waiting for {what}")
            if deadline.expired:
                raise deadline.error(f"IPC channel {self.name}: reader {self.index} waiting for {what}")
            backoff.sleep(deadline.remaining())

    def _enter(self, deadline: Deadline) -> int:
        """Wait for the next session's header, register as reading its slots (R_READING), then
        check it is still the current session. The sender announces a session (G_SESSION), then
        looks at R_READING before it writes the next header or any slot: so either it waits for
        this reader, or this reader sees the session is over (and skips it, having read nothing).
        Past this check the session's header and slots stay as they are until R_READING clears."""
        cb, word = self._cb, self._cb.reader(self.index, ipc.R_READING)
        while True:
            self._wait(lambda: cb.get(ipc.G_READY) > self._last_session, None, deadline, "the next version")
            memory_fence()
            session = cb.get(ipc.G_READY)
            self._last_session = session
            cb.set(word, session)
            memory_fence()
            if cb.get(ipc.G_SESSION) == session:
                return session
            cb.set(word, 0)  # over before this reader read anything: nothing to release

    def receive(
        self, consumer: BucketConsumer, deadline: Deadline | float | None = DEFAULT_RECEIVE_DEADLINE_S
    ) -> int:
        """Receive the next version into `consumer`; returns it once committed on every reader.

        Two-phase: once every bucket was consumed, the consumer prepares its commit
        (``prepare_commit``: the serving lock, a checked version) before this reader votes; a
        reader that cannot prepare votes no, so no reader applies the version and the sender's
        error names it. After the sender's commit, `commit` cannot fail for a consumer that
        prepares."""
        deadline = Deadline.coerce(deadline)
        cb, me = self._cb, self.index
        if self._segment.closed:
            raise WeightSyncError(f"IPC channel {self.name}: reader {me} was closed")
        session = self._enter(deadline)
        version, base, nbuckets = cb.get(ipc.G_VERSION), cb.get(ipc.G_BASE), cb.get(ipc.G_NBUCKETS)
        began = False
        try:
            problem = consumer.layout.diff(self.sender_layout)
            if problem is not None:
                name = problem.split("'")[1] if "'" in problem else None
                raise LayoutMismatchError(
                    f"IPC channel {self.name}: layout mismatch with the sender: {problem}", name
                )
            if nbuckets != len(consumer.layout.buckets):
                raise MetadataError(f"session has {nbuckets} buckets, layout {len(consumer.layout.buckets)}")
            with caller_deadline(deadline):  # a node buffer waits for its readers no longer than this
                consumer.begin(version)
            began = True
            delta = self._report_base(consumer, session)
            self._read_buckets(consumer, session, version, base, nbuckets, deadline, delta)
            failure = prepare(consumer, version, deadline, f"IPC channel {self.name}: reader {me}")
            if failure is not None:  # what commit needs could not be had: vote no
                raise failure
        except BaseException as exc:
            self._fail(consumer, exc, began, session, base + nbuckets)
            if isinstance(exc, (WeightSyncError, VersionError)) or not isinstance(exc, Exception):
                raise
            raise SyncAbortedError(f"reader {me} failed on version {version}: {exc}") from exc
        self._report(session, base + nbuckets, ipc.RESULT_OK)
        try:
            what = f"the commit of version {version}"
            self._wait(lambda: cb.get(ipc.G_COMMIT) == session, session, deadline, what)
        except BaseException as exc:
            _abort(consumer, exc)
            cb.set(cb.reader(me, ipc.R_DONE), session)
            raise
        try:
            consumer.commit(version)
        finally:
            cb.set(cb.reader(me, ipc.R_DONE), session)
        return version

    def _read_buckets(
        self,
        consumer: BucketConsumer,
        session: int,
        version: int,
        base: int,
        nbuckets: int,
        deadline: Deadline,
        delta: bool = False,
    ) -> None:
        """Hand each slot to the consumer (a delta rebuilt first), wait for its reads (current
        stream), then release the slot."""
        cb, me = self._cb, self.index
        checksums = bool(cb.get(ipc.G_CHECKSUMS))
        with torch.no_grad():
            for k in range(nbuckets):
                j = k % ipc.NUM_SLOTS
                seq = base + k + 1
                self._wait(
                    lambda j=j, seq=seq: cb.get(cb.slot(j, ipc.S_SEQ)) == seq,  # type: ignore[misc]
                    session,
                    deadline,
                    f"bucket {k} of version {version}",
                )
                memory_fence()
                data = self._slot_data(consumer, k, j, session, delta)
                if checksums:
                    expected, actual = cb.get(cb.slot(j, ipc.S_CRC)), bucket_checksum(data)
                    if actual != expected:
                        raise ChecksumMismatchError(
                            f"bucket {k} of version {version}: crc32 {actual:#010x}, sender {expected:#010x}",
                            k,
                        )
                consumer.consume(k, self._rebuilt_bucket(consumer, k, j, data))
                self._slots.sync()  # the consumer's reads (on the current stream) are done
                # cannot happen while R_READING holds the sender off:
                if cb.get(cb.slot(j, ipc.S_SEQ)) != seq:
                    raise SyncAbortedError(
                        f"IPC channel {self.name}: slot {j} was rewritten while bucket {k} was read"
                    )
                cb.set(cb.reader(me, ipc.R_ACK), seq)
        cb.set(cb.reader(me, ipc.R_READING), 0)  # every read of this session's slots has finished

    def _report_base(self, consumer: BucketConsumer, session: int) -> bool:
        """Tell the sender whether `consumer` holds the base this session offers; whether it does."""
        cb, me = self._cb, self.index
        offer = cb.get(ipc.G_OFFER)
        if offer < 0:
            return False
        held = holds_base(consumer, offer)
        cb.set(cb.reader(me, ipc.R_HELD), offer if held else -1)
        memory_fence()
        cb.set(cb.reader(me, ipc.R_HELD_SESSION), session)
        return held

    def _slot_data(self, consumer: BucketConsumer, k: int, j: int, session: int, delta: bool) -> torch.Tensor:
        """The bytes slot `j` holds for bucket `k` (the bucket, or its delta), checked as announced."""
        cb = self._cb
        nbytes, kind = cb.get(cb.slot(j, ipc.S_NBYTES)), cb.get(cb.slot(j, ipc.S_KIND))
        full = consumer.layout.buckets[k].nbytes
        fits = nbytes == full if kind == 0 else delta and 0 < kind < len(DELTA_KINDS) and 0 < nbytes <= full
        if cb.get(cb.slot(j, ipc.S_BUCKET)) != k or cb.get(cb.slot(j, ipc.S_SESSION)) != session or not fits:
            raise MetadataError(f"IPC channel {self.name}: slot {j} does not hold bucket {k} of this session")
        return self._slots.tensors[j][:nbytes]

    def _rebuilt_bucket(self, consumer: BucketConsumer, k: int, j: int, data: torch.Tensor) -> torch.Tensor:
        """Bucket `k` of the new version: `data` itself, or the delta it holds rebuilt on the
        consumer's base where the full bucket would land (on the slots' device), checked against
        the sender's digest."""
        cb = self._cb
        kind = DELTA_KINDS[cb.get(cb.slot(j, ipc.S_KIND))]
        if kind == FULL:
            return data
        digest = word_digest(cb.get(cb.slot(j, ipc.S_DIGEST)))
        target = fitting_target(consumer, k, consumer.layout.buckets[k].nbytes, self._rebuilder.device)
        return self._rebuilder.rebuild(consumer, k, kind, data, digest, target)

    def _fail(
        self, consumer: BucketConsumer, error: BaseException, began: bool, session: int, last_seq: int
    ) -> None:
        """Failure: wait for every stream of the device (reads queued anywhere), then release."""
        self._slots.settle()
        self._cb.set(self._cb.reader(self.index, ipc.R_READING), 0)
        if began:
            _abort(consumer, error)
        self._report(session, last_seq, ipc.RESULT_FAILED)

    def _report(self, session: int, last_seq: int, result: int) -> None:
        cb, me = self._cb, self.index
        cb.set(cb.reader(me, ipc.R_ACK), last_seq)  # release every slot of this session
        cb.set(cb.reader(me, ipc.R_RESULT), result)
        memory_fence()
        cb.set(cb.reader(me, ipc.R_PREPARED), session)
        if result == ipc.RESULT_FAILED:
            cb.set(cb.reader(me, ipc.R_DONE), session)

    def close(self) -> None:
        """Leave the channel: settle the device, unmap the slots, then say so to the sender."""
        if self._segment.closed:
            return
        cb = self._cb
        self._slots.close()  # unmap first: the sender frees the slots once no reader is attached
        cb.set(cb.reader(self.index, ipc.R_READING), 0)
        cb.set(cb.reader(self.index, ipc.R_ATTACHED), 0)
        cb.set(cb.reader(self.index, ipc.R_PID), 0)
        cb.detach()
        self._segment.close()

    def __enter__(self) -> CudaIpcReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_slots(
    cb: ChannelBlock,
    meta: dict[str, Any],
    name: str,
    device: str | torch.device | None,
    me: tuple[int, int],
) -> CudaOpened | HostOpened:
    handles, slot_bytes = meta["handles"], meta["slot_bytes"]  # types checked by decode_meta
    if meta["backend"] != "cuda":
        return HostOpened(handles, slot_bytes)
    if (cb.get(ipc.G_WRITER_PID), cb.get(ipc.G_WRITER_START)) == me:
        # CUDA cannot open an IPC handle in the process that exported it.
        raise WeightSyncError(
            f"IPC channel {name!r}: CUDA slots must be attached from another process than the sender's"
        )
    import_cupy()
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return CudaOpened(handles, slot_bytes, dev)


def _abort(consumer: BucketConsumer, error: BaseException) -> None:
    try:
        consumer.abort(error)
    except Exception:  # the consumer's cleanup must not hide the sync's error
        _log.exception("consumer.abort failed")
