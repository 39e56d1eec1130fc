"""The receiving end of the broadcast protocol (`_wire.py` describes the protocol).

A receiver that fails mid-sync (bad checksum, a consumer error) keeps draining the remaining
buckets so the group stays in step, and reports its failure in the commit round. Before it
votes yes it lets the consumer prepare its commit (`_core.prepare`): a receiver never votes for
a version it then fails to apply.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from rlfleet.weightsync._deadline import DEFAULT_SYNC_TIMEOUT_S, Deadline, caller_deadline
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    LayoutMismatchError,
    MetadataError,
    SyncAbortedError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync.codec._delta import FULL
from rlfleet.weightsync.codec._delta_state import holds_base
from rlfleet.weightsync.layout._layout import MAX_METADATA_BYTES, Layout, TensorSpec
from rlfleet.weightsync.protocol._core import (
    Pending,
    Status,
    before_vote,
    consumer_error,
    describe,
    prepare,
    safe_abort,
    status_round,
    tensor_bytes,
)
from rlfleet.weightsync.protocol._frames import (
    CONTROL_BYTES,
    DEFAULT_DIRECT_MIN_BYTES,
    HEADER_BYTES,
    Control,
    Header,
    bucket_segments,
    check_share,
    wire_nbytes,
)
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.protocol._wire_base import (
    BroadcastSession,
    BucketTarget,
    DeltaRebuilder,
    SyncStats,
    TensorTarget,
    Wire,
    crc_of,
    fitting_target,
    rank_label,
)

__all__ = ["ProtocolReceiver"]


def _share_words(share: Sequence[int] | None) -> str:
    return "every bucket" if share is None else f"buckets {list(share)}"


def _status_of(error: WeightSyncError) -> Status:
    if isinstance(error, ChecksumMismatchError):
        return Status.CHECKSUM
    if isinstance(error, LayoutMismatchError):
        return Status.LAYOUT
    return Status.CONSUMER


def _tensor_region(
    target: torch.Tensor | None, spec: TensorSpec, device: torch.device
) -> torch.Tensor | None:
    """`target` as the flat bytes of tensor `spec`, or None if it does not fit exactly."""
    if (
        target is None
        or not target.is_contiguous()
        or target.dtype != spec.torch_dtype
        or tuple(target.shape) != spec.shape
        or target.device != device
        or target.is_conj()
        or target.is_neg()
    ):
        return None
    return target.detach().reshape(-1).view(torch.uint8)


class ProtocolReceiver(BroadcastSession):
    """Receiving end of the broadcast protocol over any `Wire`."""

    def __init__(self, layout: Layout, wire: Wire) -> None:
        super().__init__(wire, DEFAULT_DIRECT_MIN_BYTES)
        if wire.rank == wire.src:
            raise ValueError(f"rank {wire.rank} is the sender of this group, not a receiver")
        self.layout = layout

    def receive(
        self,
        consumer: BucketConsumer,
        deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S,
        *,
        buckets: Sequence[int] | None = None,
    ) -> SyncStats:
        """Receive one version into `consumer`; on any failure it is aborted and raises.

        `buckets` are the bucket indices this sender's share holds (None: all); a sender that
        announces another share is refused in the negotiation, with nothing applied.
        """
        share = check_share(buckets, len(consumer.layout.buckets))
        deadline = Deadline.coerce(deadline)
        start = time.perf_counter()
        version, total, count = self.guarded(lambda: self._receive(consumer, share, deadline))
        return SyncStats(version, count, total, time.perf_counter() - start)

    def _receive(
        self, consumer: BucketConsumer, share: tuple[int, ...] | None, deadline: Deadline
    ) -> tuple[int, int, int]:
        wire = self.wire
        raw = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=wire.device)
        self.on_wire()
        wire.broadcast(raw).wait(deadline, "sync header broadcast")
        header = Header.decode(tensor_bytes(raw))
        if header.abort is not None:
            self.in_step()
            raise SyncAbortedError(f"sender aborted version {header.version}: {header.abort}")
        code, own_error = self._negotiate(consumer, header, share, deadline)
        began = code == Status.OK
        try:
            if header.base is None:
                codes, delta = self._status_round(code, deadline, "sync negotiation"), False
            else:  # a delta is offered: every rank says whether it holds the base
                held = int(code == Status.OK and holds_base(consumer, header.base))
                codes, holds = status_round(self.wire, (code, held), deadline, "sync negotiation")
                delta = all(h for r, h in enumerate(holds) if r != self.wire.src)
            if any(codes):
                self._refused(consumer.layout, header, codes, code, own_error, deadline)
            inbound = _Inbound(self, consumer, header, deadline, delta)
            total, failure = inbound.run()
            if failure is None:
                failure = prepare(consumer, header.version, deadline, f"rank {wire.rank}")
                code = Status.OK if failure is None else Status.COMMIT
            else:
                code = _status_of(failure)
            codes = self._status_round(code, deadline, "sync commit")
            self.in_step()
        except BaseException as exc:
            if began:
                safe_abort(consumer, exc)
            raise
        if failure is None and any(codes):
            failure = SyncAbortedError(
                f"version {header.version} aborted, nothing applied: "
                f"{describe(codes, rank_label, skip=wire.rank)}"
            )
        if failure is not None:
            safe_abort(consumer, failure)
            raise failure
        consumer.commit(header.version)  # prepared: cannot fail for a consumer that prepares
        return header.version, total, len(inbound.indices)

    def _negotiate(
        self, consumer: BucketConsumer, header: Header, share: tuple[int, ...] | None, deadline: Deadline
    ) -> tuple[Status, WeightSyncError | None]:
        """This rank's status for the negotiation round (and its own error, if it has one)."""
        if header.digest != consumer.layout.digest:
            return Status.LAYOUT, None
        if header.share != share:
            return Status.SHARE, SyncAbortedError(
                f"version {header.version} not applied: this receiver expects {_share_words(share)} "
                f"from the sender, which announces {_share_words(header.share)}"
            )
        try:
            with caller_deadline(before_vote(deadline)):  # a node buffer waits for readers
                consumer.begin(header.version)  # under this sync's deadline, not a timeout of its own
        except VersionError as exc:
            return Status.VERSION, exc
        except Exception as exc:
            return Status.CONSUMER, consumer_error(exc, f"consumer refused version {header.version}")
        return Status.OK, None

    def _refused(
        self,
        layout: Layout,
        header: Header,
        codes: list[int],
        code: Status,
        own_error: WeightSyncError | None,
        deadline: Deadline,
    ) -> None:
        """Some rank refused the version: name the differing parameter if it was us, and raise."""
        if Status.LAYOUT in codes:
            theirs = self._receive_layout(header, deadline)
            self.in_step()
            if code == Status.LAYOUT:
                found = layout.difference(theirs)
                name, problem = found if found is not None else (None, "digests differ")
                raise LayoutMismatchError(
                    f"version {header.version} not applied: layout mismatch with the sender: {problem}",
                    name,
                )
        self.in_step()
        if own_error is not None:
            raise own_error
        raise SyncAbortedError(
            f"version {header.version} not applied: {describe(codes, rank_label, skip=self.wire.rank)}"
        )

    def _receive_layout(self, header: Header, deadline: Deadline) -> Layout:
        if header.layout_nbytes > MAX_METADATA_BYTES:
            raise MetadataError(
                f"sender's layout is {header.layout_nbytes} bytes, over the {MAX_METADATA_BYTES} limit"
            )
        raw = torch.zeros(header.layout_nbytes, dtype=torch.uint8, device=self.wire.device)
        self.wire.broadcast(raw).wait(deadline, "layout broadcast")
        return Layout.from_json(tensor_bytes(raw))


