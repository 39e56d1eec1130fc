"""What the broadcast sender and receiver share: the wire they run on, the consumer extensions
a transport may land bytes in, and the session's two bucket buffers (`_wire.py` describes the
protocol)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync.codec._delta_state import DeltaBase, rebuild
from rlfleet.weightsync.protocol._core import Collective, Pending, SessionState, status_round
from rlfleet.weightsync.protocol._protocol import BucketConsumer

__all__ = ["BroadcastSession", "BucketTarget", "SyncStats", "TensorTarget", "Wire", "crc_of", "rank_label"]


@runtime_checkable
class BucketTarget(Protocol):
    """Optional consumer extension: storage where a transport may land a bucket directly.

    ``bucket_target(index)`` returns a flat uint8 tensor of the bucket's nbytes (on the
    transport's device) that the consumer owns and that may be overwritten during a pending
    sync without touching the applied version, or None. A transport that writes there then
    calls ``consume(index, that_tensor)``; the consumer sees its own storage and skips the copy.
    """

    def bucket_target(self, index: int) -> torch.Tensor | None: ...


@runtime_checkable
class TensorTarget(Protocol):
    """Optional consumer extension: where a large tensor may land directly, skipping a copy.

    ``tensor_target(name)`` returns a contiguous tensor with the layout's dtype and shape (on
    the transport's device) that the consumer owns and lets the transport overwrite during the
    pending sync, or None. The transport asks only for tensors it sends as their own segment
    (at least ``direct_min`` bytes) and writes every target it was given; the bucket it then
    passes to ``consume`` holds unspecified bytes for those tensors, which the consumer skips.
    Whether a target may be live storage (the in-place "None" strategy: no copy at all, but a
    failed sync leaves it torn) or staging (atomic) is the consumer's choice.
    """

    def tensor_target(self, name: str) -> torch.Tensor | None: ...


def fitting_target(consumer: object, index: int, nbytes: int, device: torch.device) -> torch.Tensor | None:
    """`consumer`'s own storage for bucket `index` (`BucketTarget`) when it is flat bytes on
    `device` holding at least `nbytes`; None otherwise (the transport uses a buffer of its own)."""
    out = consumer.bucket_target(index) if isinstance(consumer, BucketTarget) else None
    if out is None or out.dtype != torch.uint8 or out.dim() != 1 or out.device != device:
        return None
    return out if out.numel() >= nbytes else None


class DeltaRebuilder:
    """Where a receiver rebuilds a delta bucket: where the full bucket would land (a fitting
    `BucketTarget`), else one bucket buffer of its own on the transport's `device`, made at first
    need and reused. The broadcast, the ShmRing and CUDA IPC receivers share it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None

    def rebuild(
        self,
        consumer: BucketConsumer,
        index: int,
        kind: str,
        payload: torch.Tensor,
        digest: int | None,
        target: torch.Tensor | None,
    ) -> torch.Tensor:
        """Bucket `index` of the new version, rebuilt on `consumer`'s base into `target` (None:
        our buffer) and checked against the sender's `digest` (`codec.rebuild`)."""
        nbytes = consumer.layout.buckets[index].nbytes
        if target is None:
            if self._buffer is None or self._buffer.numel() < nbytes:
                size = max(consumer.layout.max_bucket_nbytes, nbytes)
                self._buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            target = self._buffer
        assert isinstance(consumer, DeltaBase)  # holds_base said so when the base was offered
        out = target[:nbytes]
        rebuild(consumer, index, kind, payload, out, digest)
        return out


class Wire(Collective, Protocol):
    """The collectives the protocol needs, over one group, bound to one device."""

    @property
    def src(self) -> int:
        """Group rank of the sender."""
        ...

    def broadcast(self, tensor: torch.Tensor) -> Pending: ...


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved, for logs and benchmarks."""

    version: int
    buckets: int
    wire_bytes: int
    seconds: float
    #: The bytes of the full version in the wire dtype (0: not counted: the same as wire_bytes).
    full_bytes: int = 0
    #: The base the version was a delta against (None: it went full).
    base: int | None = None
    #: Receivers (group ranks) that did not hold the offered base, so the version went full.
    full_ranks: tuple[int, ...] = ()

    @property
    def gbps(self) -> float:
        return self.wire_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def crc_of(regions: Sequence[torch.Tensor]) -> int:
    """CRC32 of the regions' bytes, in order (what a control word carries)."""
    crc = 0
    for region in regions:
        flat = region.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        crc = zlib.crc32(flat.contiguous().view(torch.uint8).numpy().data.cast("B"), crc)
    return crc & 0xFFFFFFFF


def rank_label(rank: int) -> str:
    return f"rank {rank}"


class BroadcastSession(SessionState):
    """State shared by sender and receiver: the wire and two bucket buffers."""

    def __init__(self, wire: Wire, direct_min: int) -> None:
        super().__init__()
        self.wire = wire
        self.direct_min = direct_min
        self._buffers: list[torch.Tensor | None] = [None, None]

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.wire.device)
            self._buffers[slot] = buf
        return buf

    def release_buffers(self) -> None:
        """Free the two bucket buffers (they are re-created on the next sync)."""
        self._buffers = [None, None]

    def _status_round(self, code: int, deadline: Deadline, what: str) -> list[int]:
        return status_round(self.wire, (code,), deadline, what)[0]
