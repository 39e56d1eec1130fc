"""Whose base is which: the sender's copy of the last version it sent, and a receiver's rebuild.

The sender keeps one base: every bucket of the last version it sent, in the wire dtype, on the
host (a GPU trainer's buckets are copied down as they are encoded), one model copy in all. It
is written as each bucket goes out (the changed words of a delta, the whole of a full bucket),
so after a version commits it *is* that version, and a delta against it is offered next time.
A version that fails leaves it torn: the sender forgets it, and the next version goes full.

A receiver rebuilds a delta bucket where the full bucket would land (the standby copy, the free
slot of a node buffer, a staging area): the consumer writes its applied version's bucket there
(`DeltaBase.copy_base`), the changes go on top, and the result's digest must equal the
sender's digest of the new version before the consumer sees it. A receiver whose base is not
the sender's (another version, a restart, corrupted bytes) thus refuses the bucket, applies
nothing, and keeps serving what it had.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol, runtime_checkable

import torch

from rlfleet.weightsync._errors import ChecksumMismatchError
from rlfleet.weightsync.codec._delta import (
    DEFAULT_MAX_FRACTION,
    FULL,
    DeltaPayload,
    apply_delta,
    apply_delta_digest,
    encode_delta,
)
from rlfleet.weightsync.layout._copy import copy_pairs
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import bucket_starts, bucket_views

__all__ = [
    "DELTA_MODES",
    "DeltaBase",
    "DeltaEncoder",
    "DeltaSenderBase",
    "DeltaStats",
    "base_pieces_of",
    "check_delta_mode",
    "clear_padding",
    "holds_base",
    "pack_base",
    "rebuild",
    "tensor_pieces",
]

#: ``"auto"``: a delta whenever every receiver holds the sender's base; ``"off"``: always full.
DELTA_MODES = ("auto", "off")


def check_delta_mode(mode: object, what: str = "delta") -> str:
    """`mode` if it is one of `DELTA_MODES`; ValueError naming `what` otherwise."""
    if mode not in DELTA_MODES:
        raise ValueError(f"{what} must be one of {list(DELTA_MODES)}, got {mode!r}")
    return str(mode)


@runtime_checkable
class DeltaBase(Protocol):
    """Optional consumer extension: a receiver that can rebuild a delta from its applied version.

    ``copy_base(index, out)`` writes bucket `index` of the applied version (its wire bytes) into
    `out` (flat uint8 of the bucket's nbytes) and returns True, or returns False when it cannot
    (then the receiver asks for full versions).

    A consumer may also offer ``base_pieces(index)``: the same bytes without a copy, as
    ``(byte offset, flat uint8 host tensor)`` pairs (the rest of the bucket is zero padding), or
    None. A host rebuild then copies, applies and digests each cache-sized chunk in one pass
    instead of copying the whole bucket first (`tensor_pieces` builds them from tensors).
    """

    def copy_base(self, index: int, out: torch.Tensor) -> bool: ...


@lru_cache(maxsize=64)
def _gaps(layout: Layout, index: int) -> tuple[tuple[int, int], ...]:
    """The [start, end) byte ranges of bucket `index` that no tensor covers (its padding)."""
    gaps: list[tuple[int, int]] = []
    cursor = 0
    for spec in sorted(layout.buckets[index].tensors, key=lambda s: s.offset):
        if spec.offset > cursor:
            gaps.append((cursor, spec.offset))
        cursor = max(cursor, spec.offset + spec.nbytes)
    if cursor < layout.buckets[index].nbytes:
        gaps.append((cursor, layout.buckets[index].nbytes))
    return tuple(gaps)


def clear_padding(layout: Layout, index: int, out: torch.Tensor) -> torch.Tensor:
    """Zero the padding of bucket `index` in `out`: deltas and digests cover every byte of a
    bucket, and padding is otherwise whatever a buffer held before."""
    for start, end in _gaps(layout, index):
        out[start:end].zero_()
    return out


def pack_base(layout: Layout, index: int, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> bool:
    """Bucket `index` of `tensors` (a receiver's applied weights, in the wire dtype) into `out`,
    padding zeroed: `DeltaBase.copy_base` for consumers that hold their weights as tensors."""
    views = bucket_views(layout, index, out)
    names = [spec.name for spec in layout.buckets[index].tensors if spec.nbytes]
    copy_pairs([views[n] for n in names], [tensors[n].detach() for n in names])  # threads, memmove
    clear_padding(layout, index, out)
    return True


def tensor_pieces(
    layout: Layout, index: int, tensors: Mapping[str, torch.Tensor]
) -> list[tuple[int, torch.Tensor]] | None:
    """Bucket `index` of `tensors` (an applied version, in the wire dtype) as ``base_pieces``: each
    tensor's bytes at its offset, no copy; None unless every one is a contiguous host tensor of
    the layout's size (then `copy_base` is the way)."""
    pieces = []
    for spec in layout.buckets[index].tensors:
        if not spec.nbytes:
            continue
        t = tensors.get(spec.name)
        if t is None or not t.is_cpu or not t.is_contiguous() or t.numel() * t.element_size() != spec.nbytes:
            return None
        pieces.append((spec.offset, t.detach().reshape(-1).view(torch.uint8)))
    return pieces


def base_pieces_of(consumer: object, index: int) -> list[tuple[int, torch.Tensor]] | None:
    """`consumer.base_pieces(index)` when it offers them (see `DeltaBase`), else None."""
    offer = getattr(consumer, "base_pieces", None)
    return offer(index) if callable(offer) else None


def holds_base(consumer: object, base: int | None) -> bool:
    """Whether `consumer` can rebuild a delta against version `base` (its applied version)."""
    return (
        base is not None
        and isinstance(consumer, DeltaBase)
        and getattr(consumer, "version", None) == base
        and bool(getattr(consumer, "takes_deltas", True))
    )


def rebuild(
    consumer: DeltaBase, index: int, kind: str, payload: torch.Tensor, out: torch.Tensor, digest: int | None
) -> None:
    """Bucket `index` of the new version into `out`: the consumer's base, the changes, the check.

    `ChecksumMismatchError` naming the bucket when the result is not the sender's (wrong base,
    torn payload); `out` then holds garbage that nobody commits.
    """
    if kind == FULL:
        out.copy_(payload)
        return
    pieces = base_pieces_of(consumer, index) if out.is_cpu and digest is not None else None
    if pieces is None and not consumer.copy_base(index, out):
        raise ChecksumMismatchError(f"bucket {index}: the consumer cannot provide its base", index)
    if digest is None:
        apply_delta(kind, payload, out)
    else:
        got = apply_delta_digest(kind, payload, out, pieces)[1]
        if got != digest:
            raise ChecksumMismatchError(
                f"bucket {index}: the delta applied to this receiver's base gives digest {got:#018x}, "
                f"the sender's version has {digest:#018x} (another base, or torn bytes): refused",
                index,
            )


@dataclass
class DeltaStats:
    """What one version's encoding did: bytes sent and full, buckets by kind, words changed."""

    version: int = -1
    #: The base the delta was against (None: the version went full).
    base: int | None = None
    sent_bytes: int = 0
    full_bytes: int = 0
    changed_words: int = 0
    total_words: int = 0
    kinds: dict[str, int] | None = None
    encode_seconds: float = 0.0

    @property
    def changed_fraction(self) -> float:
        return self.changed_words / self.total_words if self.total_words else 0.0

    @property
    def ratio(self) -> float:
        """Bytes sent over the bytes of the full version."""
        return self.sent_bytes / self.full_bytes if self.full_bytes else 1.0


class DeltaSenderBase:
    """What a delta sender keeps between versions, whatever it sends in (buckets of a layout,
    reshard's messages): its mode, its base and the version the base holds, and this version's
    stats. The base becomes a version only once that version committed with every piece written.
    """

    def __init__(self, mode: str, max_fraction: float) -> None:
        self.mode = check_delta_mode(mode)
        if not isinstance(max_fraction, (int, float)) or not 0.0 < float(max_fraction) <= 1.0:
            raise ValueError(f"delta max_fraction must be in (0, 1], got {max_fraction!r}")
        self.max_fraction = float(max_fraction)
        self._base: torch.Tensor | None = None
        self._base_version: int | None = None
        self.last = DeltaStats()

    @property
    def base_version(self) -> int | None:
        """The version the base holds (None: no base; the next version goes full)."""
        return self._base_version

    @property
    def base_bytes(self) -> int:
        """Memory kept for the base between versions."""
        return 0 if self._base is None else int(self._base.numel())

    def offer(self) -> int | None:
        """The base to offer a delta against this time, or None (off, or no committed base)."""
        return None if self.mode == "off" else self._base_version

    def _begin(self, version: int, base: int | None) -> None:
        self.last = DeltaStats(version=version, base=base, kinds={})

    def _count(self, kind: str, sent: int, full: int, changed: int, words: int, seconds: float) -> None:
        """One piece of this version: its kind, bytes sent of `full`, words changed of `words`."""
        stats = self.last
        stats.sent_bytes += sent
        stats.full_bytes += full
        stats.changed_words += changed
        stats.total_words += words
        assert stats.kinds is not None
        stats.kinds[kind] = stats.kinds.get(kind, 0) + 1
        stats.encode_seconds += seconds

    def _settle(self, version: int, committed: bool, complete: bool) -> None:
        """The version's outcome: committed with every piece written, the base is it; else none."""
        self._base_version = version if committed and complete and self.mode != "off" else None

    def forget(self) -> None:
        """Drop the base (its memory too): the next version goes full."""
        self._base = None
        self._base_version = None


class DeltaEncoder(DeltaSenderBase):
    """The sender's base and the per-bucket choice of delta or full (see the module).

    Memory: one copy of the layout's padded bytes on `device` (the host by default), allocated
    at the first version. ``mode="off"`` keeps nothing and encodes nothing.
    """

    def __init__(
        self,
        layout: Layout,
        mode: str = "auto",
        max_fraction: float = DEFAULT_MAX_FRACTION,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(mode, max_fraction)
        self.layout = layout
        self.device = torch.device(device)
        self._starts = bucket_starts(layout)
        self._written: set[int] = set()

    def start(self, version: int, delta: bool) -> None:
        """A version begins: `delta` when every receiver holds the offered base."""
        self._written = set()
        self._begin(version, self._base_version if delta else None)

    def encode(self, index: int, current: torch.Tensor, delta: bool) -> DeltaPayload:
        """Bucket `index`'s payload from its packed wire bytes (its padding is zeroed here: every
        byte is compared); the base takes the new bytes."""
        begin = time.perf_counter()
        nbytes = self.layout.buckets[index].nbytes
        current = current[:nbytes]
        if self.mode == "off":
            payload = DeltaPayload(FULL, current, nbytes // 2, 0)
        elif delta and self._base_version is not None:
            clear_padding(self.layout, index, current)
            host = current.to(self.device)  # a GPU trainer's bucket: encoded against the host base
            payload = encode_delta(host, self._base_bucket(index), self.max_fraction, update=True)
            if payload.kind == FULL:
                payload = DeltaPayload(FULL, current, payload.changed, payload.digest)
            self._written.add(index)
        else:
            clear_padding(self.layout, index, current)
            self._base_bucket(index).copy_(current)
            payload = DeltaPayload(FULL, current, nbytes // 2, 0)
            self._written.add(index)
        self._count(
            payload.kind, payload.nbytes, nbytes, payload.changed, nbytes // 2, time.perf_counter() - begin
        )
        return payload

    def _base_bucket(self, index: int) -> torch.Tensor:
        if self._base is None:
            self._base = torch.zeros(self.layout.padded_bytes, dtype=torch.uint8, device=self.device)
        start = self._starts[index]
        return self._base[start : start + self.layout.buckets[index].nbytes]

    def finish(self, version: int, committed: bool, buckets: Sequence[int] | None = None) -> None:
        """The version's outcome: committed, the base is that version; else it is forgotten."""
        wanted = range(len(self.layout.buckets)) if buckets is None else buckets
        self._settle(version, committed, all(i in self._written for i in wanted))
