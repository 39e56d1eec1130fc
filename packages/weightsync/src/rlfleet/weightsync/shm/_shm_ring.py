"""ShmRing: one writer, many readers, buckets through a ring of shared-memory slots (one node).

The writer packs bucket k straight into slot ``k % slots`` once every reader has acknowledged
the bucket that slot held before, then publishes the slot's sequence number; readers hand each
slot to their `BucketConsumer` and acknowledge it. With two or more slots the writer packs
bucket k+1 while readers consume bucket k. A control header in the same segment carries
everything a reader needs to check and a writer needs to wait safely:

- the sender's layout (JSON) and its digest, so a receiver with another layout fails before
  applying anything, naming the first differing parameter;
- per-slot sequence numbers (and CRC32 when checksums are on);
- per-reader pid + start time (liveness), ack counter, membership and outcome of each session;
- the writer's pid + start time, the session (one per version), commit and abort markers.

With ``delta="auto"`` the writer keeps a base (`codec.DeltaEncoder`: the last version it
published, one host copy in the wire dtype) and offers it with each session: every member
reports whether its consumer holds that version (`codec.holds_base`), and when all do, each
slot carries the bucket's delta (its kind, size and the digest of the rebuilt bucket in the slot
record) instead of its bytes. A reader rebuilds it where the full bucket would land (the
consumer's landing zone, else a bucket buffer) and checks the digest before consuming it; a
reader that lacks the base makes the version go full for every reader (a slot is read by all).
Readers commit one by one, as ever: a reader whose rebuild fails keeps its version, and its
next version goes full (it reports another base).

Publication is "write the data, memory fence, write the sequence number"; waits poll with a
short backoff (20 us growing to 1 ms) under a `Deadline`, and check the peer's liveness, so a
dead peer becomes `PeerLostError` and a stuck one `SyncTimeoutError`, never a hang. `send` and
`receive` wait `DEFAULT_RING_TIMEOUT_S` (60 s) by default, None included (a receiver whose writer
is alive but silent gives up); ``math.inf`` is no limit.
The control words are a `ControlBlock` of shape `RING` (`_control_block`).
"""

from __future__ import annotations

import logging

import torch

from rlfleet.weightsync._deadline import Backoff, Deadline, deadline_or
from rlfleet.weightsync._errors import PeerLostError, WeightSyncError
from rlfleet.weightsync.codec._delta import DEFAULT_MAX_FRACTION, DELTA_KINDS, FULL
from rlfleet.weightsync.codec._delta_state import DeltaEncoder, check_delta_mode
from rlfleet.weightsync.layout._integrity import bucket_checksum
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import pack_bucket
from rlfleet.weightsync.protocol._stream import (
    Source,
    StreamCursor,
    Weights,
    drain_on_error,
    fill_bucket,
    open_source,
)
from rlfleet.weightsync.shm._control_block import INT64_MAX, ControlBlock, Every, require_int_in
from rlfleet.weightsync.shm._ring_format import (
    DEFAULT_RING_TIMEOUT_S,
    G_ABORT,
    G_CHECKSUMS,
    G_CLOSED,
    G_COMMIT,
    G_DATA_OFFSET,
    G_DIGEST,
    G_LAYOUT_LEN,
    G_LAYOUT_OFFSET,
    G_NUM_READERS,
    G_NUM_SLOTS,
    G_S_BASE,
    G_S_NBUCKETS,
    G_S_OFFER,
    G_S_VERSION,
    G_SESSION,
    G_SLOT_BYTES,
    MAX_READERS,
    MAX_SLOTS,
    R_ACK,
    R_ATTACHED,
    R_DONE,
    R_EPOCH,
    R_HELD,
    R_HELD_SESSION,
    R_MEMBER,
    R_PID,
    R_RESULT,
    R_START,
    RESULT_COMMITTED,
    RING,
    S_BUCKET,
    S_CRC,
    S_DIGEST,
    S_KIND,
    S_NBYTES,
    S_SEQ,
    digest_word,
)
from rlfleet.weightsync.shm._ring_receiver import ShmRingReceiver
from rlfleet.weightsync.shm._shm import PAGE, SharedSegment, memory_fence, page_align

__all__ = ["ShmRingReceiver", "ShmRingSender"]

_log = logging.getLogger(__name__)


