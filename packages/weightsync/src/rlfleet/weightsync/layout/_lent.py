"""Memory a consumer is lent, not given: bytes it may read but must never write.

A transport hands a consumer each bucket where it landed, and some of those places are not the
receiver's to write: a shared-memory mapping opened read-only (a ShmRing's slots, the node
buffer's slots a copying reader reads, CUDA IPC host slots), where a write kills the process
with SIGSEGV, and another process's GPU memory opened by IPC handle, where a write corrupts
what the other readers read. Whoever maps such memory registers its address range here (`lend`)
for as long as it is mapped; a consumer that hands bucket bytes on to code it does not control
(an engine's ``load_weights``, which may write in place) asks `lent` first and copies into
memory of its own when the answer is not None.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import torch

__all__ = ["lend", "lent"]

_lock = threading.Lock()
_ranges: dict[int, tuple[str, int, int, str]] = {}  # token -> (device type, start, end, what)
_tokens = itertools.count()


def lend(start: int, nbytes: int, what: str, device: str = "cpu") -> Callable[[], None]:
    """Register [start, start + nbytes) on `device` ("cpu" or "cuda") as lent memory, described
    as `what`; returns the function that ends the registration (call it before unmapping)."""
    token = next(_tokens)
    with _lock:
        _ranges[token] = (device, start, start + nbytes, what)

    def release() -> None:
        with _lock:
            _ranges.pop(token, None)

    return release


def lent(tensor: torch.Tensor) -> str | None:
    """What lent memory `tensor`'s bytes lie in (as registered), or None when they are not lent."""
    if not _ranges or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    kind = tensor.device.type
    with _lock:
        for device, low, high, what in _ranges.values():
            if device == kind and start < high and low < end:
                return what
    return None
