"""The host passes behind a delta: the sender's sweep over a bucket and the receiver's apply
and check, each in cache-sized chunks shared among the copy threads.

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

With numba installed both passes run compiled loops per 4 KiB row instead (`_delta_kernels`),
one call per copy thread over a contiguous share of the bucket: the sender's writes into pooled
scratch that the payload is written from, a receiver's copies each run of rows one base piece
covers (the consumer's `base_pieces`) in the same pass; the bytes and the digests are the same.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from rlfleet.weightsync._errors import MetadataError
from rlfleet.weightsync.codec._delta_kernels import ROW_WORDS, Kernels, kernels
from rlfleet.weightsync.layout._copy import default_copy_threads, map_threads

__all__ = [
    "ROW_WORDS",
    "BaseFiller",
    "BasePieces",
    "apply_changes",
    "base_filler",
    "digest_of_sums",
    "native_codec",
    "row_sums",
    "scan_changes",
]

#: int64 words per chunk: 1 MiB, a multiple of the row (the fastest of 64 KiB to 1 MiB measured:
#: smaller chunks pay numpy's per-call cost more often).
CHUNK_WORDS = 1 << 17
_ROW_BYTES = 8 * ROW_WORDS
#: Below this fraction of differing 8-byte words numpy's branchy ``nonzero`` is cheaper.
_PAD_FROM = 0.03
_EMPTY_INDEX = np.empty(0, dtype=np.int64)
_EMPTY_VALUES = np.empty(0, dtype=np.int16)

Changes = tuple[np.ndarray, np.ndarray, np.ndarray]
#: Byte ranges of a bucket in order, each with the base's int64 words to copy, or None to fill.
Runs = list[tuple[int, int, np.ndarray | None]]
#: A base bucket as (byte offset, flat uint8 host tensor) pieces; bytes no piece covers are zero.
BasePieces = Sequence[tuple[int, torch.Tensor]]


def native_codec() -> bool:
    """Whether the delta codec's host passes run compiled (numba installed, the ``native``
    extra, and not disabled by ``RLFLEET_DELTA_NATIVE=0``) or through numpy."""
    return kernels() is not None


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


def _shares(words: int, chunk: int = CHUNK_WORDS) -> tuple[list[tuple[int, int]], int]:
    """The chunks of a bucket of `words` int64 words and how many threads share them."""
    chunks = [(lo, min(lo + chunk, words)) for lo in range(0, words, chunk)]
    return chunks, max(1, min(default_copy_threads(), len(chunks)))


def _even_shares(words: int) -> list[tuple[int, int]]:
    """A bucket of `words` int64 words as one contiguous share of whole rows per copy thread:
    what the compiled loops take, one call each (they stream the rows themselves)."""
    rows = -(-words // ROW_WORDS)
    per = -(-rows // max(1, min(default_copy_threads(), rows))) * ROW_WORDS
    return [(lo, min(lo + per, words)) for lo in range(0, words, per)]


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


#: Scratch kept for the next sweep only while this small (2% changed of a 64 MiB bucket is
#: ~4 MiB): a sweep that found most words changed gives its touched pages back.
_KEEP_BYTES = 8 << 20
_POOLED = 8
Scratch = tuple[np.ndarray, np.ndarray]
_pool: list[Scratch] = []
_pool_lock = threading.Lock()


def _take(lanes: int) -> Scratch:
    """Output buffers for `lanes` changes (index int32, values int16): pooled, as their touched
    pages would cost a page fault each on every fresh allocation."""
    with _pool_lock:
        for i, (index, _) in enumerate(_pool):
            if index.size >= lanes:
                return _pool.pop(i)
    return np.empty(lanes, np.int32), np.empty(lanes, np.int16)


def _give(scratch: Scratch, used: int) -> None:
    if 6 * used <= _KEEP_BYTES:
        with _pool_lock:
            if len(_pool) < _POOLED:
                _pool.append(scratch)


def _native_scan(
    compiled: Kernels, scratch: Scratch, cur: np.ndarray, base: np.ndarray, lo: int, update: bool
) -> tuple[list[Changes], int]:
    """`_scan_chunk`'s result for the share at word `lo` (its whole rows by the compiled loop
    into `scratch`, views returned; indices as int32: a delta's bucket has fewer than 2**31
    words), a partial last row as a piece of its own, and the scratch lanes written."""
    index_out, values_out = scratch
    whole = cur.size // ROW_WORDS * ROW_WORDS
    sums = np.empty(whole // ROW_WORDS, dtype=np.int64)
    count = compiled.scan_rows(cur[:whole], base[:whole], update, 4 * lo, index_out, values_out, sums)
    pieces = [(index_out[:count], values_out[:count], sums)]
    if whole < cur.size:
        tail = cur.size - whole
        mask = np.empty(tail + tail // 8 + 1, dtype=np.bool_)
        pieces.append(_scan_chunk(cur[whole:], base[whole:], lo + whole, mask, update))
    return pieces, count


@contextlib.contextmanager
def scan_changes(cur: np.ndarray, base: np.ndarray, update: bool) -> Iterator[list[Changes]]:
    """Pieces of `cur` against `base` (int64 words of one bucket) in order, as `_scan_chunk`
    gives them; valid inside the ``with`` only (compiled, they are views of pooled scratch,
    written into the payload without a copy of their own)."""
    compiled = kernels()
    if compiled is None:
        chunks, threads = _shares(cur.size)

        def numpy_share(t: int) -> list[Changes]:
            mask = np.empty(CHUNK_WORDS + CHUNK_WORDS // 8, dtype=np.bool_)
            return [_scan_chunk(cur[lo:hi], base[lo:hi], lo, mask, update) for lo, hi in chunks[t::threads]]

        per_thread = map_threads(numpy_share, threads)
        yield [per_thread[i % threads][i // threads] for i in range(len(chunks))]
        return
    shares = _even_shares(cur.size)
    taken: list[tuple[Scratch, int]] = []

    def native_share(t: int) -> list[Changes]:
        lo, hi = shares[t]
        scratch = _take(4 * (hi - lo))
        try:
            pieces, used = _native_scan(compiled, scratch, cur[lo:hi], base[lo:hi], lo, update)
        except BaseException:
            _give(scratch, 0)
            raise
        taken.append((scratch, used))
        return pieces

    try:
        yield [piece for pieces in map_threads(native_share, len(shares)) for piece in pieces]
    finally:
        for scratch, used in taken:
            _give(scratch, used)


_DISORDER = "sparse delta's word indices are not increasing inside the bucket"


def _apply_chunk(
    compiled: Kernels | None,
    out: np.ndarray,
    source: np.ndarray | None,
    lo: int,
    index: np.ndarray,
    values: np.ndarray,
) -> np.ndarray:
    """Write one chunk's changes (`index` in bucket numbering, for the chunk at word `lo`) into
    `out` (the chunk's int64 words, copied from `source` first when given) and return its row
    sums, read while in cache. Indices out of order or outside the chunk are a `MetadataError`,
    found before numpy writes any."""
    whole = out.size // ROW_WORDS * ROW_WORDS if compiled is not None else 0
    sums = np.empty(whole // ROW_WORDS, dtype=np.int64)
    done = 0
    if compiled is not None and whole:
        done = int(np.searchsorted(index, index.dtype.type(4 * (lo + whole))))
        src, copy = (out, False) if source is None else (source, True)
        changes = index[:done], values[:done]
        if compiled.rebuild_rows(out[:whole], src[:whole], copy, 4 * lo, *changes, sums) < 0:
            raise MetadataError(_DISORDER)
    if source is not None and whole < out.size:  # what the compiled loop did not copy
        np.copyto(out[whole:], source[whole:])
    rest = index[done:]
    if rest.size:
        if int(rest[0]) < 4 * (lo + whole) or int(rest[-1]) >= 4 * (lo + out.size):
            raise MetadataError(_DISORDER)
        if rest.size > 1 and not bool(np.all(rest[1:] > rest[:-1])):
            raise MetadataError(_DISORDER)
        out.view(np.int16)[rest - 4 * lo] = values[done:]
    return sums if whole == out.size else np.append(sums, row_sums(out[whole:]))


class BaseFiller:
    """Writes byte ranges of a bucket being rebuilt (`out`, flat uint8) from its base pieces,
    zeros between them; `runs` hands the rows that one piece covers to the compiled rebuild,
    which copies them in its own pass. `MetadataError` for a piece that overlaps another or
    leaves the bucket."""

    def __init__(self, pieces: BasePieces, out: np.ndarray) -> None:
        self._out = out
        self._segments: list[tuple[int, int, np.ndarray | None]] = []
        cursor = 0
        for offset, piece in sorted(pieces, key=lambda p: p[0]):
            size = int(piece.numel())
            if offset < cursor or offset + size > out.size or piece.dtype != torch.uint8 or not piece.is_cpu:
                raise MetadataError(
                    f"a base piece of {size} bytes at {offset} does not fit the {out.size}-byte bucket"
                )
            if offset > cursor:
                self._segments.append((cursor, offset, None))
            self._segments.append((offset, offset + size, piece.numpy()))
            cursor = offset + size
        if cursor < out.size:
            self._segments.append((cursor, out.size, None))
        self._starts = [s for s, _, _ in self._segments]

    def _first(self, start: int) -> int:
        return max(0, bisect.bisect_right(self._starts, start) - 1)

    def runs(self, start: int, end: int) -> Runs:
        """Bytes [start, end) (whole digest rows but at the bucket's end) as runs in order:
        (a, b, the base's int64 words) for whole rows inside one piece, which the compiled
        rebuild copies in its own pass, and (a, b, None) for the rest, which `__call__` fills."""
        runs: Runs = []
        cursor = start
        i = self._first(start)
        while i < len(self._segments) and self._segments[i][0] < end:
            lo, hi, piece = self._segments[i]
            i += 1
            a = -(-max(lo, start) // _ROW_BYTES) * _ROW_BYTES
            b = end if hi >= end else hi // _ROW_BYTES * _ROW_BYTES
            if piece is None or a >= b:
                continue
            if cursor < a:
                runs.append((cursor, a, None))
            runs.append((a, b, piece[a - lo : b - lo].view(np.int64)))
            cursor = b
        if cursor < end:
            runs.append((cursor, end, None))
        return runs

    def __call__(self, start: int, end: int) -> None:
        """Write bytes [start, end) of the bucket from the base."""
        i = self._first(start)
        while i < len(self._segments) and self._segments[i][0] < end:
            lo, hi, piece = self._segments[i]
            a, b = max(lo, start), min(hi, end)
            if a < b:
                if piece is None:
                    self._out[a:b] = 0
                else:
                    np.copyto(self._out[a:b], piece[a - lo : b - lo])
            i += 1


def _filled_in_chunks(runs: Runs) -> Runs:
    """`runs` with those to fill cut to a chunk at most: each is filled, then summed in cache."""
    cut: Runs = []
    step = 8 * CHUNK_WORDS
    for a, b, source in runs:
        if source is not None:
            cut.append((a, b, source))
        else:
            cut.extend((x, min(x + step, b), None) for x in range(a, b, step))
    return cut


def base_filler(pieces: BasePieces, out: np.ndarray) -> BaseFiller:
    """The `BaseFiller` of `out` (the bucket's flat uint8 bytes) from `pieces`."""
    return BaseFiller(pieces, out)


def apply_changes(
    out: np.ndarray, index: np.ndarray, values: np.ndarray, fill: BaseFiller | None = None
) -> list[np.ndarray]:
    """Write `values` (int16) at the 2-byte words `index` (strictly increasing) of `out` (int64
    words of one bucket, holding the base) and return the row sums of the result per chunk
    (`digest_of_sums`): the changes and the check in one pass, a chunk at a time in cache. With
    `fill` each chunk is first written from the base (`base_filler`) in the same pass: copied
    by the compiled rebuild row by row where one base piece covers the rows.

    `MetadataError` when `index` is out of order or outside `out` (then `out` may be written
    in part: it is a landing zone that nobody commits on an error).
    """
    if index.size != values.size:
        raise MetadataError(f"sparse delta has {index.size} indices and {values.size} values")
    if 4 * out.size >= 2**31:  # word numbers beyond int32: searched as int64
        index = index.astype(np.int64, copy=False)
    compiled = kernels()
    if compiled is not None:  # a call per run of rows: no chunks needed to stay in cache
        chunks = _even_shares(out.size)
        threads = len(chunks)
    else:
        chunks, threads = _shares(out.size)
    edges = np.array([4 * lo for lo, _ in chunks] + [4 * out.size], dtype=index.dtype)
    bounds = np.searchsorted(index, edges)
    # Each chunk checks its own share: in order and inside the chunk; the shares in order and
    # covering every index then make the whole index increasing and inside the bucket.
    if index.size and (bounds[0] != 0 or bounds[-1] != index.size or bool(np.any(np.diff(bounds) < 0))):
        raise MetadataError(f"{_DISORDER} (or names a word outside its {4 * out.size})")

    def chunk_sums(lo: int, hi: int, index: np.ndarray, values: np.ndarray) -> np.ndarray:
        runs = _filled_in_chunks(fill.runs(8 * lo, 8 * hi)) if fill is not None else [(8 * lo, 8 * hi, None)]
        edges = np.searchsorted(index, np.array([a // 2 for a, _, _ in runs[1:]], dtype=index.dtype))
        cuts = [0, *edges.tolist(), index.size]
        sums = []
        for (a, b, source), i, j in zip(runs, cuts, cuts[1:], strict=False):
            if fill is not None and source is None:
                fill(a, b)
            sums.append(_apply_chunk(compiled, out[a // 8 : b // 8], source, a // 8, index[i:j], values[i:j]))
        return sums[0] if len(sums) == 1 else np.concatenate(sums)

    def share(t: int) -> list[np.ndarray]:
        return [
            chunk_sums(*chunks[c], index[bounds[c] : bounds[c + 1]], values[bounds[c] : bounds[c + 1]])
            for c in range(t, len(chunks), threads)
        ]

    per_thread = map_threads(share, threads)
    return [per_thread[i % threads][i // threads] for i in range(len(chunks))]
