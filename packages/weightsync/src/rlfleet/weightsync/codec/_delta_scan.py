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

With numba installed both passes run compiled loops per 4 KiB row instead (`_delta_kernels`):
the sender's in one call per copy thread (8 MiB at most), a receiver's per 1 MiB chunk, filled
from the consumer's base pieces in the same pass when it offers them; the bytes and the
digests are the same.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from rlfleet.weightsync._errors import MetadataError
from rlfleet.weightsync.codec._delta_kernels import ROW_WORDS, Kernels, kernels
from rlfleet.weightsync.layout._copy import default_copy_threads, map_threads

__all__ = [
    "ROW_WORDS",
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
#: Below this fraction of differing 8-byte words numpy's branchy ``nonzero`` is cheaper.
_PAD_FROM = 0.03
_EMPTY_INDEX = np.empty(0, dtype=np.int64)
_EMPTY_VALUES = np.empty(0, dtype=np.int16)

Changes = tuple[np.ndarray, np.ndarray, np.ndarray]
#: A base bucket as (byte offset, flat uint8 host tensor) pieces; bytes no piece covers are zero.
BasePieces = Sequence[tuple[int, torch.Tensor]]
#: Fills bytes [start, end) of the bucket being rebuilt from its base.
Filler = Callable[[int, int], None]


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


#: int64 words per chunk of the compiled sweep (8 MiB): it streams rows itself, so a chunk only
#: bounds its output buffers; fewer calls save numba's per-call argument checks (~10 us).
NATIVE_CHUNK_WORDS = 1 << 20
_scratch = threading.local()


def _native_buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's output buffers for the compiled sweep (a chunk's worst case, every word
    changed: 24 MiB of address space, touched only as far as changes are written), reused."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        lanes = 4 * NATIVE_CHUNK_WORDS
        buffers = (np.empty(lanes, np.int32), np.empty(lanes, np.int16), np.empty(ROW_WORDS, np.int64))
        _scratch.buffers = buffers
    return buffers


