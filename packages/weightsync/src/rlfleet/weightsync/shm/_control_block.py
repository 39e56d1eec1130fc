"""Control blocks: the int64 words at the head of a segment that one writer and its readers share.

Every shared-memory channel (ShmRing, SharedBuffer; CUDA IPC's channel has the same shape) lays
its control words out the same way:

    header words  | num_slots slot records | num_readers reader records
    [0, header)   | slot_words each        | reader_words each

The header starts with a magic number and a format (word 0 and 1 unless the shape says
otherwise) and holds the writer's pid and start time; a reader record starts with the
reader's pid and start time. Those are what every channel checks (is this our kind of segment,
is the writer alive, is reader i alive); the rest of the words mean what the channel says.
`BlockShape` is that description, `ControlBlock` the accessors over the words, written once.

A word is written by one side only (header and slots by the writer, a reader record by its
reader); publication is "write the payload, `memory_fence`, write the word that announces it".
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+

from rlfleet.weightsync._errors import MetadataError
from rlfleet.weightsync.shm._shm import PAGE, SharedSegment, memory_fence, process_alive, process_identity

__all__ = ["INT64_MAX", "BlockShape", "ControlBlock", "Every", "probe_header", "require_int_in"]

INT64_MAX = 2**63 - 1
DIGEST_WORDS = 4  # a layout digest's 32 raw bytes


@dataclass(frozen=True)
class BlockShape:
    """Where the words of one kind of control block are (sizes in int64 words).

    A channel declares its shape once, e.g. ``BlockShape("ring", MAGIC, FORMAT, SLOT_BASE,
    SLOT_WORDS, READER_WORDS, G_WRITER_PID, G_WRITER_START)``.
    """

    kind: str  # what the segment is, for errors ("ring", "shared buffer")
    magic: int
    format: int
    header_words: int  # the first slot record starts here
    slot_words: int
    reader_words: int
    writer_pid: int  # header words with the writer's identity
    writer_start: int
    magic_word: int = 0
    format_word: int = 1
    reader_pid: int = 0  # fields of a reader record
    reader_start: int = 1

    def words(self, num_slots: int, num_readers: int) -> int:
        """Words of a block with that many slots and readers."""
        return self.header_words + self.slot_words * num_slots + self.reader_words * num_readers

    def control_bytes(self, num_slots: int, num_readers: int) -> int:
        """Bytes of the words, rounded up to a cache line (what follows starts on its own line)."""
        return (self.words(num_slots, num_readers) * 8 + 63) // 64 * 64


class ControlBlock:
    """Typed access to a control block's words (an int64 view of the segment's first bytes)."""

    def __init__(self, words: np.ndarray, shape: BlockShape, num_slots: int, num_readers: int) -> None:
        self.h = words
        self.shape = shape
        self.num_slots = num_slots
        self.num_readers = num_readers
        self._readers_at = shape.header_words + shape.slot_words * num_slots

    @classmethod
    def over(cls, buffer: memoryview, shape: BlockShape, num_slots: int, num_readers: int) -> Self:
        """The block at the start of `buffer` (a mapping of the segment)."""
        words = np.frombuffer(buffer, dtype=np.int64, count=shape.words(num_slots, num_readers))
        return cls(words, shape, num_slots, num_readers)

    # -- words ------------------------------------------------------------------------------
    def get(self, word: int) -> int:
        return int(self.h[word])

    def set(self, word: int, value: int) -> None:
        if not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise MetadataError(
                f"{self.shape.kind}: value {value} does not fit control word {word} (64-bit signed)"
            )
        self.h[word] = value

    def slot(self, j: int, field: int) -> int:
        """Word index of `field` of slot record `j`."""
        return self.shape.header_words + self.shape.slot_words * j + field

    def reader(self, i: int, field: int) -> int:
        """Word index of `field` of reader record `i`."""
        return self._readers_at + self.shape.reader_words * i + field

    def fill(self, values: Mapping[int, int]) -> None:
        """Write header words, then the writer's identity, then (after a fence) the magic number:
        a reader that sees the magic sees everything else."""
        pid, start = process_identity()
        for word, value in {**values, self.shape.writer_pid: pid, self.shape.writer_start: start}.items():
            self.set(word, value)
        self.set(self.shape.format_word, self.shape.format)
        memory_fence()
        self.set(self.shape.magic_word, self.shape.magic)

    def digest(self, word: int) -> str:
        """The layout digest stored at `word` (hex)."""
        return bytes(self.h[word : word + DIGEST_WORDS].view(np.uint8)).hex()

    def set_digest(self, word: int, digest: str) -> None:
        self.h[word : word + DIGEST_WORDS] = np.frombuffer(bytes.fromhex(digest), dtype=np.int64)

    def detach(self) -> None:
        """Stop pointing into the mapping (later reads see zeros, never unmapped memory)."""
        self.h = np.zeros(self.shape.words(self.num_slots, self.num_readers), dtype=np.int64)

    # -- liveness ---------------------------------------------------------------------------
    def reader_alive(self, i: int) -> bool:
        pid, start = self.reader(i, self.shape.reader_pid), self.reader(i, self.shape.reader_start)
        return process_alive(self.get(pid), self.get(start))

    def writer_alive(self) -> bool:
        return process_alive(self.get(self.shape.writer_pid), self.get(self.shape.writer_start))

    def claim_reader(self, i: int) -> None:
        """Write this process's identity into reader record `i`."""
        pid, start = process_identity()
        self.set(self.reader(i, self.shape.reader_start), start)
        self.set(self.reader(i, self.shape.reader_pid), pid)


def probe_header(segment: SharedSegment, shape: BlockShape) -> np.ndarray:
    """A copy of the header words of `segment`, checked to be `shape`'s kind and format.

    Read from a one-page mapping, before the whole control block (whose size the header says)
    is mapped; MetadataError when the segment is something else.
    """
    if segment.size < PAGE:
        raise MetadataError(f"{segment.name!r} is too small to be an rlfleet {shape.kind}")
    view = segment.map_region(0, PAGE)
    header: np.ndarray = np.frombuffer(view, dtype=np.int64, count=shape.header_words).copy()
    if header[shape.magic_word] != shape.magic or header[shape.format_word] != shape.format:
        raise MetadataError(f"{segment.name!r} is not an rlfleet {shape.kind} of format {shape.format}")
    return header


def require_int_in(what: str, value: object, low: int, high: int) -> None:
    """ValueError unless `value` is an int (not a bool) in [low, high]: a channel's reader or slot
    count, checked before any word is sized by it."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an int in [{low}, {high}], got {value!r}")


class Every:
    """Rate limit for liveness probes (each reads /proc): `due()` is true once per `period_s`."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.period_s
        return True
