"""The receiving end of a ShmRing (`_shm_ring`): one reader process per reader index.

A receiver waits for a session it is a member of, hands each published slot to its
`BucketConsumer` (checking the sender's layout digest first and each bucket's CRC32 when the
sender stores them), acknowledges it, and reports its outcome; every wait checks the writer's
liveness and ends by the deadline (`DEFAULT_RING_TIMEOUT_S`, 60 s, by default). A session that
offers a delta base is first told whether this reader's consumer holds it; a delta slot is
rebuilt where the full bucket would land and checked against the writer's digest (`_shm_ring`).
"""

from __future__ import annotations

import torch

import rlfleet.weightsync.shm._ring_format as rf
from rlfleet.weightsync._deadline import Backoff, Deadline, caller_deadline, deadline_or
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    LayoutMismatchError,
    MetadataError,
    PeerLostError,
    SyncAbortedError,
    WeightSyncError,
)
from rlfleet.weightsync.codec._delta import DELTA_KINDS, FULL
from rlfleet.weightsync.codec._delta_state import holds_base
from rlfleet.weightsync.layout._integrity import bucket_checksum
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.protocol._wire_base import DeltaRebuilder, fitting_target
from rlfleet.weightsync.shm._control_block import INT64_MAX, ControlBlock, Every, probe_header
from rlfleet.weightsync.shm._shm import PAGE, SharedSegment, memory_fence

__all__ = ["ShmRingReceiver"]


