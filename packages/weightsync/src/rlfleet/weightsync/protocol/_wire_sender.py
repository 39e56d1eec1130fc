"""The sending end of the broadcast protocol (`_wire.py` describes the protocol).

The sender packs bucket ``k+1`` while bucket ``k`` is on the wire (two bucket buffers); tensors
of at least ``direct_min`` bytes travel straight from their own storage, and a state dict that
lies in one adopted block (`flat_block`) is sent as it lies. A `WeightStream` (`_stream`) is
pulled bucket by bucket (`StreamedBuckets`): a large tensor goes on the wire from its own storage,
small ones are copied into a buffer of the bucket's packed bytes, and a bucket is dropped once it
is on the wire, so the sender holds two buckets and the tensor in hand, never the model. A
failure while packing (a stream that breaks the layout's order included) is sent in the next
control word, so receivers stop after the same collective and the group stays usable.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Literal, overload

import torch

from rlfleet.weightsync._deadline import DEFAULT_SYNC_TIMEOUT_S, Deadline
from rlfleet.weightsync._errors import (
    LayoutMismatchError,
    PeerLostError,
    SyncAbortedError,
    SyncTimeoutError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync.codec._delta import DEFAULT_MAX_FRACTION, FULL
from rlfleet.weightsync.codec._delta_state import DeltaEncoder, check_delta_mode
from rlfleet.weightsync.layout._block import flat_block
from rlfleet.weightsync.layout._copy import copy_pairs
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import bucket_starts
from rlfleet.weightsync.protocol._background import BackgroundSends, PublishHandle
from rlfleet.weightsync.protocol._core import (
    Pending,
    Status,
    bytes_tensor,
    check_version,
    describe,
    raw_bytes,
    status_round,
)
from rlfleet.weightsync.protocol._frames import (
    DEFAULT_DIRECT_MIN_BYTES,
    Control,
    Header,
    Segment,
    bucket_segments,
    check_share,
    wire_nbytes,
)
from rlfleet.weightsync.protocol._stream import (
    Source,
    StreamCursor,
    StreamedBuckets,
    Weights,
    drain_on_error,
    fill_bucket,
    open_source,
)
from rlfleet.weightsync.protocol._wire_base import BroadcastSession, SyncStats, Wire, crc_of, rank_label

__all__ = ["ProtocolSender"]

#: Buckets the sender keeps on the wire while it packs the next one (the pipeline depth).
BUCKETS_IN_FLIGHT = 1


class ProtocolSender(BroadcastSession):
    """Sending end of the broadcast protocol over any `Wire`."""

    _background: BackgroundSends[SyncStats] | None = None  # its non-blocking sends, at first use

    def __init__(
        self,
        layout: Layout,
        wire: Wire,
        checksums: bool = False,
        direct_min: int = DEFAULT_DIRECT_MIN_BYTES,
        *,
        delta: str = "off",
        delta_max_fraction: float = DEFAULT_MAX_FRACTION,
    ) -> None:
        super().__init__(wire, direct_min)
        #: The sender's base and per-bucket delta choice (None: ``delta="off"``, every version full).
        self.delta: DeltaEncoder | None = (
            None if check_delta_mode(delta) == "off" else DeltaEncoder(layout, delta, delta_max_fraction)
        )
        if wire.rank != wire.src:
            raise ValueError(f"sender must be the group's source rank {wire.src}, this is rank {wire.rank}")
        self.layout = layout
        self.checksums = checksums
        self._segments = [bucket_segments(layout, b.index, direct_min) for b in layout.buckets]
        #: The tensors inside each segment, per bucket (precomputed: the hot loop only copies).
        self._members = [
            [[t for t in b.tensors if t.nbytes and seg.start <= t.offset < seg.end] for seg in segs]
            for b, segs in zip(layout.buckets, self._segments, strict=True)
        ]
        self._view_cache: dict[tuple[int, int], tuple[int, dict[str, torch.Tensor]]] = {}
        self._layout_json: bytes | None = None
        self._starts = bucket_starts(layout)
        self._streamed = StreamedBuckets(layout, self._segments, wire.device)

    def _views(self, slot: int, k: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of bucket `k`'s tensors inside bucket buffer `slot` (cached per buffer)."""
        cached = self._view_cache.get((slot, k))
        if cached is not None and cached[0] == buffer.data_ptr():
            return cached[1]
        views = {
            spec.name: buffer[spec.offset : spec.offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)
            for spec in self.layout.buckets[k].tensors
            if spec.nbytes
        }
        self._view_cache[(slot, k)] = (buffer.data_ptr(), views)
        return views

    def release_buffers(self) -> None:
        self._view_cache.clear()
        super().release_buffers()

    def _layout_bytes(self) -> bytes:
        if self._layout_json is None:
            self._layout_json = self.layout.to_json()
        return self._layout_json

    @overload
    def send(
        self,
        weights: Weights,
        version: int,
        deadline: Deadline | float | None = ...,
        *,
        buckets: Sequence[int] | None = ...,
        wait: Literal[True] = ...,
    ) -> SyncStats: ...
    @overload
    def send(
        self,
        weights: Weights,
        version: int,
        deadline: Deadline | float | None = ...,
        *,
        buckets: Sequence[int] | None = ...,
        wait: Literal[False],
    ) -> PublishHandle[SyncStats]: ...
    def send(
        self,
        weights: Weights,
        version: int,
        deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S,
        *,
        buckets: Sequence[int] | None = None,
        wait: bool = True,
    ) -> SyncStats | PublishHandle[SyncStats]:
        """Broadcast `weights` as `version`; returns only once every receiver committed it.

        `weights` is a state dict or a `WeightStream` (any iterable of ``(name, tensor)`` pairs
        in the layout's order: the tensors of `buckets` only, for a share); a stream is drained
        after a failure (`_stream`). `buckets` sends only those bucket indices (a share of
        several senders; None: all). `version` is checked first (an int in [0, 2**63)): a bad
        one is refused before anything is sent, and the group stays usable.

        ``wait=False``: returns a `PublishHandle` once a private snapshot of `weights` is under
        way (``snapshot_done()``: the fence before changing them; ``result()``: the `SyncStats`);
        the broadcast runs in the background, newest snapshot first (`_background`).
        """
        deadline = Deadline.coerce(deadline)
        later = self._later()
        if not wait:
            try:
                check_version(version)
            except VersionError:  # refused before anything starts; a stream is drained
                with drain_on_error(open_source(weights, self.layout, buckets), deadline):
                    raise
            return later.start(
                weights, version, deadline, lambda s: self._send_now(s, version, deadline, buckets), buckets
            )
        later.settle(deadline)
        return self._send_now(weights, version, deadline, buckets)

    def _later(self) -> BackgroundSends[SyncStats]:
        if self._background is None:
            self._background = BackgroundSends(self.layout, f"broadcast sender (rank {self.wire.rank})")
        return self._background

    def _send_now(
        self, weights: Weights, version: int, deadline: Deadline, buckets: Sequence[int] | None
    ) -> SyncStats:
        share = check_share(buckets, len(self.layout.buckets))
        source = open_source(weights, self.layout, share)
        with drain_on_error(source, deadline):
            version = check_version(version)
            start = time.perf_counter()
            return self.guarded(lambda: self._send(source, version, share, deadline, start))

    def _send(
        self,
        source: Source,
        version: int,
        share: tuple[int, ...] | None,
        deadline: Deadline,
        start: float,
    ) -> SyncStats:
        wire, layout = self.wire, self.layout
        problem: WeightSyncError | None = None
        if not isinstance(source, StreamCursor):  # a stream is checked as it is read
            try:
                layout.check_state_dict(source, buckets=share, sending=True)
            except WeightSyncError as exc:
                problem = exc
        offer = None if self.delta is None or problem is not None else self.delta.offer()
        header = Header(
            version=version,
            digest=layout.digest,
            buckets=len(layout.buckets),
            checksums=self.checksums,
            layout_nbytes=len(self._layout_bytes()),
            direct_min=self.direct_min,
            abort=None if problem is None else f"sender's state dict does not fit its layout: {problem}",
            share=share,
            base=offer,
        )
        frame = bytes_tensor(header.encode(), wire.device)
        self.on_wire()
        wire.broadcast(frame).wait(deadline, "sync header broadcast")
        if problem is not None:
            self.in_step()
            raise problem
        committed = False
        try:
            codes, lacking = self._negotiate(offer, deadline)
            if any(codes):
                self._refused(version, codes, deadline)
            delta = offer is not None and not lacking
            if self.delta is not None:
                self.delta.start(version, delta)
            indices = list(range(len(layout.buckets))) if share is None else list(share)
            total = self._send_buckets(source, indices, deadline)
            codes = self._status_round(Status.OK, deadline, "sync commit")
            self.in_step()
            if any(codes):
                raise SyncAbortedError(
                    f"version {version} aborted, nothing applied: {describe(codes, rank_label)}"
                )
            committed = True
        finally:
            if self.delta is not None:
                self.delta.finish(version, committed, share)
        full = layout.padded_bytes if share is None else sum(layout.buckets[k].nbytes for k in share)
        return SyncStats(
            version,
            len(indices),
            total,
            time.perf_counter() - start,
            full_bytes=full,
            base=offer if delta else None,
            full_ranks=tuple(lacking) if offer is not None else (),
        )

    def _negotiate(self, offer: int | None, deadline: Deadline) -> tuple[list[int], list[int]]:
        """The negotiation round: every rank's status and, with a delta offered, the receivers
        that lack its base (the version then goes full to every one of them: one broadcast)."""
        if offer is None:
            return self._status_round(Status.OK, deadline, "sync negotiation"), []
        codes, holds = status_round(self.wire, (Status.OK, 1), deadline, "sync negotiation")
        return codes, [r for r, held in enumerate(holds) if not held]

    def _refused(self, version: int, codes: list[int], deadline: Deadline) -> None:
        """A receiver refused the version in the negotiation: tell it our layout if it asks, raise."""
        if Status.LAYOUT in codes:
            raw = bytes_tensor(self._layout_bytes(), self.wire.device)
            self.wire.broadcast(raw).wait(deadline, "layout broadcast")
        self.in_step()
        message = f"version {version} not sent: {describe(codes, rank_label)}"
        if Status.LAYOUT in codes:
            raise LayoutMismatchError(message)
        if Status.VERSION in codes:
            raise VersionError(message)
        raise SyncAbortedError(message)

    def _send_buckets(self, source: Source, indices: list[int], deadline: Deadline) -> int:
        wire = self.wire
        in_flight: deque[tuple[Pending, str, int]] = deque()
        slot_ops: list[list[Pending]] = [[], []]
        total = 0
        block = None if isinstance(source, StreamCursor) else flat_block(self.layout, source)
        if block is not None and (block.device != wire.device or self.delta is not None):
            block = None  # else the model lies in one block: every run is sent as it lies

        held: dict[int, list[torch.Tensor]] = {}  # a stream's buckets, alive until on the wire

        def drain(upto: int) -> None:
            """Wait for every op of buckets up to position `upto` (older buckets finish first)."""
            while in_flight and in_flight[0][2] <= upto:
                op, what, _ = in_flight.popleft()
                op.wait(deadline, what)
            for done in [p for p in held if p <= upto]:
                del held[done]

        with torch.no_grad():
            for position, k in enumerate(indices):
                slot = position % 2
                segments = self._segments[k]
                drain(position - 1 - BUCKETS_IN_FLIGHT)  # bucket k-1 stays on the wire while k is packed
                kind, digest, nbytes = FULL, None, wire_nbytes(segments)
                try:
                    if self.delta is not None:
                        sources, kind, digest = self._encoded(source, k, slot, slot_ops, deadline)
                        packed = True
                        held[position] = sources
                        nbytes = sum(int(s.numel()) for s in sources)
                        if isinstance(source, StreamCursor) and position == len(indices) - 1:
                            source.finish()
                    elif block is not None:
                        base = self._starts[k]
                        sources, packed = [block[base + g.start : base + g.end] for g in segments], False
                    elif isinstance(source, StreamCursor):
                        sources, packed = self._streamed.pull(source, k), False
                        held[position] = sources
                        if position == len(indices) - 1:
                            source.finish()  # nothing may follow the last tensor
                    else:
                        sources, packed = self._pack(source, k, segments, slot, slot_ops, deadline)
                    crc = crc_of(sources) if self.checksums else None
                except (PeerLostError, SyncTimeoutError):
                    raise  # a wait on the wire failed: the group is mid-collective
                except Exception as exc:
                    self._abort_at(k, exc, in_flight, deadline)
                    if isinstance(exc, WeightSyncError):
                        raise
                    raise SyncAbortedError(f"sender failed to pack bucket {k}: {exc}") from exc
                control = Control(k, nbytes, crc, kind=kind, digest=digest)
                in_flight.append(
                    (wire.broadcast(bytes_tensor(control.encode(), wire.device)), f"control {k}", position)
                )
                ops: list[Pending] = []
                for src in sources:
                    op = wire.broadcast(src)
                    ops.append(op)
                    in_flight.append((op, f"bucket {k} broadcast", position))
                if packed:
                    slot_ops[slot] = ops
                total += control.nbytes
            drain(len(indices))
        return total

    def _pack(
        self,
        state_dict: Mapping[str, torch.Tensor],
        k: int,
        segments: list[Segment],
        slot: int,
        slot_ops: list[list[Pending]],
        deadline: Deadline,
    ) -> tuple[list[torch.Tensor], bool]:
        """The tensors to broadcast for bucket `k`, packing small runs into bucket buffer `slot`."""
        device = self.wire.device
        sources: list[torch.Tensor] = []
        buffer: torch.Tensor | None = None
        for seg, members in zip(segments, self._members[k], strict=True):
            if seg.tensor is not None and state_dict[seg.tensor].dtype == self.layout[seg.tensor].torch_dtype:
                own = raw_bytes(state_dict[seg.tensor], device)
                if own is not None:
                    sources.append(own)
                    continue
            if buffer is None:
                self._free_buffer(slot, slot_ops, deadline)
                buffer = self._buffer(slot, self.layout.buckets[k].nbytes)
            views = self._views(slot, k, buffer)
            copy_pairs(
                [views[spec.name] for spec in members], [state_dict[spec.name].detach() for spec in members]
            )
            sources.append(buffer[seg.start : seg.end])
        return sources, buffer is not None

    def _encoded(
        self, source: Source, k: int, slot: int, slot_ops: list[list[Pending]], deadline: Deadline
    ) -> tuple[list[torch.Tensor], str, int | None]:
        """Bucket `k` packed whole (cast to the wire dtype) and encoded against the sender's base:
        its segments when it goes full, else its one delta payload; with its kind and digest."""
        assert self.delta is not None
        self._free_buffer(slot, slot_ops, deadline)
        buffer = self._buffer(slot, self.layout.buckets[k].nbytes)
        views = self._views(slot, k, buffer)
        if isinstance(source, StreamCursor):
            fill_bucket(source, k, buffer, views)
        else:
            members = [spec.name for spec in self.layout.buckets[k].tensors if spec.nbytes]
            copy_pairs([views[n] for n in members], [source[n].detach() for n in members])
        delta = self.delta.last.base is not None
        payload = self.delta.encode(k, buffer, delta)
        if payload.kind == FULL:
            bucket = buffer
            return [bucket[g.start : g.end] for g in self._segments[k]], FULL, None
        return [payload.data.to(self.wire.device)], payload.kind, payload.digest

    def _free_buffer(self, slot: int, slot_ops: list[list[Pending]], deadline: Deadline) -> None:
        """Wait until the bucket that last used buffer `slot` is on the wire."""
        for op in slot_ops[slot]:
            op.wait(deadline, f"bucket buffer {slot} reuse")
        slot_ops[slot] = []

    def _abort_at(
        self, k: int, error: BaseException, in_flight: deque[tuple[Pending, str, int]], deadline: Deadline
    ) -> None:
        """Tell receivers bucket `k` will never come; they stop after this same collective."""
        control = Control(k, 0, None, f"sender failed at bucket {k}: {type(error).__name__}: {error}")
        op = self.wire.broadcast(bytes_tensor(control.encode(), self.wire.device))
        while in_flight:
            pending, what, _ = in_flight.popleft()
            pending.wait(deadline, what)
        op.wait(deadline, "abort control word")
        self.in_step()
