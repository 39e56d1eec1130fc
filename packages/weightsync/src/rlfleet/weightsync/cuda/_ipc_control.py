"""The control plane of a CUDA IPC channel: its control block, what each word means, the metadata.

One small shared-memory segment per channel:

    control block (`IPC`) | the sender's JSON metadata (backend, slot handles, slot size, layout)

The control block is a `ControlBlock` of shape `IPC` (`_control_block`): header words, a record
per slot (NUM_SLOTS), a record per reader. Writers of a word publish data words first, then
`memory_fence`, then the word a peer polls. A session that offers a delta base (G_OFFER) waits
for every reader to report the base its consumer holds before any slot is written.
"""

from __future__ import annotations

from typing import Any

from rlfleet.weightsync._errors import MetadataError
from rlfleet.weightsync.layout._json import decode_json
from rlfleet.weightsync.layout._layout import MAX_METADATA_BYTES, Layout
from rlfleet.weightsync.shm._control_block import BlockShape, ControlBlock, probe_header
from rlfleet.weightsync.shm._shm import SharedSegment, page_align

__all__ = ["IPC", "ChannelBlock", "decode_meta"]

MAGIC = 0x524C46_495043  # "RLF" "IPC"
#: 2: G_READY, per-slot session words and per-reader R_READING (readers an aborted session left).
#: 3: deltas (G_OFFER, S_KIND, S_DIGEST, R_HELD_SESSION, R_HELD): a slot may hold a bucket's delta.
FORMAT = 3
NUM_SLOTS = 2
MAX_READERS = 1024

# Header words.
G_MAGIC, G_FORMAT, G_WRITER_PID, G_WRITER_START = 0, 1, 2, 3
G_READERS, G_SLOT_BYTES, G_META_LEN, G_META_OFFSET = 4, 5, 6, 7
#: G_SESSION counts the sender's sessions (one per `send`), the generation every other word of
#: a session is tagged with: a session that is not the current one is over. The sender announces
#: a session there first, and publishes its header (version, base, buckets) under G_READY once
#: no reader of an earlier session still reads a slot.
G_SESSION, G_VERSION, G_NBUCKETS, G_BASE = 8, 9, 10, 11
G_COMMIT, G_ABORT, G_CLOSED, G_CHECKSUMS = 12, 13, 14, 15
G_READY = 16
#: G_OFFER: the base version this session's deltas would be against (-1: none, every bucket full).
G_OFFER = 17
SLOT_BASE = 24
SLOT_WORDS = 8
#: S_SEQ: the bucket's global sequence number (monotonic across sessions); S_SESSION: its session.
S_SEQ, S_BUCKET, S_NBYTES, S_CRC, S_SESSION = 0, 1, 2, 3, 4
#: S_KIND: how the bucket travels (its index in `codec.DELTA_KINDS`: 0 full); S_DIGEST: the
#: sender's digest of the bucket's new bytes, which a rebuilt delta must match.
S_KIND, S_DIGEST = 5, 6
READER_WORDS = 16
R_PID, R_START, R_ATTACHED, R_ACK, R_PREPARED, R_RESULT, R_DONE, R_EPOCH = range(8)
#: R_READING: the session whose slots the reader may still be reading (0: none). The sender does
#: not rewrite a slot while a reader of an earlier session has not cleared it.
R_READING = 8
#: R_HELD_SESSION: the session the reader reported its base for; R_HELD: that base (-1: none).
R_HELD_SESSION, R_HELD = 9, 10
RESULT_OK, RESULT_FAILED = 1, 2

KIND = "IPC channel"
IPC = BlockShape(KIND, MAGIC, FORMAT, SLOT_BASE, SLOT_WORDS, READER_WORDS, G_WRITER_PID, G_WRITER_START)


class ChannelBlock(ControlBlock):
    """The control block of one IPC channel: who is attached, who still reads an old session."""

    @classmethod
    def create(
        cls, meta: bytes, num_readers: int, slot_bytes: int, checksums: bool
    ) -> tuple[SharedSegment, ChannelBlock]:
        """A new channel segment holding `meta`; header written, magic last (a reader checks it first)."""
        meta_offset = IPC.control_bytes(NUM_SLOTS, num_readers)
        segment = SharedSegment.create(page_align(meta_offset + len(meta)), prefix="rlfleet-ipc")
        try:
            buf = segment.buffer
            buf[meta_offset : meta_offset + len(meta)] = meta
            block = cls.over(buf, IPC, NUM_SLOTS, num_readers)
            header = {
                G_READERS: num_readers,
                G_SLOT_BYTES: slot_bytes,
                G_META_LEN: len(meta),
                G_META_OFFSET: meta_offset,
                G_CHECKSUMS: int(checksums),
            }
            block.fill(header)
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        return segment, block

    @classmethod
    def of(cls, segment: SharedSegment) -> tuple[ChannelBlock, bytes]:
        """The block at the head of `segment` (any IPC channel's) and the channel's raw metadata;
        MetadataError when the segment is not a consistent IPC channel."""
        first = probe_header(segment, IPC)
        num_readers = int(first[G_READERS])
        meta_offset, meta_len = int(first[G_META_OFFSET]), int(first[G_META_LEN])
        if (
            not 1 <= num_readers <= MAX_READERS
            or meta_offset < IPC.control_bytes(NUM_SLOTS, num_readers)
            or not 0 < meta_len <= MAX_METADATA_BYTES
            or meta_offset + meta_len > segment.size
        ):
            raise MetadataError(f"IPC channel {segment.name!r} has an inconsistent header")
        view = segment.map_region(0, segment.size)
        return cls.over(view, IPC, NUM_SLOTS, num_readers), bytes(view[meta_offset : meta_offset + meta_len])

    def attached(self, i: int) -> bool:
        """Reader `i` has its slots open and its process lives."""
        return bool(self.get(self.reader(i, R_ATTACHED))) and self.reader_alive(i)

    def stragglers(self, session: int) -> list[int]:
        """Live readers that may still read slots for a session before `session`."""
        return [
            i
            for i in range(self.num_readers)
            if 0 < self.get(self.reader(i, R_READING)) < session and self.attached(i)
        ]


def decode_meta(raw: bytes) -> dict[str, Any]:
    """The channel's metadata (backend, handles, slot size, layout); MetadataError if malformed."""
    data = decode_json(raw, "IPC channel metadata")
    if not isinstance(data, dict):
        raise MetadataError("IPC channel metadata must be a JSON object")
    backend = data.get("backend")
    handles = data.get("handles")
    slot_bytes = data.get("slot_bytes")
    if backend not in ("cuda", "host"):
        raise MetadataError(f"IPC channel backend must be 'cuda' or 'host', got {backend!r:.40}")
    if not isinstance(handles, list) or not all(isinstance(h, str) and len(h) <= 512 for h in handles):
        raise MetadataError("IPC channel handles must be a list of short strings")
    if backend == "cuda" and len(handles) != NUM_SLOTS:
        raise MetadataError(f"IPC channel must carry {NUM_SLOTS} CUDA handles, got {len(handles)}")
    if not isinstance(slot_bytes, int) or isinstance(slot_bytes, bool) or not 0 < slot_bytes <= 1 << 44:
        raise MetadataError(f"IPC channel slot_bytes is invalid: {slot_bytes!r:.40}")
    return {
        "backend": backend,
        "handles": handles,
        "slot_bytes": slot_bytes,
        "layout": Layout.from_dict(data.get("layout")),
    }
