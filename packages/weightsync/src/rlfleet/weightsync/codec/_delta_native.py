"""The delta codec's compiled loops (numba), imported by `_delta_kernels.kernels` only when
numba is installed: see that module for why they exist.

Two LLVM intrinsics numba does not expose are wrapped here: ``cttz`` (the sender walks the set
bits of a 64-word difference mask, so its compare loop stays vectorised instead of storing a
compacted index per word) and ``prefetch`` (the receiver asks for the next row while its
scalar loop writes the current row's changes, so the memory reads do not stall behind it).
Both cut the loops' time in `benchmarks/delta.py` (figures in docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from rlfleet.weightsync.codec._delta_kernels import ROW_WORDS

__all__ = ["rebuild_rows", "scan_rows"]

_GROUP = 64  # words per difference mask: one bit each in a uint64


def _cttz_typer(typingctx: Any, word: Any) -> Any:
    """Trailing zero bits of a uint64 (nonzero)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.cttz.i64"
        )
        return builder.call(fn, [args[0], ir.IntType(1)(1)])

    return types.uint64(types.uint64), codegen


def _prefetch_typer(typingctx: Any, array: Any, at: Any) -> Any:
    """A read prefetch of ``array[at]`` into every cache level (a hint: never faults)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [builder.bitcast(pointer, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, at), codegen


cttz = intrinsic(_cttz_typer)
prefetch = intrinsic(_prefetch_typer)


def _scan_rows(cur: Any, base: Any, update: bool, first: int, idx_out: Any, val_out: Any, sums: Any) -> int:
    """The changed 2-byte words of `cur` against `base` (int64 words, whole rows): their bucket
    indices (`first` is cur's first 2-byte word) into `idx_out`, values into `val_out`, each
    row's wrapping sum into `sums`; `base` takes the changes when `update`. Returns the count.

    Per 64 words a vectorised loop sums them and sets a bit per differing word; the set bits are
    then refined into 2-byte words, while the words are in L1."""
    c16 = cur.view(np.int16)
    b16 = base.view(np.int16)
    k = 0
    for r in range(cur.size // ROW_WORDS):
        a = r * ROW_WORDS
        s = np.int64(0)
        for g in range(a, a + ROW_WORDS, _GROUP):
            mask = np.uint64(0)
            for d in range(_GROUP):
                c = cur[g + d]
                s += c
                mask |= np.uint64(c != base[g + d]) << np.uint64(d)
            while mask:
                i = g + np.int64(cttz(mask))
                mask &= mask - np.uint64(1)
                w = 4 * i
                for lane in range(4):
                    x = c16[w + lane]
                    idx_out[k] = first + w + lane
                    val_out[k] = x
                    k += x != b16[w + lane]
                if update:
                    base[i] = cur[i]
        sums[r] = s
    return k


def _rebuild_rows(out: Any, src: Any, copy: bool, first: int, index: Any, values: Any, sums: Any) -> int:
    """Per row of `out` (int64 words, whole rows): copy it from `src` when `copy` (else `out`
    holds the base already), sum it, write its changes (`values` at `index`, 2-byte words
    numbered from the bucket's start; `first` is out's first) and correct the sum by each one,
    all while the row is in L1. Returns the count written, or -1 at the first index out of order
    or outside `out` (the rows before it are written: `out` is a landing zone nobody commits
    on an error)."""
    o16 = out.view(np.int16)
    count = index.size
    rows = out.size // ROW_WORDS
    j = 0
    prev = np.int64(first - 1)
    for r in range(rows):
        a = r * ROW_WORDS
        if r + 1 < rows:  # the next row, while this one's changes are written
            for d in range(a + ROW_WORDS, a + 2 * ROW_WORDS, 8):
                if copy:
                    prefetch(src, d)
                prefetch(out, d)
        s = np.int64(0)
        if copy:
            for d in range(a, a + ROW_WORDS):
                x = src[d]
                out[d] = x
                s += x
        else:
            for d in range(a, a + ROW_WORDS):
                s += out[d]
        limit = first + 4 * (a + ROW_WORDS)
        while j < count and index[j] < limit:
            p = np.int64(index[j])
            if p <= prev:
                return -1
            q = p - first
            old = np.int64(np.uint16(o16[q]))
            o16[q] = values[j]
            s += (np.int64(np.uint16(values[j])) - old) << (16 * (q & 3))
            prev = p
            j += 1
        sums[r] = s
    return j if j == count else -1


_jit = numba.njit(nogil=True, cache=True, boundscheck=False)
scan_rows = _jit(_scan_rows)
rebuild_rows = _jit(_rebuild_rows)
