"""Deltas point to point: each generation rank gets the delta of its own byte ranges only.

The unit of a reshard delta is a message (one (training rank, generation rank) pair's packed
slices, or one large slice): its bytes, zero-padded to 512, are compared with the same
message of the base version bit for bit in the wire dtype (`codec.encode_delta`), so a
destination shard receives the changes of exactly the slices it holds, straight from the
training rank that holds them; nothing is gathered or broadcast.

Base tracking is per pair. In the negotiation every member reports the version it holds as a
base (a training rank: the version its `MessageDeltas` holds, -1 with ``delta="off"`` or after
a failure; a generation rank: its consumer's applied version when the consumer can rebuild a
delta, `codec.DeltaBase`, else -1). A pair travels as a delta when both report the same version;
otherwise full, as without deltas (a generation rank that restarted or missed a version gets
full from every training rank, the others still get deltas). In a delta pair every message is
preceded by a control word (`Control`: full or the delta kind, the payload's size and the
sender's digest of the message's new bytes), since a delta's size is known only once encoded.

A receiver rebuilds in its staging (the consumer's landing zone or a staging buffer, never the
served weights): the buckets a delta pair touches are first filled with the applied version
(``copy_base``), full messages land on top, and each delta message is applied to its own byte
ranges there and checked against the sender's digest before anything is consumed. A mismatch
(another base, corrupted bytes) fails this rank's commit status: the version aborts on every
rank, each training rank forgets its base, and the next version goes full.

Memory: a training rank keeps every message it sends as last sent, padded to 512 bytes, on the
host (one copy of the bytes it sends), plus one host scratch of its largest message; a
generation rank needs one scratch of its largest message besides its staging.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from rlfleet.weightsync._errors import ChecksumMismatchError, MetadataError
from rlfleet.weightsync.codec._delta import (
    DEFAULT_MAX_FRACTION,
    FULL,
    DeltaPayload,
    apply_delta,
    bucket_digest,
    encode_delta,
)
from rlfleet.weightsync.codec._delta_state import DeltaSenderBase
from rlfleet.weightsync.protocol._frames import Control
from rlfleet.weightsync.reshard._reshard_program import ReshardMessage

__all__ = ["CONTROL_TAG", "MessageDeltas", "check_control", "padded", "rebuild_message"]

#: Tag of a delta pair's control word: CONTROL_TAG + the message's index (its payload: 1 + index).
CONTROL_TAG = 1 << 24
_PAD = 512


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to the 512 bytes a delta compares and digests."""
    return -(-nbytes // _PAD) * _PAD


class MessageDeltas(DeltaSenderBase):
    """A training rank's base: every message it sends, as last sent (see the module)."""

    def __init__(
        self,
        messages: Sequence[ReshardMessage],
        mode: str = "auto",
        max_fraction: float = DEFAULT_MAX_FRACTION,
    ) -> None:
        super().__init__(mode, max_fraction)
        self._starts: dict[tuple[int, int], int] = {}
        cursor = 0
        for m in messages:
            self._starts[(m.dst, m.index)] = cursor
            cursor += padded(m.nbytes)
        self._nbytes = cursor
        self._largest = max((padded(m.nbytes) for m in messages), default=0)
        self._scratch: torch.Tensor | None = None  # besides the base: the largest message
        self._written: set[tuple[int, int]] = set()

    def start(self, version: int, base: int | None) -> None:
        """A version begins; `base` is what its delta pairs are against (None: all full)."""
        self._written = set()
        self._begin(version, base)

    def _region(self, msg: ReshardMessage) -> torch.Tensor:
        if self._base is None:
            self._base = torch.zeros(self._nbytes, dtype=torch.uint8)
        start = self._starts[(msg.dst, msg.index)]
        return self._base[start : start + padded(msg.nbytes)]

    def keep(self, msg: ReshardMessage, packed: torch.Tensor) -> None:
        """A full pair's message: the base takes its bytes."""
        if self.mode == "off":
            return
        self._region(msg)[: msg.nbytes].copy_(packed)
        self._written_as(msg, FULL, msg.nbytes, (msg.nbytes + 1) // 2, 0.0)

    def encode(self, msg: ReshardMessage, packed: torch.Tensor) -> DeltaPayload:
        """A delta pair's message against the base (a ``full`` payload holds no bytes: send
        `packed`); the base takes the new bytes."""
        begin = time.perf_counter()
        size = padded(msg.nbytes)
        if self._scratch is None:
            self._scratch = torch.empty(self._largest, dtype=torch.uint8)
        current = self._scratch[:size]
        current[: msg.nbytes].copy_(packed)
        current[msg.nbytes :].zero_()
        payload = encode_delta(current, self._region(msg), self.max_fraction, update=True)
        if payload.kind == FULL:
            payload = DeltaPayload(FULL, packed, payload.changed, payload.digest)
        self._written_as(msg, payload.kind, payload.nbytes, payload.changed, time.perf_counter() - begin)
        return payload

    def _written_as(self, msg: ReshardMessage, kind: str, sent: int, changed: int, seconds: float) -> None:
        self._written.add((msg.dst, msg.index))
        self._count(kind, sent, msg.nbytes, changed, (msg.nbytes + 1) // 2, seconds)

    def finish(self, version: int, committed: bool, messages: Sequence[ReshardMessage]) -> None:
        """Committed with every message written: the base is `version`; else it is forgotten."""
        self._settle(version, committed, all((m.dst, m.index) in self._written for m in messages))

    def forget(self) -> None:
        super().forget()
        self._scratch = None


def check_control(control: Control, msg: ReshardMessage) -> Control:
    """A delta pair's control word for `msg`, checked: MetadataError when it does not fit."""
    if control.abort is not None:
        raise MetadataError(f"train rank {msg.src} aborted message {msg.index}: {control.abort}")
    if control.bucket != msg.index:
        raise MetadataError(f"control word names message {control.bucket}, expected {msg.index}")
    if control.kind == FULL:
        ok = control.nbytes == msg.nbytes
    else:
        ok = control.digest is not None and 0 < control.nbytes < padded(msg.nbytes)
    if not ok:
        raise MetadataError(
            f"control word says message {msg.index} from train rank {msg.src} is a {control.kind} "
            f"payload of {control.nbytes} bytes; the message is {msg.nbytes} bytes"
        )
    return control


def rebuild_message(
    msg: ReshardMessage,
    control: Control,
    payload: torch.Tensor,
    regions: Sequence[torch.Tensor],
    scratch: torch.Tensor,
) -> None:
    """Apply a delta message to its byte ranges in staging (`regions`, one per item, holding the
    base), checked against the sender's digest before they are written back.

    `scratch` is flat uint8 of at least the padded message. `ChecksumMismatchError` when the
    result is not the sender's (another base, torn bytes): staging then holds the base still.
    """
    size = padded(msg.nbytes)
    out = scratch[:size]
    out[msg.nbytes :].zero_()
    views = []
    for (t, offset), region in zip(msg.items, regions, strict=True):
        view = out[offset : offset + t.nbytes].view(region.dtype).view(region.shape)
        view.copy_(region)
        views.append(view)
    apply_delta(control.kind, payload, out)
    got = bucket_digest(out)
    if got != control.digest:
        names = ", ".join(sorted({t.dst_param for t, _ in msg.items}))
        raise ChecksumMismatchError(
            f"message {msg.index} from train rank {msg.src} ({names}): the delta applied to this "
            f"rank's base gives digest {got:#018x}, the sender's version has {control.digest:#018x} "
            "(another base, or torn bytes): refused"
        )
    for view, region in zip(views, regions, strict=True):
        region.copy_(view)
