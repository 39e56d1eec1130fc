"""The generation side of a reshard (`_reshard.py` describes the protocol)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

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
from rlfleet.weightsync.codec._delta_state import DeltaBase, holds_base
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import bucket_starts, typed_view
from rlfleet.weightsync.protocol._core import (
    Pending,
    Status,
    before_vote,
    consumer_error,
    prepare,
    safe_abort,
    tensor_bytes,
)
from rlfleet.weightsync.protocol._frames import CONTROL_BYTES, Control
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.protocol._wire_base import BucketTarget
from rlfleet.weightsync.reshard._reshard_delta import CONTROL_TAG, check_control, padded, rebuild_message
from rlfleet.weightsync.reshard._reshard_program import GEN, TRAIN, ReshardMessage, Transfer
from rlfleet.weightsync.reshard._reshard_session import (
    HEADER_BYTES,
    HEADER_TAG,
    ReshardSession,
    ReshardStats,
    decode_header,
)

__all__ = ["ReshardReceiver"]


def _status_of(failure: WeightSyncError) -> Status:
    return Status.CHECKSUM if isinstance(failure, ChecksumMismatchError) else Status.CONSUMER


def _merged_extras(headers: list[dict[str, Any]]) -> dict[str, Any]:
    """The extras of every header, one level of dicts merged (each group's lead sends its own)."""
    extras: dict[str, Any] = {}
    for h in headers:
        for key, value in h["extras"].items():
            if isinstance(value, dict) and isinstance(extras.get(key), dict):
                extras[key].update(value)
            else:
                extras[key] = value
    return extras


class ReshardReceiver(ReshardSession):
    """Generation side: receives this rank's shard of each version into a `BucketConsumer`.

    The consumer's layout must hold exactly this rank's tensors (`RankProgram.layout` builds
    one; any bucket size works). ``receive(consumer, deadline)`` stages everything, checks every
    group agreed, lets the consumer prepare its commit, then commits on every generation rank
    or aborts on all; the returned stats carry the header's extras (e.g. kv-cache scales). The
    deadline defaults to `DEFAULT_SYNC_TIMEOUT_S`.

    A consumer that can rebuild a delta (`codec.DeltaBase`: the buffers, the node buffer) gets
    the delta of its own byte ranges from each training rank whose base is its applied version,
    rebuilt in staging and checked against the sender's digest before it is consumed
    (`_reshard_delta`); the stats' `delta_peers` name those training ranks.
    """

    ROLE = GEN
    _staging: torch.Tensor | None = None
    _scratch: torch.Tensor | None = None

    def release_buffers(self) -> None:
        super().release_buffers()
        self._staging = None
        self._scratch = None

    def receive(
        self, consumer: BucketConsumer, deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S
    ) -> ReshardStats:
        deadline = Deadline.coerce(deadline)
        start = time.perf_counter()
        return self.guarded(lambda: self._receive(consumer, deadline, start))

    def _check_layout(self, layout: Layout) -> WeightSyncError | None:
        rank = self.program.rank
        mine = {name: (shape, dtype) for name, shape, dtype in self.program.tensors}
        for spec in layout.tensors:
            if spec.name not in mine:
                return LayoutMismatchError(
                    f"gen rank {rank}: consumer holds {spec.name!r}, which the plan does not", spec.name
                )
            if mine[spec.name] != (spec.shape, spec.dtype):
                shape, dtype = mine[spec.name]
                return LayoutMismatchError(
                    f"gen rank {rank}: consumer's {spec.name!r} is {spec.dtype} {spec.shape}, "
                    f"the plan's shard is {dtype} {shape}",
                    spec.name,
                )
        missing = [name for name in mine if name not in layout]
        if missing:
            return LayoutMismatchError(
                f"gen rank {rank}: consumer lacks {missing[0]!r} of the plan", missing[0]
            )
        return None

    def _headers(self, deadline: Deadline) -> list[dict[str, Any]]:
        posted: list[tuple[Pending, torch.Tensor, str]] = []
        for g in self.groups:
            if g.lead is None:
                continue
            frame = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=g.wire.device)
            what = f"reshard header from train rank {g.lead}"
            posted.append((g.wire.recv(frame, g.members[(TRAIN, g.lead)], HEADER_TAG), frame, what))
        headers = []
        for op, frame, what in posted:
            op.wait(deadline, what)
            headers.append(decode_header(tensor_bytes(frame)))
        if not headers:
            raise MetadataError(f"gen rank {self.program.rank}: no peer group has a training rank")
        return headers

    def _own_status(
        self, consumer: BucketConsumer, headers: list[dict[str, Any]], version: int, deadline: Deadline
    ) -> tuple[Status, WeightSyncError | None]:
        """This rank's negotiation status: the headers agree, the consumer fits and began `version`."""
        versions = {h["version"] for h in headers}
        aborts = [h["abort"] for h in headers if h["abort"]]
        if aborts:
            return Status.ABORTED, SyncAbortedError(f"sender aborted version {version}: {aborts[0]}")
        if len(versions) != 1:
            return Status.VERSION, VersionError(
                f"training ranks announced different versions {sorted(versions)}"
            )
        if any(h["digest"] != self.program.digest for h in headers):
            return Status.PLAN, LayoutMismatchError("a training rank executes a different reshard plan")
        own = self._check_layout(consumer.layout)
        if own is not None:
            return Status.LAYOUT, own
        try:
            with caller_deadline(before_vote(deadline)):  # a consumer's begin waits under this sync's
                consumer.begin(version)
        except VersionError as exc:
            return Status.VERSION, exc
        except Exception as exc:
            return Status.CONSUMER, consumer_error(exc, f"consumer refused version {version}")
        return Status.OK, None

    def _receive(self, consumer: BucketConsumer, deadline: Deadline, start: float) -> ReshardStats:
        self.on_wire()
        headers = self._headers(deadline)
        versions = {h["version"] for h in headers}
        version = headers[0]["version"] if len(versions) == 1 else -1
        code, own = self._own_status(consumer, headers, version, deadline)
        began = code == Status.OK
        applied = getattr(consumer, "version", None)
        held = applied if began and isinstance(applied, int) and holds_base(consumer, applied) else -1
        try:
            outcome, codes = self._negotiate(code, version, deadline, held)
            ok = {key for key, why in outcome.items() if why is None}
            agreed = began and len(ok) == len(self.groups)
            messages = self._messages_in(ok)
            deltas = self._delta_peers()
            failure, total = self._stage(consumer, messages, agreed, version, deadline, deltas)
            status = Status.OK if failure is None else _status_of(failure)
            if agreed and failure is None:
                failure = prepare(consumer, version, deadline, f"gen rank {self.program.rank}")
                status = Status.OK if failure is None else Status.COMMIT
            vote = 0 if agreed and failure is None else 1
            groups = [g for g in self.groups if g.key in ok]
            problems, commit = self._commit_rounds(groups, status, vote, deadline)
            self.in_step()
        except BaseException as exc:
            if began:
                safe_abort(consumer, exc)
            raise
        error = own or failure
        if error is None and (not commit or not agreed):
            why = [f"group {k}: {w}" for k, w in outcome.items() if w is not None] + problems
            error = SyncAbortedError(
                f"gen rank {self.program.rank}: version {version} not applied: "
                f"{'; '.join(why) or 'a generation rank voted no'}"
            )
            if Status.VERSION in codes:
                error = VersionError(str(error))
        if error is not None:
            if began:
                safe_abort(consumer, error)
            raise error
        consumer.commit(version)  # prepared: cannot fail for a consumer that prepares
        peers = len(self.program.peers())
        return ReshardStats(
            version,
            len(messages),
            total,
            time.perf_counter() - start,
            peers,
            _merged_extras(headers),
            base=held if deltas else None,
            delta_peers=tuple(sorted(deltas)),
            full_bytes=sum(m.nbytes for m in messages),
        )

    def _stage(
        self,
        consumer: BucketConsumer,
        messages: list[ReshardMessage],
        agreed: bool,
        version: int,
        deadline: Deadline,
        deltas: set[int],
    ) -> tuple[WeightSyncError | None, int]:
        """Receive `messages` into staging; hand every bucket to the consumer if all agreed.

        With delta pairs (`deltas`: their training ranks) the buckets they touch first hold the
        applied version (`DeltaBase.copy_base`), and each delta is rebuilt there and checked.
        """
        if not messages and not agreed:
            return None, 0
        layout = consumer.layout
        staging, regions = self._staging_for(consumer, layout, agreed)
        failure: WeightSyncError | None = None
        if agreed and deltas:
            failure = self._fill_base(consumer, layout, regions, [m for m in messages if m.src in deltas])
        total, failure = self._receive_data(messages, staging, deadline, deltas, failure, agreed)
        if not agreed:
            return None, total
        if failure is not None:
            return failure, total
        try:
            for bucket, region in zip(layout.buckets, regions, strict=True):
                consumer.consume(bucket.index, region)
        except Exception as exc:
            return consumer_error(exc, f"consumer failed to take version {version}"), total
        return None, total

    def _fill_base(
        self,
        consumer: BucketConsumer,
        layout: Layout,
        regions: list[torch.Tensor],
        messages: list[ReshardMessage],
    ) -> WeightSyncError | None:
        """The buckets the delta `messages` write, filled with the applied version (their base)."""
        touched = sorted({layout[t.dst_param].bucket for m in messages for t, _ in m.items})
        try:
            for index in touched:
                if not isinstance(consumer, DeltaBase) or not consumer.copy_base(index, regions[index]):
                    return ChecksumMismatchError(
                        f"gen rank {self.program.rank}: bucket {index}: the consumer cannot provide its base",
                        index,
                    )
        except Exception as exc:
            return consumer_error(exc, "consumer failed to provide its base")
        return None

    def _staging_for(
        self, consumer: BucketConsumer, layout: Layout, usable: bool
    ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Typed views of where each tensor lands, and each bucket's flat region."""
        device = self.groups[0].wire.device
        targets: list[torch.Tensor | None] = [None] * len(layout.buckets)
        if usable and isinstance(consumer, BucketTarget):
            for bucket in layout.buckets:
                t = consumer.bucket_target(bucket.index)
                if (
                    t is not None
                    and t.dtype == torch.uint8
                    and t.dim() == 1
                    and t.numel() >= bucket.nbytes
                    and t.device == device
                ):
                    targets[bucket.index] = t
        if any(t is None for t in targets) and (
            self._staging is None
            or self._staging.numel() < layout.padded_bytes
            or self._staging.device != device
        ):
            self._staging = torch.empty(layout.padded_bytes, dtype=torch.uint8, device=device)
        regions: list[torch.Tensor] = []
        for bucket, start in zip(layout.buckets, bucket_starts(layout), strict=True):
            t = targets[bucket.index]
            if t is None:
                assert self._staging is not None
                t = self._staging[start : start + bucket.nbytes]
            regions.append(t[: bucket.nbytes])
        views = {spec.name: typed_view(regions[spec.bucket], spec) for spec in layout.tensors}
        return views, regions

    def _receive_data(
        self,
        messages: list[ReshardMessage],
        staging: Mapping[str, torch.Tensor],
        deadline: Deadline,
        deltas: set[int],
        failure: WeightSyncError | None,
        apply: bool,
    ) -> tuple[int, WeightSyncError | None]:
        """Receive every message; a delta pair's control word first (its payload's size), its
        delta rebuilt in staging once landed. The bytes moved, and the first failure (a delta
        that does not rebuild the sender's bytes): messages keep being received after one.
        Without `apply` (the version will not be consumed) deltas are received, not rebuilt."""
        in_flight: deque[tuple[ReshardMessage, Pending, torch.Tensor | None, str, Control | None]] = deque()
        total = 0

        def region(t: Transfer) -> torch.Tensor:
            tensor = staging[t.dst_param]
            return tensor if t.dim is None else tensor.narrow(t.dim, t.dst_offset, t.length)

        def pop() -> None:
            nonlocal failure
            msg, op, buf, what, control = in_flight.popleft()
            op.wait(deadline, what)
            if buf is not None and control is not None and control.kind != FULL:
                if failure is None and apply:
                    try:
                        scratch = self._scratch_for(padded(msg.nbytes), buf.device)
                        rebuild_message(
                            msg, control, buf[: control.nbytes], [region(t) for t, _ in msg.items], scratch
                        )
                    except WeightSyncError as exc:
                        failure = exc
            elif buf is not None:
                for t, offset in msg.items:
                    dest = region(t)
                    dest.copy_(buf[offset : offset + t.nbytes].view(dest.dtype).view(dest.shape))
            self._give(buf)

        with torch.no_grad():
            for msg in messages:
                while len(in_flight) >= self.max_in_flight:
                    pop()
                group, group_rank = self._route[(TRAIN, msg.src)]
                device = group.wire.device
                control = self._control(msg, deadline) if msg.src in deltas else None
                buf: torch.Tensor | None = None
                dest: torch.Tensor | None = None
                if control is not None and control.kind != FULL:
                    buf = self._take(control.nbytes, device)
                    dest = buf[: control.nbytes]
                elif len(msg.items) == 1:
                    r = region(msg.items[0][0])
                    if r.is_contiguous() and r.device == device:
                        dest = r.reshape(-1).view(torch.uint8)
                if dest is None:
                    buf = self._take(msg.nbytes, device)
                    dest = buf[: msg.nbytes]
                what = f"reshard message {msg.index} from train rank {msg.src}"
                in_flight.append((msg, group.wire.recv(dest, group_rank, msg.tag), buf, what, control))
                total += int(dest.numel()) + (CONTROL_BYTES if control is not None else 0)
            while in_flight:
                pop()
        return total, failure

    def _control(self, msg: ReshardMessage, deadline: Deadline) -> Control:
        """A delta pair's control word for `msg` (waited for: the payload's size depends on it)."""
        group, group_rank = self._route[(TRAIN, msg.src)]
        raw = torch.zeros(CONTROL_BYTES, dtype=torch.uint8, device=group.wire.device)
        what = f"control word of reshard message {msg.index} from train rank {msg.src}"
        group.wire.recv(raw, group_rank, CONTROL_TAG + msg.index).wait(deadline, what)
        return check_control(Control.decode(tensor_bytes(raw)), msg)

    def _scratch_for(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < nbytes or self._scratch.device != device:
            largest = max((padded(m.nbytes) for m in self.messages), default=nbytes)
            self._scratch = torch.empty(max(nbytes, largest), dtype=torch.uint8, device=device)
        return self._scratch