def _native_scan(compiled: Kernels, cur: np.ndarray, base: np.ndarray, lo: int, update: bool) -> Changes:
    """`_scan_chunk`'s result for the chunk at word `lo`, its whole rows by the compiled loop
    (indices as int32: a delta's bucket has fewer than 2**31 words)."""
    index_out, values_out, coarse = _native_buffers()
    whole = cur.size // ROW_WORDS * ROW_WORDS
    sums = np.empty(whole // ROW_WORDS, dtype=np.int64)
    count = compiled.scan_rows(cur[:whole], base[:whole], update, 4 * lo, index_out, values_out, sums, coarse)
    index, values = index_out[:count].copy(), values_out[:count].copy()  # the buffers are reused
    if whole == cur.size:
        return index, values, sums
    tail = cur.size - whole
    mask = np.empty(tail + tail // 8 + 1, dtype=np.bool_)
    t_index, t_values, t_sums = _scan_chunk(cur[whole:], base[whole:], lo + whole, mask, update)
    return np.append(index, t_index), np.append(values, t_values), np.append(sums, t_sums)


def scan_changes(cur: np.ndarray, base: np.ndarray, update: bool) -> list[Changes]:
    """Per chunk of `cur` against `base` (int64 words of one bucket): what `_scan_chunk` gives."""
    compiled = kernels()
    chunk = CHUNK_WORDS
    if compiled is not None:  # as few calls as fill the copy threads, whole rows each
        rows = -(-cur.size // (default_copy_threads() * ROW_WORDS))
        chunk = max(ROW_WORDS, min(NATIVE_CHUNK_WORDS, rows * ROW_WORDS))
    chunks, threads = _shares(cur.size, chunk)

    def share(t: int) -> list[Changes]:
        if compiled is not None:
            return [
                _native_scan(compiled, cur[lo:hi], base[lo:hi], lo, update) for lo, hi in chunks[t::threads]
            ]
        mask = np.empty(CHUNK_WORDS + CHUNK_WORDS // 8, dtype=np.bool_)
        return [_scan_chunk(cur[lo:hi], base[lo:hi], lo, mask, update) for lo, hi in chunks[t::threads]]

    per_thread = map_threads(share, threads)
    return [per_thread[i % threads][i // threads] for i in range(len(chunks))]


_DISORDER = "sparse delta's word indices are not increasing inside the bucket"


def _apply_chunk(
    compiled: Kernels | None, out: np.ndarray, lo: int, index: np.ndarray, values: np.ndarray
) -> np.ndarray:
    """Write one chunk's changes (`index` in bucket numbering, for the chunk at word `lo`) into
    `out` (the chunk's int64 words) and return its row sums, read while in cache. Indices out of
    order or outside the chunk are a `MetadataError`, found before numpy writes any."""
    whole = out.size // ROW_WORDS * ROW_WORDS if compiled is not None else 0
    sums = np.empty(whole // ROW_WORDS, dtype=np.int64)
    done = 0
    if compiled is not None and whole:
        done = int(np.searchsorted(index, 4 * (lo + whole)))
        if compiled.apply_rows(out[:whole], 4 * lo, index[:done], values[:done], sums) < 0:
            raise MetadataError(_DISORDER)
    rest = index[done:]
    if rest.size:
        if int(rest[0]) < 4 * (lo + whole) or int(rest[-1]) >= 4 * (lo + out.size):
            raise MetadataError(_DISORDER)
        if rest.size > 1 and not bool(np.all(rest[1:] > rest[:-1])):
            raise MetadataError(_DISORDER)
        out.view(np.int16)[rest - 4 * lo] = values[done:]
    return sums if whole == out.size else np.append(sums, row_sums(out[whole:]))


def base_filler(pieces: BasePieces, out: np.ndarray) -> Filler:
    """A `Filler` that writes `out` (the bucket's flat uint8 bytes) from `pieces`, zeros between
    them. `MetadataError` for a piece that overlaps another or leaves the bucket."""
    segments: list[tuple[int, int, np.ndarray | None]] = []
    cursor = 0
    for offset, piece in sorted(pieces, key=lambda p: p[0]):
        size = int(piece.numel())
        if offset < cursor or offset + size > out.size or piece.dtype != torch.uint8 or not piece.is_cpu:
            raise MetadataError(
                f"a base piece of {size} bytes at {offset} does not fit the {out.size}-byte bucket"
            )
        if offset > cursor:
            segments.append((cursor, offset, None))
        segments.append((offset, offset + size, piece.numpy()))
        cursor = offset + size
    if cursor < out.size:
        segments.append((cursor, out.size, None))
    starts = [s for s, _, _ in segments]

    def fill(start: int, end: int) -> None:
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while i < len(segments) and segments[i][0] < end:
            lo, hi, source = segments[i]
            a, b = max(lo, start), min(hi, end)
            if a < b:
                if source is None:
                    out[a:b] = 0
                else:
                    np.copyto(out[a:b], source[a - lo : b - lo])
            i += 1

    return fill


def apply_changes(
    out: np.ndarray, index: np.ndarray, values: np.ndarray, fill: Filler | None = None
) -> list[np.ndarray]:
    """Write `values` (int16) at the 2-byte words `index` (strictly increasing) of `out` (int64
    words of one bucket, holding the base) and return the row sums of the result per chunk
    (`digest_of_sums`): the changes and the check in one pass, a chunk at a time in cache. With
    `fill` each chunk is first written from the base (`base_filler`) in the same pass.

    `MetadataError` when `index` is out of order or outside `out` (then `out` may be written
    in part: it is a landing zone that nobody commits on an error).
    """
    if index.size != values.size:
        raise MetadataError(f"sparse delta has {index.size} indices and {values.size} values")
    chunks, threads = _shares(out.size)
    compiled = kernels()
    bounds = np.searchsorted(index, [4 * lo for lo, _ in chunks] + [4 * out.size])
    # Each chunk checks its own share: in order and inside the chunk; the shares in order and
    # covering every index then make the whole index increasing and inside the bucket.
    if index.size and (bounds[0] != 0 or bounds[-1] != index.size or bool(np.any(np.diff(bounds) < 0))):
        raise MetadataError(f"{_DISORDER} (or names a word outside its {4 * out.size})")

    def share(t: int) -> list[np.ndarray]:
        sums = []
        for c in range(t, len(chunks), threads):
            (lo, hi), (i, j) = chunks[c], (bounds[c], bounds[c + 1])
            if fill is not None:
                fill(8 * lo, 8 * hi)
            sums.append(_apply_chunk(compiled, out[lo:hi], lo, index[i:j], values[i:j]))
        return sums

    per_thread = map_threads(share, threads)
    return [per_thread[i % threads][i // threads] for i in range(len(chunks))]
