"""The sender's host pass behind a delta: one sweep over a bucket in cache-sized chunks.

The compare reads the bucket and the base from memory once; the rest is done on each chunk
while it is in cache: the 8-byte words that differ are refined into 2-byte words, written into
the base, and the chunk's digest rows are summed. Chunks are shared among the copy threads
(numpy releases the GIL in each call). Before: a pass each for the compare, the gathers, the
base update and the digest, 1.3-1.5x the time here (`benchmarks/delta.py --quick`).

numpy's ``nonzero`` goes branchless once more than a tenth of its input is set (measured: about
0.4 ns an element) and pays a mispredicted branch per hit below that (about 13 ns): with ~2%
of the 2-byte words changed, ~8% of the 8-byte words differ, so the 8-byte mask is padded with
set entries (an eighth of its length) to take the branchless loop, and the padding's hits are
dropped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from rlfleet.weightsync.layout._copy import default_copy_threads, map_threads

__all__ = ["ROW_WORDS", "digest_of_sums", "row_sums", "scan_changes"]

#: int64 words per digest row (4 KiB; a bucket's last partial row is summed on its own).
ROW_WORDS = 512
#: int64 words per chunk: 1 MiB, a multiple of the row (the fastest of 64 KiB to 1 MiB measured:
#: smaller chunks pay numpy's per-call cost more often).
CHUNK_WORDS = 1 << 17
#: Below this fraction of differing 8-byte words numpy's branchy ``nonzero`` is cheaper.
_PAD_FROM = 0.03
_EMPTY_INDEX = np.empty(0, dtype=np.int64)
_EMPTY_VALUES = np.empty(0, dtype=np.int16)

Changes = tuple[np.ndarray, np.ndarray, np.ndarray]


def row_sums(words: np.ndarray) -> np.ndarray:
    """Wrapping int64 sums of each 512-word row of `words` (int64), a partial last row on its own."""
    whole = words.size // ROW_WORDS * ROW_WORDS
    sums: np.ndarray = words[:whole].reshape(-1, ROW_WORDS).sum(1, dtype=np.int64)
    if whole < words.size:
        sums = np.append(sums, words[whole:].sum(dtype=np.int64))
    return sums


def digest_of_sums(sums: Sequence[np.ndarray]) -> int:
    """The 64-bit digest of a bucket from its rows' sums, in order."""
    raw = b"".join(np.ascontiguousarray(s, dtype="<i8").tobytes() for s in sums)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def _chunks(words: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + CHUNK_WORDS, words)) for lo in range(0, words, CHUNK_WORDS)]


def _shares(words: int) -> tuple[list[tuple[int, int]], int]:
    """The chunks of a bucket of `words` int64 words and how many threads share them."""
    chunks = _chunks(words)
    return chunks, max(1, min(default_copy_threads(), len(chunks)))


def _scan_chunk(cur: np.ndarray, base: np.ndarray, lo: int, mask: np.ndarray, update: bool) -> Changes:
    """The changed 2-byte words of one chunk (their bucket indices, int64, and values, int16)
    and the chunk's row sums of `cur`; `base` takes the changes when `update`."""
    n = cur.size
    np.not_equal(cur, base, out=mask[:n])
    count = int(np.count_nonzero(mask[:n]))
    sums = row_sums(cur)  # the chunk is in cache now
    if not count:
        return _EMPTY_INDEX, _EMPTY_VALUES, sums
    if _PAD_FROM * n <= count <= n // 10:
        pad = n // 8
        mask[n : n + pad] = True
        coarse = np.flatnonzero(mask[: n + pad])[:count]
    else:
        coarse = np.flatnonzero(mask[:n])
    new = cur[coarse]
    new16 = new.view(np.int16)
    fine = np.flatnonzero(new16 != base[coarse].view(np.int16))
    if update:
        base[coarse] = new
    index = coarse[fine >> 2]
    index += lo
    index <<= 2
    index += fine & 3
    return index, new16[fine], sums


def scan_changes(cur: np.ndarray, base: np.ndarray, update: bool) -> list[Changes]:
    """Per chunk of `cur` against `base` (int64 words of one bucket): what `_scan_chunk` gives."""
    chunks, threads = _shares(cur.size)

    def share(t: int) -> list[Changes]:
        mask = np.empty(CHUNK_WORDS + CHUNK_WORDS // 8, dtype=np.bool_)
        out = []
        for lo, hi in chunks[t::threads]:
            out.append(_scan_chunk(cur[lo:hi], base[lo:hi], lo, mask, update))
        return out

    per_thread = map_threads(share, threads)
    return [per_thread[i % threads][i // threads] for i in range(len(chunks))]
