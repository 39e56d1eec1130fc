"""The layout of a shared weight buffer's segment (strategy "Shared"), shared by writer and readers.

    control block | layout JSON | CRC table | slot 0 | slot 1 | ...
    (page-aligned data: each slot a flat all-buckets copy of the model, `bucket_starts` order)

Control block (`SlotTable`, a `ControlBlock` of shape `SHARED`): the header says where the
rest lies and who the writer is; each slot record holds (version, state); each reader record
holds the reader's pid and start time, the slot it is bound to (``R_IN_USE``), its version,
the slot it pins while it checks or copies one (``R_PIN``), and the last version it found
corrupted (``R_REFUSED``, checksums on).

A slot goes EMPTY -> WRITING (claimed by the writer) -> COMMITTED (version readable). The
writer claims a slot under the segment's flock, never the one holding the newest version no
live reader refused (a failed write must leave it readable), and only once no live reader is
bound to it or pins it; readers pick and record slots under the same flock.
Commit and abort change one slot's state word without the lock (version first, a fence, then
the state), so they never wait: a reader sees a slot before or after the change, both whole.
"""

from __future__ import annotations

import numpy as np

from rlfleet.weightsync._errors import LayoutMismatchError, MetadataError
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.shm._control_block import BlockShape, ControlBlock, probe_header
from rlfleet.weightsync.shm._shm import PAGE, SharedSegment, memory_fence, page_align

__all__ = ["SHARED", "SegmentPlan", "SlotTable"]

G_MAGIC, G_FORMAT, G_NUM_READERS, G_SLOT_BYTES = 0, 1, 2, 3
G_LAYOUT_LEN, G_LAYOUT_OFFSET, G_DATA_OFFSET, G_WRITER_PID = 4, 5, 6, 7
G_WRITER_START, G_CLOSED, G_CHECKSUMS, G_CRC_OFFSET, G_NUM_BUCKETS = 8, 9, 10, 11, 12
G_NUM_SLOTS = 13
G_DIGEST = 16  # 4 words
SLOT_BASE, SLOT_WORDS = 24, 2
S_VERSION, S_STATE = 0, 1
EMPTY, WRITING, COMMITTED = 0, 1, 2
READER_WORDS = 6
R_PID, R_START, R_IN_USE, R_VERSION, R_PIN, R_REFUSED = 0, 1, 2, 3, 4, 5
MAX_READERS = 4096
MIN_SLOTS, MAX_SLOTS = 2, 3
DEFAULT_TIMEOUT_S = 60.0

MAGIC, FORMAT = 0x524C46_53484152, 3  # "RLF" "SHAR"
KIND = "shared buffer"
SHARED = BlockShape(KIND, MAGIC, FORMAT, SLOT_BASE, SLOT_WORDS, READER_WORDS, G_WRITER_PID, G_WRITER_START)


class SegmentPlan:
    """Byte offsets of every part of a shared buffer's segment."""

    def __init__(self, layout_len: int, num_buckets: int, slot_bytes: int, num_slots: int, num_readers: int):
        self.num_slots, self.num_readers, self.num_buckets = num_slots, num_readers, num_buckets
        self.slot_bytes, self.layout_len = slot_bytes, layout_len
        self.layout_offset = SHARED.control_bytes(num_slots, num_readers)
        self.crc_offset = (self.layout_offset + layout_len + 63) // 64 * 64
        self.data_offset = page_align(self.crc_offset + 8 * num_slots * num_buckets)
        self.size = self.data_offset + num_slots * slot_bytes

    @classmethod
    def for_layout(cls, layout: Layout, layout_len: int, num_slots: int, num_readers: int) -> SegmentPlan:
        slot_bytes = max(PAGE, page_align(layout.padded_bytes))
        return cls(layout_len, len(layout.buckets), slot_bytes, num_slots, num_readers)

    def header(self, checksums: bool) -> dict[int, int]:
        """The header words that describe this plan (`ControlBlock.fill`)."""
        return {
            G_NUM_READERS: self.num_readers,
            G_NUM_SLOTS: self.num_slots,
            G_SLOT_BYTES: self.slot_bytes,
            G_LAYOUT_LEN: self.layout_len,
            G_LAYOUT_OFFSET: self.layout_offset,
            G_DATA_OFFSET: self.data_offset,
            G_CRC_OFFSET: self.crc_offset,
            G_NUM_BUCKETS: self.num_buckets,
            G_CHECKSUMS: int(checksums),
        }

    @classmethod
    def from_header(cls, header: np.ndarray, segment: SharedSegment) -> SegmentPlan:
        """The plan a writer recorded, checked against the segment (MetadataError if it does not fit)."""
        fields = (G_LAYOUT_LEN, G_NUM_BUCKETS, G_SLOT_BYTES, G_NUM_SLOTS, G_NUM_READERS)
        layout_len, num_buckets, slot_bytes, num_slots, num_readers = (int(header[f]) for f in fields)
        inconsistent = MetadataError(f"shared buffer {segment.name!r} has an inconsistent header")
        if (
            not 1 <= num_readers <= MAX_READERS
            or not MIN_SLOTS <= num_slots <= MAX_SLOTS
            or not 0 <= num_buckets <= segment.size
            or not 0 < layout_len <= segment.size
            or slot_bytes < PAGE
            or slot_bytes % PAGE
        ):
            raise inconsistent
        plan = cls(layout_len, num_buckets, slot_bytes, num_slots, num_readers)
        recorded = (int(header[G_LAYOUT_OFFSET]), int(header[G_CRC_OFFSET]), int(header[G_DATA_OFFSET]))
        if recorded != (plan.layout_offset, plan.crc_offset, plan.data_offset) or plan.size != segment.size:
            raise inconsistent
        return plan