class ShmRingSender:
    """The writer of a ring: `send(state_dict, version)` once per version, to `num_readers` readers.

    Readers attach with `ShmRingReceiver.attach(sender.name, reader_index)`. A reader that
    dies makes `send` raise PeerLostError naming it, or, with ``drop_dead_readers=True``, the
    sync goes on without it. `checksums=True` adds a CRC32 per bucket that readers verify.
    ``delta="auto"`` sends a version as its delta from the last one when every reader holds
    that (see the module; `delta.last` says what the last version sent, `last_full_readers`
    which readers lacked the base); ``delta_max_fraction``: a bucket whose delta is not smaller
    than that fraction of it goes full.
    """

    #: Readers that lacked the offered base in the last session (the version then went full).
    last_full_readers: tuple[int, ...] = ()

    def __init__(
        self,
        layout: Layout,
        num_readers: int,
        slots: int = 2,
        checksums: bool = False,
        drop_dead_readers: bool = False,
        prefix: str = "rlfleet",
        *,
        delta: str = "off",
        delta_max_fraction: float = DEFAULT_MAX_FRACTION,
    ) -> None:
        require_int_in("num_readers", num_readers, 1, MAX_READERS)
        require_int_in("slots", slots, 2, MAX_SLOTS)
        #: The base and per-bucket delta choice (None: ``delta="off"``, every version full).
        self.delta: DeltaEncoder | None = (
            None if check_delta_mode(delta) == "off" else DeltaEncoder(layout, delta, delta_max_fraction)
        )
        self.layout = layout
        self.num_readers = num_readers
        self.num_slots = slots
        self.checksums = checksums
        self.drop_dead_readers = drop_dead_readers
        layout_json = layout.to_json()
        layout_offset = RING.control_bytes(slots, num_readers)
        data_offset = page_align(layout_offset + len(layout_json))
        self.slot_bytes = max(PAGE, page_align(layout.max_bucket_nbytes))
        self._segment = SharedSegment.create(data_offset + slots * self.slot_bytes, prefix=prefix)
        buf = self._segment.buffer
        self._ring = ControlBlock.over(buf, RING, slots, num_readers)
        buf[layout_offset : layout_offset + len(layout_json)] = layout_json
        self._ring.set_digest(G_DIGEST, layout.digest)
        header = {
            G_NUM_READERS: num_readers,
            G_NUM_SLOTS: slots,
            G_SLOT_BYTES: self.slot_bytes,
            G_LAYOUT_LEN: len(layout_json),
            G_LAYOUT_OFFSET: layout_offset,
            G_DATA_OFFSET: data_offset,
            G_CHECKSUMS: int(checksums),
        }
        self._ring.fill(header)
        self._slots = [
            self._segment.tensor(data_offset + j * self.slot_bytes, self.slot_bytes) for j in range(slots)
        ]
        self._published = 0  # global sequence number of the last bucket published
        self._session = 0
        self._previous: dict[int, tuple[int, int, int]] = {}  # last session's members: identity
        self._ever_attached: set[int] = set()
        self._liveness = Every()

    @property
    def name(self) -> str:
        """The segment name to hand to readers (not a secret that grants access: mode 0600 does)."""
        return self._segment.name

    @property
    def session(self) -> int:
        return self._session

    # -- sending --------------------------------------------------------------------------
    def _check_readers(self, members: set[int], what: str, session: int) -> None:
        """PeerLostError for a dead member, or drop it when allowed.

        A member that already finished this session (committed or failed) may leave freely.
        """
        if not self._liveness.due():
            return
        for i in sorted(members):
            if self._ring.get(self._ring.reader(i, R_DONE)) == session:
                continue
            if not self._ring.reader_alive(i):
                memory_fence()  # a reader marks the session done, then leaves: look again
                if self._ring.get(self._ring.reader(i, R_DONE)) == session:
                    continue
                pid = self._ring.get(self._ring.reader(i, R_PID))
                if not self.drop_dead_readers:
                    raise PeerLostError(f"ring {self.name}: reader {i} (pid {pid}) died or left while {what}")
                _log.warning("ring %s: reader %d (pid %d) died; continuing without it", self.name, i, pid)
                members.discard(i)

    def _wait_attached(self, deadline: Deadline) -> set[int]:
        """Every reader attached and alive; one that was here and is gone is lost (or dropped)."""
        ring = self._ring
        backoff = Backoff()
        while True:
            members: set[int] = set()
            absent: list[int] = []
            for i in range(self.num_readers):
                attached = bool(ring.get(ring.reader(i, R_ATTACHED)))
                if attached and ring.reader_alive(i):
                    members.add(i)
                    self._ever_attached.add(i)
                elif attached or i in self._ever_attached:
                    if not self.drop_dead_readers:
                        pid = ring.get(ring.reader(i, R_PID))
                        raise PeerLostError(f"ring {self.name}: reader {i} (pid {pid}) died or left")
                else:
                    absent.append(i)
            if not absent:
                break
            if deadline.expired:
                raise deadline.error(f"ring {self.name}: waiting for reader {absent[0]} to attach")
            backoff.sleep(deadline.remaining())
        if not members:
            raise PeerLostError(f"ring {self.name}: every reader is dead or gone")
        return members

    def send(
        self,
        weights: Weights,
        version: int,
        deadline: Deadline | float | None = DEFAULT_RING_TIMEOUT_S,
        wait_for_readers: bool = True,
    ) -> dict[int, str]:
        """Send `weights` as `version` to every attached reader, within `deadline` (seconds or a
        `Deadline`; None: `DEFAULT_RING_TIMEOUT_S` too; ``math.inf``: no limit).

        `weights` is a state dict or a `WeightStream` (pairs in the layout's order, each packed
        straight into its slot; drained after a failure). Returns each reader's outcome
        (``"committed"``, ``"failed"`` or ``"dropped"``) when `wait_for_readers`; else returns
        once everything is published (the next `send` waits for slots as needed). Any error
        aborts the session for every reader.
        """
        deadline = deadline_or(deadline, DEFAULT_RING_TIMEOUT_S)
        source = open_source(weights, self.layout)
        with drain_on_error(source, deadline):
            if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= INT64_MAX:
                raise ValueError(f"version must be an int in [0, 2**63 - 1], got {version!r}")
            if self._ring.get(G_CLOSED):
                raise WeightSyncError(f"ring {self.name} is closed")
            if not isinstance(source, StreamCursor):
                self.layout.check_state_dict(source, sending=True)
            return self._send(source, version, deadline, wait_for_readers)

    def _send(
        self, source: Source, version: int, deadline: Deadline, wait_for_readers: bool
    ) -> dict[int, str]:
        members = self._wait_attached(deadline)
        ring = self._ring
        session = self._session + 1
        base = self._published
        nbuckets = len(self.layout.buckets)
        # Readers (or new processes at a reader index) that were not in the previous session never
        # acked its slots: count them as caught up.
        identity = {i: self._reader_identity(i) for i in members}
        floor = {i: (0 if self._previous.get(i) == identity[i] else base) for i in members}
        self._session = session
        self._published = base + nbuckets
        offer = None if self.delta is None else self.delta.offer()
        for i in members:
            ring.set(ring.reader(i, R_MEMBER), session)
        ring.set(G_S_VERSION, version)
        ring.set(G_S_BASE, base)
        ring.set(G_S_NBUCKETS, nbuckets)
        ring.set(G_S_OFFER, -1 if offer is None else offer)
        memory_fence()
        ring.set(G_SESSION, session)
        committed = False
        try:
            lacking = [] if offer is None else self._wait_reports(members, session, offer, deadline)
            self.last_full_readers = tuple(lacking)
            delta = offer is not None and not lacking
            if self.delta is not None:
                self.delta.start(version, delta)
            for k in range(nbuckets):
                j = k % self.num_slots
                previous = ring.get(ring.slot(j, S_SEQ))
                self._wait_slot_free(j, previous, members, floor, session, deadline)
                data = self._pack(source, k, j, last=k == nbuckets - 1)
                data = self._encoded(k, j, data, delta)
                ring.set(ring.slot(j, S_BUCKET), k)
                ring.set(ring.slot(j, S_NBYTES), data.numel())
                if self.checksums:
                    ring.set(ring.slot(j, S_CRC), bucket_checksum(data))
                memory_fence()
                ring.set(ring.slot(j, S_SEQ), base + k + 1)
            memory_fence()
            ring.set(G_COMMIT, session)
            committed = True  # every bucket is out: the base is this version, whoever commits it
            outcomes = self._wait_done(members, session, deadline) if wait_for_readers else {}
        except BaseException:
            ring.set(G_ABORT, session)
            raise
        finally:
            self._previous = {i: identity[i] for i in members}
            if self.delta is not None:
                self.delta.finish(version, committed)
        return outcomes

    def _encoded(self, k: int, j: int, data: torch.Tensor, delta: bool) -> torch.Tensor:
        """Bucket `k`, packed in slot `j`, as it travels: its delta written over it when that is
        smaller (the slot record says which, with the digest of the bucket's new bytes)."""
        if self.delta is None:
            return data
        payload = self.delta.encode(k, data, delta)
        if payload.kind != FULL:
            data = self._slots[j][: payload.nbytes]
            data.copy_(payload.data)
        self._ring.set(self._ring.slot(j, S_KIND), DELTA_KINDS.index(payload.kind))
        self._ring.set(self._ring.slot(j, S_DIGEST), digest_word(payload.digest))
        return data

    def _wait_reports(self, members: set[int], session: int, offer: int, deadline: Deadline) -> list[int]:
        """Every member's report of the base it holds for `session`; the readers that lack `offer`
        (one that finished the session before reporting, having failed, lacks it)."""
        ring = self._ring
        pending, lacking = set(members), []
        backoff = Backoff()
        while True:
            for i in sorted(pending):
                if ring.get(ring.reader(i, R_HELD_SESSION)) == session:
                    memory_fence()
                    if ring.get(ring.reader(i, R_HELD)) != offer:
                        lacking.append(i)
                    pending.discard(i)
                elif ring.get(ring.reader(i, R_DONE)) == session:
                    lacking.append(i)
                    pending.discard(i)
            if not pending:
                return sorted(lacking)
            alive = set(pending)
            self._check_readers(alive, "the readers reported their base", session)
            members -= pending - alive  # dropped (drop_dead_readers): gone from the session
            pending &= alive
            if deadline.expired:
                raise deadline.error(
                    f"ring {self.name}: waiting for reader {min(pending)} to report its base"
                )
            backoff.sleep(deadline.remaining())

    def _pack(self, source: Source, k: int, j: int, last: bool) -> torch.Tensor:
        """Bucket `k` written into slot `j`; returns its bytes there."""
        if not isinstance(source, StreamCursor):
            return pack_bucket(self.layout, k, source, self._slots[j])
        fill_bucket(source, k, self._slots[j])
        if last:
            source.finish()  # nothing may follow the last tensor
        return self._slots[j][: self.layout.buckets[k].nbytes]

    def _reader_identity(self, i: int) -> tuple[int, int, int]:
        ring = self._ring
        pid, start, epoch = (ring.get(ring.reader(i, field)) for field in (R_PID, R_START, R_EPOCH))
        return pid, start, epoch

    def _wait_slot_free(
        self,
        j: int,
        previous: int,
        members: set[int],
        floor: dict[int, int],
        session: int,
        deadline: Deadline,
    ) -> None:
        ring = self._ring

        def lagging() -> int | None:
            for i in members:
                if max(ring.get(ring.reader(i, R_ACK)), floor[i]) < previous:
                    return i
            return None

        backoff = Backoff()
        while (slow := lagging()) is not None:
            self._check_readers(members, f"slot {j} waited for its ack", session)
            if deadline.expired:
                raise deadline.error(
                    f"ring {self.name}: waiting for reader {slow} to release slot {j} (session {session})"
                )
            backoff.sleep(deadline.remaining())

    def _wait_done(self, members: set[int], session: int, deadline: Deadline) -> dict[int, str]:
        ring = self._ring
        outcomes = dict.fromkeys(range(self.num_readers), "dropped")
        pending = set(members)
        backoff = Backoff()
        while pending:
            for i in list(pending):
                if ring.get(ring.reader(i, R_DONE)) == session:
                    result = ring.get(ring.reader(i, R_RESULT))
                    outcomes[i] = "committed" if result == RESULT_COMMITTED else "failed"
                    pending.discard(i)
            if not pending:
                break
            alive = set(pending)
            self._check_readers(alive, "the version was committing", session)
            pending &= alive
            if deadline.expired:
                raise deadline.error(f"ring {self.name}: waiting for reader {min(pending)} to commit")
            backoff.sleep(deadline.remaining())
        return outcomes

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Tell readers the ring is gone, unmap and unlink it."""
        if self._segment.closed:
            return
        self._ring.set(G_CLOSED, 1)
        self._slots = []
        self._ring.detach()
        self._segment.close()
        self._segment.unlink()

    def __enter__(self) -> ShmRingSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
