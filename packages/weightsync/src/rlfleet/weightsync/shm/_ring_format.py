"""The layout of a ShmRing segment, shared by its sender (`_shm_ring`) and receivers (`_ring_receiver`).

    control block (`RING`) | layout JSON | slot 0 | slot 1 | ... (page-aligned)

Header words: the writer's identity, the ring's geometry, where the layout lies, and the
current session (version, first sequence number, bucket count, commit and abort markers).
A slot record: the sequence number of the bucket it holds, its index, size and CRC32, and in a
delta session how it travels (full, or a delta kind) with the sender's digest of the rebuilt
bucket. A reader record: the reader's identity, whether it is attached, its ack counter, the
sessions it is a member of and has finished (with the outcome), an epoch counting its attaches,
and the base it holds, reported for a session that offers one (`G_S_OFFER`).
"""

from __future__ import annotations

from rlfleet.weightsync.shm._control_block import BlockShape

# Global header words (int64).
G_MAGIC, G_FORMAT, G_WRITER_PID, G_WRITER_START = 0, 1, 2, 3
G_NUM_READERS, G_NUM_SLOTS, G_SLOT_BYTES, G_LAYOUT_LEN = 4, 5, 6, 7
G_CHECKSUMS, G_SESSION, G_S_VERSION, G_S_BASE = 8, 9, 10, 11
G_S_NBUCKETS, G_COMMIT, G_ABORT, G_CLOSED = 12, 13, 14, 15
G_DATA_OFFSET, G_LAYOUT_OFFSET = 16, 17
G_S_OFFER = 18  # the base version a session's deltas would be against (-1: none, all full)
G_DIGEST = 24  # 4 words: the layout digest's 32 raw bytes
SLOT_BASE = 32
SLOT_WORDS = 6
S_SEQ, S_BUCKET, S_NBYTES, S_CRC, S_KIND, S_DIGEST = 0, 1, 2, 3, 4, 5  # kind: index in DELTA_KINDS
READER_WORDS = 10
R_PID, R_START, R_ATTACHED, R_ACK, R_MEMBER, R_DONE, R_RESULT, R_EPOCH = 0, 1, 2, 3, 4, 5, 6, 7
R_HELD_SESSION, R_HELD = 8, 9  # the session a reader reported its base for, and that base (-1: none)
RESULT_COMMITTED, RESULT_FAILED = 1, 2

MAGIC, FORMAT = 0x524C46_52494E47, 2  # "RLF" "RING"
RING = BlockShape("ring", MAGIC, FORMAT, SLOT_BASE, SLOT_WORDS, READER_WORDS, G_WRITER_PID, G_WRITER_START)
MAX_READERS = 4096
MAX_SLOTS = 64
#: What a ring's `send` and `receive` wait by default (None means it too; ``math.inf``: no limit):
#: a receiver whose writer is alive but silent gives up, and a writer whose reader is stuck.
DEFAULT_RING_TIMEOUT_S = 60.0


def digest_word(digest: int) -> int:
    """A 64-bit digest (unsigned) as the int64 word that stores it."""
    return digest - 2**64 if digest >= 2**63 else digest


def word_digest(word: int) -> int:
    """The unsigned digest an int64 word stores."""
    return word + 2**64 if word < 0 else word