class SlotTable(ControlBlock):
    """A shared buffer's control block: which slot holds which version, and who reads which."""

    @classmethod
    def of(cls, segment: SharedSegment) -> tuple[SlotTable, SegmentPlan, memoryview]:
        """The table at the head of `segment` (any shared buffer's), its segment plan, and a
        mapping of everything before the slots (table, layout JSON, CRC table)."""
        plan = SegmentPlan.from_header(probe_header(segment, SHARED), segment)
        control = segment.map_region(0, plan.data_offset)
        return cls.over(control, SHARED, plan.num_slots, plan.num_readers), plan, control

    def state(self, j: int) -> int:
        return self.get(self.slot(j, S_STATE))

    def version(self, j: int) -> int:
        return self.get(self.slot(j, S_VERSION))

    def committed(self) -> list[tuple[int, int]]:
        """(version, slot) of every committed slot; a version read after its slot's state."""
        states = [self.state(j) for j in range(self.num_slots)]
        memory_fence()  # the writer stores the version before the state: read them the other way
        return [(self.version(j), j) for j in range(self.num_slots) if states[j] == COMMITTED]

    def newest(self) -> int | None:
        """The committed slot with the highest version (None before the first commit)."""
        committed = self.committed()
        return max(committed)[1] if committed else None

    def newest_version(self) -> int:
        """The newest committed version (-1 if none)."""
        committed = self.committed()
        return max(committed)[0] if committed else -1

    def slot_holding(self, version: int) -> int | None:
        """The committed slot whose version is exactly `version`, if any."""
        return next((j for v, j in self.committed() if v == version), None)

    def reader_on(self, slot: int) -> int | None:
        """A live reader bound to `slot`, or pinning it to check or copy it."""
        for i in range(self.num_readers):
            uses = (self.get(self.reader(i, R_IN_USE)), self.get(self.reader(i, R_PIN)))
            if slot in uses and self.reader_alive(i):
                return i
        return None

    def refused(self, version: int) -> bool:
        """Whether a live reader found `version` corrupted (its checksum failed)."""
        readers = range(self.num_readers)
        return any(self.get(self.reader(i, R_REFUSED)) == version and self.reader_alive(i) for i in readers)

    def slot_to_write(self) -> int:
        """The slot the next version goes to.

        Never the one holding the newest version no live reader refused (a failed write must
        leave it readable); one no live reader uses if there is one, else the one to wait for;
        an empty slot before a committed one, an older version before a newer one.
        """
        trusted = [(v, j) for v, j in self.committed() if not self.refused(v)]
        keep = max(trusted)[1] if trusted else None
        candidates = [j for j in range(self.num_slots) if j != keep]
        free = [j for j in candidates if self.reader_on(j) is None]
        return min(free or candidates, key=lambda j: (self.state(j) == COMMITTED, self.version(j)))


def require_writer_layout(mine: Layout, writer: Layout, what: str) -> None:
    """LayoutMismatchError naming the first differing parameter, unless the digests agree; it
    says how to get the writer's layout (a reader's `layout`), the usual cause being a buffer
    built from a model alone, with the default bucket size."""
    found = mine.difference(writer)
    if found is not None:
        param, problem = found
        raise LayoutMismatchError(
            f"{what} layout vs writer: {problem}; build it with the writer's "
            f"layout (SharedBufferReader.layout, or Layout.from_dict of the writer's "
            f"layout.to_dict()), or with bucket_bytes={writer.bucket_bytes}",
            param,
        )
