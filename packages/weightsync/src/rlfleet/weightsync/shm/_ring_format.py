"""The layout of a ShmRing segment, shared by its sender (`_shm_ring`) and receivers (`_ring_receiver`).

    control block (`RING`) | layout JSON | slot 0 | slot 1 | ... (page-aligned)

Header words: the writer's identity, the ring's geometry, where the layout lies, and the
current session (version, first sequence number, bucket count, commit and abort markers).
A slot record: the sequence number of the bucket it holds, its index, size and CRC32. A reader
record: the reader's identity, whether it is attached, its ack counter, the sessions it is a
member of and has finished (with the outcome), and an epoch counting its attaches.
"""

from __future__ import annotations

from rlfleet.weightsync.shm._control_block import BlockShape

# Global header words (int64).
G_MAGIC, G_FORMAT, G_WRITER_PID, G_WRITER_START = 0, 1, 2, 3
G_NUM_READERS, G_NUM_SLOTS, G_SLOT_BYTES, G_LAYOUT_LEN = 4, 5, 6, 7
G_CHECKSUMS, G_SESSION, G_S_VERSION, G_S_BASE = 8, 9, 10, 11
G_S_NBUCKETS, G_COMMIT, G_ABORT, G_CLOSED = 12, 13, 14, 15
G_DATA_OFFSET, G_LAYOUT_OFFSET = 16, 17
G_DIGEST = 24  # 4 words: the layout digest's 32 raw bytes
SLOT_BASE = 32
SLOT_WORDS = 4
S_SEQ, S_BUCKET, S_NBYTES, S_CRC = 0, 1, 2, 3
READER_WORDS = 8
R_PID, R_START, R_ATTACHED, R_ACK, R_MEMBER, R_DONE, R_RESULT, R_EPOCH = 0, 1, 2, 3, 4, 5, 6, 7
RESULT_COMMITTED, RESULT_FAILED = 1, 2

MAGIC, FORMAT = 0x524C46_52494E47, 1  # "RLF" "RING"
RING = BlockShape("ring", MAGIC, FORMAT, SLOT_BASE, SLOT_WORDS, READER_WORDS, G_WRITER_PID, G_WRITER_START)
MAX_READERS = 4096
MAX_SLOTS = 64
#: What a ring's `send` and `receive` wait by default (None means it too; ``math.inf``: no limit):
#: a receiver whose writer is alive but silent gives up, and a writer whose reader is stuck.
DEFAULT_RING_TIMEOUT_S = 60.0
