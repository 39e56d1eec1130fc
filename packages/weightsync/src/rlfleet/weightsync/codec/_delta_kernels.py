"""Compiled loops for the delta codec's host passes, used when numba is installed (the
``native`` extra: ``pip install "rlfleet-weightsync[native]"``).

numpy finds changed words with ``nonzero`` (about 0.4 ns per 8-byte word even on its branchless
path) and gathers them in further calls, so the sender's sweep costs 3-4 memcpys of the bucket
and the receiver's check reads the rebuilt bucket once more. One compiled loop per 4 KiB row
instead (`_delta_native`): the sender compares, sums the row's digest term and refines the few
differing words while the row is in L1; the receiver copies a row from its base, sums it and
writes its changes while it is in L1. Measured (`benchmarks/delta.py`, full size): the encode
plus the rebuild fall from 6.9 memcpys of the model to 2.9. Same bytes, same digests either
way; ``RLFLEET_DELTA_NATIVE=0`` forces numpy.

The loops only see whole rows (`ROW_WORDS` int64 words); a bucket's partial last row goes
through numpy. Both are compiled on first use (about 2 s) and cached next to this module.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["ROW_WORDS", "Kernels", "kernels"]

#: int64 words per digest row (4 KiB; a bucket's last partial row is summed on its own).
ROW_WORDS = 512


class Kernels(NamedTuple):
    """The compiled loops (`_delta_native`): the sender's sweep and a receiver's rebuild."""

    scan_rows: Callable[..., int]
    rebuild_rows: Callable[..., int]


@functools.cache
def kernels() -> Kernels | None:
    """The compiled loops, or None (numba missing, or ``RLFLEET_DELTA_NATIVE=0``): numpy then.
    Imported on the first delta, not with the package (numba's import takes about a second)."""
    if os.environ.get("RLFLEET_DELTA_NATIVE", "1") == "0":
        return None
    try:
        native = importlib.import_module("rlfleet.weightsync.codec._delta_native")
    except ImportError:  # numba (or its llvmlite) is not installed
        return None
    return Kernels(native.scan_rows, native.rebuild_rows)