class ShmRingReceiver:
    """One reader of a ring: `receive(consumer)` once per version the writer sends."""

    def __init__(
        self,
        segment: SharedSegment,
        ring: ControlBlock,
        reader_index: int,
        slots: list[torch.Tensor],
        last_session: int,
    ):
        self._segment = segment
        self._ring = ring
        self.reader_index = reader_index
        self._slots = slots
        # The newest session started before this reader announced itself: it cannot be a member
        # of it. Read before rf.R_ATTACHED is set, or a session the writer starts in between (with
        # this reader as a member) would be mistaken for an old one and never received.
        self._last_session = last_session
        self._sender_layout: Layout | None = None
        self._liveness = Every()
        self._rebuilder = DeltaRebuilder(torch.device("cpu"))  # where a delta bucket is rebuilt

    @property
    def name(self) -> str:
        return self._segment.name

    @classmethod
    def attach(cls, name: str, reader_index: int) -> ShmRingReceiver:
        """Join ring `name` as reader `reader_index` (one process per index).

        The segment must be this user's, mode 0600 (`UnsafeSegmentError`), and a ring.
        """
        segment = SharedSegment.attach(name, map_whole=False)
        try:
            first = probe_header(segment, rf.RING)
            num_readers, num_slots = int(first[rf.G_NUM_READERS]), int(first[rf.G_NUM_SLOTS])
            slot_bytes, data_offset = int(first[rf.G_SLOT_BYTES]), int(first[rf.G_DATA_OFFSET])
            if (
                not 1 <= num_readers <= rf.MAX_READERS
                or not 2 <= num_slots <= rf.MAX_SLOTS
                or data_offset % PAGE
                or data_offset < rf.RING.control_bytes(num_slots, num_readers)
                or data_offset + num_slots * slot_bytes != segment.size
            ):
                raise MetadataError(f"ring {name!r} has an inconsistent header")
            if isinstance(reader_index, bool) or not isinstance(reader_index, int):
                raise ValueError(f"reader_index must be an int, got {reader_index!r}")
            if not 0 <= reader_index < num_readers:
                raise ValueError(f"reader_index {reader_index} out of range: ring {name!r} has {num_readers}")
            ring = ControlBlock.over(segment.map_region(0, data_offset), rf.RING, num_slots, num_readers)
            cls._claim(ring, reader_index, name)
            data = segment.map_region(data_offset, num_slots * slot_bytes, readonly=True)
            slots = [segment.tensor(j * slot_bytes, slot_bytes, region=data) for j in range(num_slots)]
            last_session = ring.get(rf.G_SESSION)
            memory_fence()
            ring.set(ring.reader(reader_index, rf.R_ATTACHED), 1)
            return cls(segment, ring, reader_index, slots, last_session)
        except BaseException:
            segment.close()
            raise

    @staticmethod
    def _claim(ring: ControlBlock, index: int, name: str) -> None:
        """Take reader record `index` (free, or held by a dead process), with a new epoch."""
        holder = ring.get(ring.reader(index, rf.R_PID))
        if ring.get(ring.reader(index, rf.R_ATTACHED)) and ring.reader_alive(index):
            raise WeightSyncError(f"ring {name!r}: reader index {index} is held by live pid {holder}")
        epoch = ring.get(ring.reader(index, rf.R_EPOCH))
        if not 0 <= epoch < INT64_MAX:
            raise MetadataError(
                f"ring {name!r}: reader {index}'s epoch word is {epoch}, out of range: corrupted header"
            )
        ring.set(ring.reader(index, rf.R_ATTACHED), 0)
        ring.claim_reader(index)
        for field in (rf.R_ACK, rf.R_DONE, rf.R_RESULT, rf.R_HELD_SESSION):
            ring.set(ring.reader(index, field), 0)
        ring.set(ring.reader(index, rf.R_EPOCH), epoch + 1)

    # -- receiving ------------------------------------------------------------------------
    def _check_writer(self, what: str) -> None:
        ring = self._ring
        if ring.get(rf.G_CLOSED):
            raise PeerLostError(f"ring {self.name} was closed by its writer while {what}")
        if self._liveness.due() and not ring.writer_alive():
            raise PeerLostError(f"ring writer (pid {ring.get(rf.G_WRITER_PID)}) died while {what}")

    def _sender_layout_for(self) -> Layout:
        if self._sender_layout is None:
            ring = self._ring
            start, length = ring.get(rf.G_LAYOUT_OFFSET), ring.get(rf.G_LAYOUT_LEN)
            control = self._segment.map_region(0, ring.get(rf.G_DATA_OFFSET))
            raw = bytes(control[start : start + length])
            self._sender_layout = Layout.from_json(raw)
        return self._sender_layout

    def _wait_session(self, deadline: Deadline) -> int:
        ring, me = self._ring, self.reader_index
        backoff = Backoff()
        while True:
            session = ring.get(rf.G_SESSION)
            if session > self._last_session:
                memory_fence()
                if ring.get(ring.reader(me, rf.R_MEMBER)) == session:
                    return session
                self._last_session = session  # started before we attached: wait for the next one
            self._check_writer("waiting for a version")
            if deadline.expired:
                raise deadline.error(f"ring {self.name}: reader {me} waiting for the next version")
            backoff.sleep(deadline.remaining())

    def receive(
        self, consumer: BucketConsumer, deadline: Deadline | float | None = rf.DEFAULT_RING_TIMEOUT_S
    ) -> int:
        """Receive the next version into `consumer` within `deadline` (seconds or a `Deadline`;
        None: `DEFAULT_RING_TIMEOUT_S` too; ``math.inf``: no limit); returns the version committed.

        On any error the consumer is aborted (its applied version stays), the writer is told,
        and the error is raised. The consumer's hooks run under this deadline
        (`caller_deadline`): a `SharedBuffer` waits for its readers no longer than the receive.
        """
        deadline = deadline_or(deadline, rf.DEFAULT_RING_TIMEOUT_S)
        with caller_deadline(deadline):
            return self._receive(consumer, deadline)

    def _receive(self, consumer: BucketConsumer, deadline: Deadline) -> int:
        ring, me = self._ring, self.reader_index
        session = self._wait_session(deadline)
        self._last_session = session
        version, base, nbuckets = ring.get(rf.G_S_VERSION), ring.get(rf.G_S_BASE), ring.get(rf.G_S_NBUCKETS)
        try:
            if ring.digest(rf.G_DIGEST) != consumer.layout.digest:
                sender = self._sender_layout_for()
                problem = consumer.layout.diff(sender) or "digests differ"
                name = problem.split("'")[1] if "'" in problem else None
                raise LayoutMismatchError(f"ring {self.name}: receiver layout vs sender: {problem}", name)
            if nbuckets != len(consumer.layout.buckets):
                raise MetadataError(
                    f"ring {self.name}: session has {nbuckets} buckets, layout {len(consumer.layout.buckets)}"
                )
            checksums = bool(ring.get(rf.G_CHECKSUMS))
            consumer.begin(version)
            delta = self._report_base(consumer, session)
            for k in range(nbuckets):
                j = k % ring.num_slots
                seq = base + k + 1
                self._wait_word(
                    ring.slot(j, rf.S_SEQ), seq, session, deadline, f"bucket {k} of version {version}"
                )
                memory_fence()
                data = self._slot_data(consumer, k, j, delta)
                if checksums:
                    expected = ring.get(ring.slot(j, rf.S_CRC))
                    actual = bucket_checksum(data)
                    if actual != expected:
                        raise ChecksumMismatchError(
                            f"ring {self.name}: bucket {k} of version {version} has crc32 {actual:#010x}, "
                            f"sender wrote {expected:#010x}",
                            bucket=k,
                        )
                consumer.consume(k, self._rebuilt_bucket(consumer, k, j, data))
                memory_fence()
                ring.set(ring.reader(me, rf.R_ACK), seq)
            prepare = getattr(consumer, "prepare_commit", None)
            if prepare is not None:  # whatever commit needs, acquired before the writer commits
                prepare(version, deadline)
            self._wait_word(rf.G_COMMIT, session, session, deadline, f"the commit of version {version}")
            consumer.commit(version)
        except BaseException as exc:
            try:
                consumer.abort(exc)
            finally:
                ring.set(ring.reader(me, rf.R_ACK), base + nbuckets)  # release every slot of this session
                ring.set(ring.reader(me, rf.R_RESULT), rf.RESULT_FAILED)
                memory_fence()
                ring.set(ring.reader(me, rf.R_DONE), session)
            raise
        ring.set(ring.reader(me, rf.R_RESULT), rf.RESULT_COMMITTED)
        memory_fence()
        ring.set(ring.reader(me, rf.R_DONE), session)
        return version

    def _report_base(self, consumer: BucketConsumer, session: int) -> bool:
        """Tell the writer whether `consumer` holds the base this session offers; whether it does."""
        ring, me = self._ring, self.reader_index
        offer = ring.get(rf.G_S_OFFER)
        if offer < 0:
            return False
        held = holds_base(consumer, offer)
        ring.set(ring.reader(me, rf.R_HELD), offer if held else -1)
        memory_fence()
        ring.set(ring.reader(me, rf.R_HELD_SESSION), session)
        return held

    def _slot_data(self, consumer: BucketConsumer, k: int, j: int, delta: bool) -> torch.Tensor:
        """The bytes slot `j` holds for bucket `k` (the bucket, or its delta), checked as announced."""
        ring = self._ring
        nbytes, kind = ring.get(ring.slot(j, rf.S_NBYTES)), ring.get(ring.slot(j, rf.S_KIND))
        full = consumer.layout.buckets[k].nbytes
        fits = nbytes == full if kind == 0 else delta and 0 < kind < len(DELTA_KINDS) and 0 < nbytes <= full
        if ring.get(ring.slot(j, rf.S_BUCKET)) != k or not fits:
            raise MetadataError(f"ring {self.name}: slot {j} does not hold bucket {k} as announced")
        return self._slots[j][:nbytes]

    def _rebuilt_bucket(self, consumer: BucketConsumer, k: int, j: int, data: torch.Tensor) -> torch.Tensor:
        """Bucket `k` of the new version: `data` itself, or the delta it holds rebuilt on the
        consumer's base where the full bucket would land, checked against the writer's digest."""
        ring = self._ring
        kind = DELTA_KINDS[ring.get(ring.slot(j, rf.S_KIND))]
        if kind == FULL:
            return data
        nbytes = consumer.layout.buckets[k].nbytes
        digest = rf.word_digest(ring.get(ring.slot(j, rf.S_DIGEST)))
        target = fitting_target(consumer, k, nbytes, self._rebuilder.device)
        return self._rebuilder.rebuild(consumer, k, kind, data, digest, target)

    def _wait_word(self, word: int, value: int, session: int, deadline: Deadline, what: str) -> None:
        ring = self._ring
        backoff = Backoff()
        while ring.get(word) != value:
            if ring.get(rf.G_ABORT) == session:
                raise SyncAbortedError(f"ring {self.name}: the writer aborted while we waited for {what}")
            self._check_writer(f"waiting for {what}")
            if deadline.expired:
                raise deadline.error(f"ring {self.name}: reader {self.reader_index} waiting for {what}")
            backoff.sleep(deadline.remaining())

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the ring (the writer stops waiting for this reader at its next session)."""
        if self._segment.closed:
            return
        ring = self._ring
        ring.set(ring.reader(self.reader_index, rf.R_ATTACHED), 0)
        ring.set(ring.reader(self.reader_index, rf.R_PID), 0)
        self._slots = []
        ring.detach()
        self._segment.close()

    def __enter__(self) -> ShmRingReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