class _Inbound:
    """One version's buckets arriving: bucket k is consumed while bucket k+1 lands."""

    def __init__(
        self,
        session: ProtocolReceiver,
        consumer: BucketConsumer,
        header: Header,
        deadline: Deadline,
        delta: bool = False,
    ) -> None:
        layout = consumer.layout
        if header.buckets != len(layout.buckets):
            raise MetadataError(
                f"header announces {header.buckets} buckets, layout has {len(layout.buckets)}"
            )
        self.session = session
        self.wire = session.wire
        self.consumer = consumer
        self.layout = layout
        self.header = header
        self.deadline = deadline
        self.indices = list(range(len(layout.buckets))) if header.share is None else list(header.share)
        self.plans = {k: bucket_segments(layout, k, header.direct_min) for k in self.indices}
        self.targets = consumer if isinstance(consumer, BucketTarget) else None
        self.landing = consumer if isinstance(consumer, TensorTarget) else None
        self.failure: WeightSyncError | None = None
        #: Whether buckets may come as deltas (every receiver holds the base the header offers).
        self.delta = delta
        self._rebuilder = DeltaRebuilder(self.wire.device)

    def run(self) -> tuple[int, WeightSyncError | None]:
        """Receive every bucket of the share; the bytes moved, and this rank's failure if any."""
        indices, total = self.indices, 0
        if not indices:
            return 0, None
        control = self._read_control(indices[0], self._post_control())
        current = self._post_data(0, indices[0], control)
        for position, k in enumerate(indices):
            after = indices[position + 1] if position + 1 < len(indices) else None
            next_control = self._post_control() if after is not None else None
            dest, ops, regions = current
            for op in ops:
                op.wait(self.deadline, f"bucket {k} broadcast")
            total += control.nbytes
            following: Control | None = None
            if after is not None and next_control is not None:
                following = self._read_control(after, next_control)
                current = self._post_data(position + 1, after, following)  # lands while k is consumed
            if self.failure is None:
                self._take(k, control, dest, regions)
            if following is not None:
                control = following
        return total, self.failure

    def _post_control(self) -> tuple[torch.Tensor, Pending]:
        t = torch.zeros(CONTROL_BYTES, dtype=torch.uint8, device=self.wire.device)
        return t, self.wire.broadcast(t)

    def _read_control(self, k: int, pending: tuple[torch.Tensor, Pending]) -> Control:
        t, op = pending
        op.wait(self.deadline, f"control word {k}")
        control = Control.decode(tensor_bytes(t))
        if control.abort is not None:
            self.session.in_step()  # the sender stops after this same broadcast
            raise SyncAbortedError(f"sender aborted version {self.header.version}: {control.abort}")
        expected = wire_nbytes(self.plans[k])
        if control.kind != FULL:
            if not self.delta or control.digest is None or control.nbytes > self.layout.buckets[k].nbytes:
                raise MetadataError(
                    f"control word says bucket {control.bucket} is a {control.kind} delta of "
                    f"{control.nbytes} bytes{'' if self.delta else ' in a version that is not a delta'}"
                )
            expected = control.nbytes
        if control.bucket != k or control.nbytes != expected:
            raise MetadataError(
                f"control word says bucket {control.bucket} with {control.nbytes} bytes, "
                f"expected bucket {k} with {expected}"
            )
        return control

    def _landing_zone(self, k: int) -> torch.Tensor | None:
        """The consumer's own storage for bucket `k`, if it offers a fitting one."""
        if self.targets is None or self.failure is not None:
            return None
        return fitting_target(self.targets, k, self.layout.buckets[k].nbytes, self.wire.device)

    def _post_data(
        self, position: int, k: int, control: Control
    ) -> tuple[torch.Tensor, list[Pending], list[torch.Tensor]]:
        if control.kind != FULL:  # a delta payload: into a bucket buffer, rebuilt when consumed
            payload = self.session._buffer(position % 2, self.layout.max_bucket_nbytes)[: control.nbytes]
            return payload, [self.wire.broadcast(payload)], [payload]
        dest = self._landing_zone(k)
        own = dest is None
        if dest is None:
            dest = self.session._buffer(position % 2, self.layout.max_bucket_nbytes)
        regions: list[torch.Tensor] = []
        for seg in self.plans[k]:
            region = None
            if own and seg.tensor is not None and self.landing is not None and self.failure is None:
                spec = self.layout[seg.tensor]
                region = _tensor_region(self.landing.tensor_target(seg.tensor), spec, self.wire.device)
            regions.append(dest[seg.start : seg.end] if region is None else region)
        return dest, [self.wire.broadcast(r) for r in regions], regions

    def _rebuild(self, k: int, control: Control, payload: torch.Tensor) -> torch.Tensor:
        """Bucket `k` of the new version from the consumer's base and the delta, where the full
        bucket would land (the consumer's own storage when it offers it), checked (`rebuild`)."""
        return self._rebuilder.rebuild(
            self.consumer, k, control.kind, payload, control.digest, self._landing_zone(k)
        )

    def _take(self, k: int, control: Control, dest: torch.Tensor, regions: list[torch.Tensor]) -> None:
        """Verify and consume bucket `k`; a failure is kept for the commit round, not raised."""
        version = self.header.version
        try:
            if self.header.checksums:
                got = crc_of(regions)
                if control.crc is None or got != control.crc:
                    raise ChecksumMismatchError(
                        f"bucket {k} of version {version}: crc32 {got:#010x}, "
                        f"sender computed {control.crc!r}",
                        k,
                    )
            if control.kind != FULL:
                dest = self._rebuild(k, control, dest)
            self.consumer.consume(k, dest[: self.layout.buckets[k].nbytes])
        except Exception as exc:
            self.failure = consumer_error(exc, f"consumer failed on bucket {k}")
