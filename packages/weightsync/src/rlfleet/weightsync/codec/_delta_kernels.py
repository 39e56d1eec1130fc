"""Compiled loops for the delta codec's host passes, used when numba is installed (the
``native`` extra: ``pip install "rlfleet-weightsync[native]"``).

numpy finds changed words with ``nonzero`` (about 0.4 ns per 8-byte word even on its branchless
path) and gathers them in further calls, so the sender's sweep costs 3-4 memcpys of the bucket
and the receiver's check reads the rebuilt bucket once more. One compiled loop per 4 KiB row
instead: the sender compares, sums the row's digest term and refines the few differing words
while the row is in L1; the receiver writes a row's changes and sums it while it is in cache.
Measured (`benchmarks/delta.py`): the encode plus the rebuild fall from about 5 memcpys of the
model to about 2.5. Same bytes, same digests either way; ``RLFLEET_DELTA_NATIVE=0`` forces numpy.

The loops only see whole rows (`ROW_WORDS` int64 words); a bucket's partial last row goes
through numpy. Both are compiled on first use (about 2 s) and cached next to this module.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ROW_WORDS", "Kernels", "kernels"]

#: int64 words per digest row (4 KiB; a bucket's last partial row is summed on its own).
ROW_WORDS = 512


def _scan_rows(
    cur: Any, base: Any, update: bool, first: int, idx_out: Any, val_out: Any, sums: Any, coarse: Any
) -> int:
    """The changed 2-byte words of `cur` against `base` (int64 words, whole rows): their bucket
    indices (`first` is cur's first 2-byte word) into `idx_out`, values into `val_out`, each
    row's wrapping sum into `sums`; `base` takes the changes when `update`. Returns the count."""
    c16 = cur.view(np.int16)
    b16 = base.view(np.int16)
    k = 0
    for r in range(cur.size // ROW_WORDS):
        a = r * ROW_WORDS
        s = np.int64(0)
        m = 0
        for d in range(ROW_WORDS):  # a fixed trip count: the loop vectorises
            c = cur[a + d]
            s += c
            coarse[m] = a + d
            m += c != base[a + d]
        sums[r] = s
        for j in range(m):
            i = coarse[j]
            w = 4 * i
            for lane in range(4):
                x = c16[w + lane]
                idx_out[k] = first + w + lane
                val_out[k] = x
                k += x != b16[w + lane]
            if update:
                base[i] = cur[i]
    return k


def _apply_rows(out: Any, first: int, index: Any, values: Any, sums: Any) -> int:
    """Write `values` at `index` (2-byte words numbered from the bucket's start; `first` is out's
    first) into `out` (int64 words, whole rows), each row's changes then its wrapping sum into
    `sums`. Returns the count written, or -1 at the first index out of order or outside `out`
    (the rows before it are written: `out` is a landing zone nobody commits on an error)."""
    o16 = out.view(np.int16)
    count = index.size
    j = 0
    prev = first - 1
    for r in range(out.size // ROW_WORDS):
        limit = first + 4 * (r + 1) * ROW_WORDS
        while j < count and index[j] < limit:
            p = index[j]
            if p <= prev:
                return -1
            o16[p - first] = values[j]
            prev = p
            j += 1
        a = r * ROW_WORDS
        s = np.int64(0)
        for d in range(ROW_WORDS):
            s += out[a + d]
        sums[r] = s
    return j if j == count else -1


class Kernels(NamedTuple):
    """The compiled loops: `_scan_rows` (the sender's) and `_apply_rows` (a receiver's)."""

    scan_rows: Callable[..., int]
    apply_rows: Callable[..., int]


@functools.cache
def kernels() -> Kernels | None:
    """The compiled loops, or None (numba missing, or ``RLFLEET_DELTA_NATIVE=0``): numpy then.
    Imported on the first delta, not with the package (numba's import takes about a second)."""
    if os.environ.get("RLFLEET_DELTA_NATIVE", "1") == "0":
        return None
    try:
        numba = importlib.import_module("numba")
    except ImportError:
        return None
    jit = numba.njit(nogil=True, cache=True, boundscheck=False)
    return Kernels(jit(_scan_rows), jit(_apply_rows))
