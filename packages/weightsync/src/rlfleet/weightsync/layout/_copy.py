"""Copy many tensors at memory bandwidth: the bytes are split across a few threads.

One thread copies at about a third of what the memory bus gives, and a worker process usually
runs torch with one intra-op thread; plain Python threads, each copying a contiguous share of
the bytes, reach the bus (the copies below release the GIL). Plain CPU pairs (same dtype,
contiguous, no conjugate/negative bit) are copied by the C library's ``memmove``, which
streams large copies past the cache (`benchmarks/weightsync.py`'s memcpy bound measures what
it reaches). Autograd still sees the write (the destination's version counter is bumped, as
``copy_`` does). Used where one process writes a whole model (a node's shared buffer, once per
version, and the buffers' copies into live tensors).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from torch.autograd.graph import increment_version

__all__ = ["copy_pairs", "copy_tensors", "default_copy_threads", "map_threads"]

_T = TypeVar("_T")

#: Below this many bytes per thread a split costs more than it saves.
MIN_BYTES_PER_THREAD = 16 * 1024 * 1024
MAX_THREADS = 8

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def default_copy_threads() -> int:
    """The CPUs this process may run on, capped at 8 (more threads do not add bandwidth)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="rlfleet-copy")
        return _pool


def _pieces(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], share: int, grad_enabled: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) pairs of about `share` bytes or less: large byte-copy pairs are cut into ranges."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in zip(dsts, srcs, strict=True):
        if dst.numel() * dst.element_size() <= share or not _raw(dst, src, grad_enabled):
            out.append((dst, src))
            continue
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        step = max(1, share // dst.element_size())
        for start in range(0, dst.numel(), step):
            out.append((flat_dst[start : start + step], flat_src[start : start + step]))
    return out


def _raw(dst: torch.Tensor, src: torch.Tensor, grad_enabled: bool) -> bool:
    """Whether ``dst.copy_(src)`` is exactly a byte copy of ``src``'s storage range."""
    return (  # cheapest checks first: this runs once per tensor of a model, every version
        dst.dtype == src.dtype
        and dst.is_cpu
        and src.is_cpu
        and dst.layout == src.layout == torch.strided
        and dst.shape == src.shape  # copy_ broadcasts or refuses other shapes: leave them to it
        and dst.is_contiguous()
        and src.is_contiguous()
        and not (dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg())
        and not (dst.is_quantized or src.is_quantized)
        and not (grad_enabled and dst.requires_grad)  # copy_ refuses that: leave it to copy_
    )


def _copy_share(dsts: list[torch.Tensor], srcs: list[torch.Tensor], grad_enabled: bool) -> None:
    """One thread's share: byte copies by ``memmove`` (GIL released), the rest by torch.

    `grad_enabled` is the caller's grad mode (thread-local, so passed in).
    """
    rest_d: list[torch.Tensor] = []
    rest_s: list[torch.Tensor] = []
    written: list[torch.Tensor] = []
    for dst, src in zip(dsts, srcs, strict=True):
        if not _raw(dst, src, grad_enabled):
            rest_d.append(dst)
            rest_s.append(src)
            continue
        if dst.numel():
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)
        written.append(dst)
    if written:
        increment_version(written)
    if rest_d:
        torch._foreach_copy_(rest_d, rest_s)


def map_threads(fn: Callable[[int], _T], shares: int) -> list[_T]:
    """``[fn(0), ..., fn(shares - 1)]``, share 0 on the calling thread and the others on the
    copy threads: for passes over memory whose calls release the GIL (numpy, memmove). Every
    share has finished when it returns or raises (nobody writes after), the first error raised.
    """
    futures = [_executor().submit(fn, i) for i in range(1, shares)]
    results: list[_T] = []
    first_error: BaseException | None = None
    try:
        results.append(fn(0))
    except BaseException as exc:
        first_error = exc
    for future in futures:
        try:
            results.append(future.result())
        except BaseException as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return results


def copy_tensors(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], threads: int | None = None
) -> None:
    """``dst.copy_(src)`` for every pair, the bytes shared among `threads` threads.

    Same result as ``torch._foreach_copy_(dsts, srcs)`` (byte copies by ``memmove`` where a
    pair is plain CPU memory, torch for the rest); small totals and ``threads=1`` stay on
    the calling thread.
    """
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_tensors: {len(dsts)} destinations but {len(srcs)} sources")
    threads = default_copy_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"copy_tensors: threads must be >= 1, got {threads}")
    total = sum(d.numel() * d.element_size() for d in dsts)
    threads = min(threads, MAX_THREADS, max(1, total // MIN_BYTES_PER_THREAD))
    grad_enabled = torch.is_grad_enabled()  # thread-local: decided here, for every thread
    if threads == 1 or not dsts:
        if dsts:
            _copy_share(list(dsts), list(srcs), grad_enabled)
        return
    pieces = _pieces(dsts, srcs, -(-total // (threads * 4)), grad_enabled)  # ~4 per thread: balance
    # greedy: the largest pieces first, each to the least loaded thread
    loads = [0] * threads
    shares: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(threads)]
    for dst, src in sorted(pieces, key=lambda p: -p[0].numel() * p[0].element_size()):
        i = loads.index(min(loads))
        shares[i][0].append(dst)
        shares[i][1].append(src)
        loads[i] += dst.numel() * dst.element_size()
    futures = [_executor().submit(_copy_share, d, s, grad_enabled) for d, s in shares[1:] if d]
    first_error: BaseException | None = None
    try:
        if shares[0][0]:
            _copy_share(shares[0][0], shares[0][1], grad_enabled)
    except BaseException as exc:  # still wait for the others: nobody may write after we return
        first_error = exc
    for future in futures:
        try:
            future.result()
        except BaseException as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error


def copy_pairs(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, threaded: bool = True) -> None:
    """``dst.copy_(src)`` for every pair, without autograd, in as few calls as the devices allow.

    CPU pairs are shared among threads (`copy_tensors`) when `threaded`, else copied by one
    fused torch call (a bucket of small tensors, where threads would not pay); pairs on one
    other device take one fused call; pairs across devices are copied one by one.
    """
    if not dsts:
        return
    with torch.no_grad():
        if all(t.device.type == "cpu" for t in dsts) and all(t.device.type == "cpu" for t in srcs):
            if threaded:
                copy_tensors(dsts, srcs)
            else:
                torch._foreach_copy_(list(dsts), list(srcs))
            return
        device = dsts[0].device
        if all(t.device == device for t in dsts) and all(t.device == device for t in srcs):
            torch._foreach_copy_(list(dsts), list(srcs))
            return
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)
