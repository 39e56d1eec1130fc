"""The broadcast sync protocol, written once over an abstract collective "wire".

`torch.distributed` (gloo or nccl, `_dist.py`) and NCCL through cupy (`_nccl.py`) only supply a
`Wire`: an async broadcast and an async sum all-reduce whose handles wait with a deadline.
Everything else (header, negotiation, per-bucket control words, the double-buffered bucket
pipeline, checksums, the two-phase commit and the abort paths) lives here, so both transports
behave the same and the protocol logic is covered by CPU tests.

One sync of version ``v``, every member of the group in the same order of collectives:

1. header: a fixed-size JSON broadcast from the sender (version, layout digest, bucket count,
   checksum flag, size of the sender's layout JSON, the direct-send threshold, or an abort
   reason if the sender's state dict does not fit its own layout);
2. negotiation: a sum all-reduce of one status code per rank (digest check and
   ``consumer.begin``); if a receiver's layout differs, the sender's layout JSON follows in one
   more broadcast so that receiver can name the first differing parameter; any non-zero code
   ends the sync on every rank, with nothing applied;
3. buckets: for bucket ``k`` a fixed-size control word (bucket index, wire bytes, crc32 or an
   abort reason), then its segments: runs of small tensors packed in a bucket buffer, large
   tensors sent straight from their own storage (no packing copy). The sender packs bucket
   ``k+1`` while bucket ``k`` is on the wire (two bucket buffers); a receiver consumes bucket
   ``k`` while bucket ``k+1`` arrives in its second buffer, or straight into the consumer's
   own storage when it offers one (`BucketTarget`). An abort in a control word stops every
   rank after the same collective;
4. commit: a second status all-reduce; every receiver commits only if every rank reported
   success, so a version lands on all receivers or on none.

A receiver that fails mid-sync (bad checksum, a consumer error) keeps draining the remaining
buckets so the group stays in step, and reports its failure in the commit round. Metadata is
JSON, never pickle, and bounded in size.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol, runtime_checkable

import torch

from rlfleet.weightsync._block import flat_block
from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    LayoutMismatchError,
    MetadataError,
    SyncAbortedError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync._json import decode_json
from rlfleet.weightsync._layout import Layout, TensorSpec
from rlfleet.weightsync._packing import bucket_starts
from rlfleet.weightsync._protocol import BucketConsumer

MAGIC = "rlfleet-weightsync"
PROTOCOL = 1
HEADER_BYTES = 4096
CONTROL_BYTES = 512
MAX_REASON_CHARS = 300
#: Tensors at least this large travel as their own segment, straight from their storage.
DEFAULT_DIRECT_MIN_BYTES = 4 * 1024 * 1024
#: Buckets the sender keeps on the wire while it packs the next one (the pipeline depth).
BUCKETS_IN_FLIGHT = 1


class Status(IntEnum):
    """Per-rank outcome codes exchanged in the negotiation and commit rounds."""

    OK = 0
    LAYOUT = 1
    VERSION = 2
    CHECKSUM = 3
    CONSUMER = 4
    ABORTED = 5


_STATUS_WORDS = {
    Status.OK: "ok",
    Status.LAYOUT: "has a different layout",
    Status.VERSION: "rejected the version",
    Status.CHECKSUM: "saw a checksum mismatch",
    Status.CONSUMER: "failed to take a bucket",
    Status.ABORTED: "aborted",
}


def _truncate(text: str, limit: int = MAX_REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _encode_fixed(payload: dict[str, Any], size: int, what: str) -> bytes:
    raw = json.dumps(payload, separators=(",", ":")).encode()
    if len(raw) > size:
        raise MetadataError(f"{what} is {len(raw)} bytes, over its fixed {size}-byte frame")
    return raw + b"\0" * (size - len(raw))


def _decode_fixed(raw: bytes, size: int, what: str) -> dict[str, Any]:
    if len(raw) != size:
        raise MetadataError(f"{what} frame is {len(raw)} bytes, expected {size}")
    data = decode_json(raw.rstrip(b"\0"), what)
    if not isinstance(data, dict):
        raise MetadataError(f"{what} must be a JSON object, got {type(data).__name__}")
    return data


def _int_field(data: Mapping[str, Any], key: str, what: str, minimum: int = 0) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MetadataError(f"{what}: field {key!r} must be an int >= {minimum}, got {value!r:.80}")
    return value


def _reason_field(data: Mapping[str, Any], what: str) -> str | None:
    value = data.get("abort")
    if value is not None and not isinstance(value, str):
        raise MetadataError(f"{what}: field 'abort' must be a string or null")
    return value


@dataclass(frozen=True)
class Header:
    """First message of a sync: what is coming, or why nothing is."""

    version: int
    digest: str
    buckets: int
    checksums: bool = False
    layout_nbytes: int = 0
    direct_min: int = DEFAULT_DIRECT_MIN_BYTES
    abort: str | None = None

    def encode(self) -> bytes:
        return _encode_fixed(
            {
                "magic": MAGIC,
                "protocol": PROTOCOL,
                "version": self.version,
                "digest": self.digest,
                "buckets": self.buckets,
                "checksums": self.checksums,
                "layout_nbytes": self.layout_nbytes,
                "direct_min": self.direct_min,
                "abort": None if self.abort is None else _truncate(self.abort, 2000),
            },
            HEADER_BYTES,
            "sync header",
        )

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        data = _decode_fixed(raw, HEADER_BYTES, "sync header")
        if data.get("magic") != MAGIC:
            raise MetadataError(f"sync header has magic {data.get('magic')!r:.40}, expected {MAGIC!r}")
        if data.get("protocol") != PROTOCOL:
            raise MetadataError(f"sync header speaks protocol {data.get('protocol')!r}, we speak {PROTOCOL}")
        digest = data.get("digest")
        if not isinstance(digest, str) or len(digest) > 128:
            raise MetadataError("sync header: field 'digest' must be a short string")
        checksums = data.get("checksums")
        if not isinstance(checksums, bool):
            raise MetadataError("sync header: field 'checksums' must be a bool")
        return cls(
            version=_int_field(data, "version", "sync header", minimum=-(2**62)),
            digest=digest,
            buckets=_int_field(data, "buckets", "sync header"),
            checksums=checksums,
            layout_nbytes=_int_field(data, "layout_nbytes", "sync header"),
            direct_min=_int_field(data, "direct_min", "sync header", minimum=1),
            abort=_reason_field(data, "sync header"),
        )


@dataclass(frozen=True)
class Control:
    """The word sent before each bucket: which bucket, how many bytes, its crc32, or an abort."""

    bucket: int
    nbytes: int
    crc: int | None = None
    abort: str | None = None

    def encode(self) -> bytes:
        return _encode_fixed(
            {
                "bucket": self.bucket,
                "nbytes": self.nbytes,
                "crc": self.crc,
                "abort": None if self.abort is None else _truncate(self.abort),
            },
            CONTROL_BYTES,
            "bucket control word",
        )

    @classmethod
    def decode(cls, raw: bytes) -> Control:
        data = _decode_fixed(raw, CONTROL_BYTES, "bucket control word")
        crc = data.get("crc")
        if crc is not None and (not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 2**32):
            raise MetadataError(f"bucket control word: invalid crc {crc!r:.40}")
        return cls(
            bucket=_int_field(data, "bucket", "bucket control word"),
            nbytes=_int_field(data, "nbytes", "bucket control word"),
            crc=crc,
            abort=_reason_field(data, "bucket control word"),
        )


@dataclass(frozen=True)
class Segment:
    """A byte range of a bucket that travels as one broadcast."""

    start: int
    end: int
    #: Name of the single large tensor this segment carries (sent from its own storage), or None.
    tensor: str | None

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def bucket_segments(layout: Layout, index: int, direct_min: int = DEFAULT_DIRECT_MIN_BYTES) -> list[Segment]:
    """How bucket `index` travels: runs of small tensors, and large tensors on their own.

    Derived from the layout and the threshold alone, so sender and receivers agree without
    exchanging anything. Alignment padding between segments is never sent.
    """
    segments: list[Segment] = []
    run_start: int | None = None
    run_end = 0
    for spec in layout.buckets[index].tensors:
        if spec.nbytes == 0:
            continue
        if spec.nbytes >= direct_min:
            if run_start is not None:
                segments.append(Segment(run_start, run_end, None))
                run_start = None
            segments.append(Segment(spec.offset, spec.offset + spec.nbytes, spec.name))
        else:
            if run_start is None:
                run_start = spec.offset
            run_end = spec.offset + spec.nbytes
    if run_start is not None:
        segments.append(Segment(run_start, run_end, None))
    return segments


def wire_nbytes(segments: list[Segment]) -> int:
    return sum(s.nbytes for s in segments)


def _crc_regions(regions: list[torch.Tensor]) -> int:
    crc = 0
    for region in regions:
        crc = zlib.crc32(_host_view(region), crc)
    return crc & 0xFFFFFFFF


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
    ):
        return None
    return target.detach().reshape(-1).view(torch.uint8)


def _host_view(region: torch.Tensor) -> memoryview:
    flat = region.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8).numpy().data.cast("B")


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


class Pending(Protocol):
    """An operation in flight on a wire."""

    def wait(self, deadline: Deadline, what: str) -> None:
        """Block until done; raise SyncTimeoutError / PeerLostError (mapped) on failure."""
        ...


class Wire(Protocol):
    """The collectives the protocol needs, over one group, bound to one device."""

    @property
    def device(self) -> torch.device: ...

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        ...

    @property
    def size(self) -> int: ...

    @property
    def src(self) -> int:
        """Group rank of the sender."""
        ...

    def broadcast(self, tensor: torch.Tensor) -> Pending: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> Pending: ...


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved, for logs and benchmarks."""

    version: int
    buckets: int
    wire_bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.wire_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _describe(codes: list[int], skip: int | None = None) -> str:
    parts = []
    for rank, code in enumerate(codes):
        if code != Status.OK and rank != skip:
            try:
                word = _STATUS_WORDS[Status(code)]
            except ValueError:
                word = f"reported unknown status {code}"
            parts.append(f"rank {rank} {word}")
    return ", ".join(parts) or "no rank reported a problem"


def _bytes_tensor(raw: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.cpu().numpy().tobytes())


class _Session:
    """State shared by sender and receiver: the wire, a broken flag, bucket buffers."""

    def __init__(self, wire: Wire, direct_min: int) -> None:
        self.wire = wire
        self.direct_min = direct_min
        self._broken: str | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]

    @property
    def broken(self) -> str | None:
        """Why the wire can no longer be used (a timeout or a lost peer left it mid-collective)."""
        return self._broken

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise SyncAbortedError(
                f"this transport broke in an earlier sync ({self._broken}); "
                "rebuild the process group / communicator before syncing again"
            )

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
        codes = torch.zeros(self.wire.size, dtype=torch.int64)
        codes[self.wire.rank] = int(code)
        codes = codes.to(self.wire.device)
        self.wire.all_reduce_sum(codes).wait(deadline, what)
        return [int(c) for c in codes.cpu().tolist()]

    def _fail(self, error: BaseException) -> None:
        """Record a transport-level failure: the group is mid-collective and unusable."""
        if self._broken is None:
            self._broken = f"{type(error).__name__}: {_truncate(str(error), 200)}"


class ProtocolSender(_Session):
    """Sending end of the broadcast protocol over any `Wire`."""

    def __init__(
        self,
        layout: Layout,
        wire: Wire,
        checksums: bool = False,
        direct_min: int = DEFAULT_DIRECT_MIN_BYTES,
    ) -> None:
        super().__init__(wire, direct_min)
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

    def send(
        self, state_dict: Mapping[str, torch.Tensor], version: int, deadline: Deadline | float | None = None
    ) -> SyncStats:
        """Broadcast `state_dict` as `version`; returns only once every receiver committed it."""
        self._check_usable()
        deadline = Deadline.coerce(deadline)
        start = time.perf_counter()
        try:
            return self._send(state_dict, version, deadline, start)
        except WeightSyncError as exc:
            if _is_transport_error(exc):
                self._fail(exc)
            raise

    def _send(
        self, state_dict: Mapping[str, torch.Tensor], version: int, deadline: Deadline, start: float
    ) -> SyncStats:
        wire, layout = self.wire, self.layout
        try:
            layout.check_state_dict(state_dict)
            problem: WeightSyncError | None = None
        except WeightSyncError as exc:
            problem = exc
        header = Header(
            version=version,
            digest=layout.digest,
            buckets=len(layout.buckets),
            checksums=self.checksums,
            layout_nbytes=len(self._layout_bytes()),
            direct_min=self.direct_min,
            abort=None if problem is None else f"sender's state dict does not fit its layout: {problem}",
        )
        wire.broadcast(_bytes_tensor(header.encode(), wire.device)).wait(deadline, "sync header broadcast")
        if problem is not None:
            raise problem

        codes = self._status_round(Status.OK, deadline, "sync negotiation")
        if any(codes):
            if Status.LAYOUT in codes:
                raw = _bytes_tensor(self._layout_bytes(), wire.device)
                wire.broadcast(raw).wait(deadline, "layout broadcast")
            message = f"version {version} not sent: {_describe(codes)}"
            if Status.LAYOUT in codes:
                raise LayoutMismatchError(message)
            if Status.VERSION in codes:
                raise VersionError(message)
            raise SyncAbortedError(message)

        total = self._send_buckets(state_dict, deadline)

        codes = self._status_round(Status.OK, deadline, "sync commit")
        if any(codes):
            raise SyncAbortedError(f"version {version} aborted, nothing applied: {_describe(codes)}")
        return SyncStats(version, len(layout.buckets), total, time.perf_counter() - start)

    def _send_buckets(self, state_dict: Mapping[str, torch.Tensor], deadline: Deadline) -> int:
        wire, layout = self.wire, self.layout
        in_flight: deque[tuple[Pending, str, int]] = deque()
        slot_ops: list[list[Pending]] = [[], []]
        total = 0
        block = flat_block(layout, state_dict)  # the model in one block: every run sent as it lies
        if block is not None and block.device != wire.device:
            block = None

        def drain(upto: int) -> None:
            """Wait for every op of buckets up to `upto` (older buckets finish first)."""
            while in_flight and in_flight[0][2] <= upto:
                op, what, _ = in_flight.popleft()
                op.wait(deadline, what)

        with torch.no_grad():
            for bucket in layout.buckets:
                k = bucket.index
                slot = k % 2
                segments = self._segments[k]
                drain(k - 1 - BUCKETS_IN_FLIGHT)  # bucket k-1 stays on the wire while k is packed
                try:
                    if block is not None:
                        base = self._starts[k]
                        sources, packed = [block[base + g.start : base + g.end] for g in segments], False
                    else:
                        sources, packed = self._prepare(state_dict, k, segments, slot, slot_ops, deadline)
                    crc = self._crc(sources, segments) if self.checksums else None
                except WeightSyncError as exc:
                    if _is_transport_error(exc):
                        raise
                    self._abort_at(k, exc, in_flight, deadline)
                    raise
                except Exception as exc:
                    self._abort_at(k, exc, in_flight, deadline)
                    raise SyncAbortedError(f"sender failed to pack bucket {k}: {exc}") from exc
                nbytes = wire_nbytes(segments)
                control = Control(k, nbytes, crc)
                in_flight.append(
                    (wire.broadcast(_bytes_tensor(control.encode(), wire.device)), f"control {k}", k)
                )
                ops: list[Pending] = []
                for src in sources:
                    op = wire.broadcast(src)
                    ops.append(op)
                    in_flight.append((op, f"bucket {k} broadcast", k))
                if packed:
                    slot_ops[slot] = ops
                total += nbytes
            drain(len(layout.buckets))
        return total

    def _prepare(
        self,
        state_dict: Mapping[str, torch.Tensor],
        k: int,
        segments: list[Segment],
        slot: int,
        slot_ops: list[list[Pending]],
        deadline: Deadline,
    ) -> tuple[list[torch.Tensor], bool]:
        """The tensors to broadcast for bucket `k`, packing small runs into bucket buffer `slot`."""
        layout = self.layout
        device = self.wire.device
        sources: list[torch.Tensor] = []
        buffer: torch.Tensor | None = None
        packed = False

        def buf() -> torch.Tensor:
            nonlocal buffer, packed
            if buffer is None:
                for op in slot_ops[slot]:  # the bucket that last used this buffer must be on the wire
                    op.wait(deadline, f"bucket buffer {slot} reuse")
                slot_ops[slot] = []
                buffer = self._buffer(slot, layout.buckets[k].nbytes)
                packed = True
            return buffer

        for seg, members in zip(segments, self._members[k], strict=True):
            if seg.tensor is not None:
                tensor = state_dict[seg.tensor].detach()
                if tensor.is_contiguous() and tensor.device == device:
                    sources.append(tensor.reshape(-1).view(torch.uint8))
                    continue
            target = buf()
            views = self._views(slot, k, target)
            dsts = [views[spec.name] for spec in members]
            srcs = [state_dict[spec.name].detach() for spec in members]
            _copy_all(dsts, srcs)
            sources.append(target[seg.start : seg.end])
        return sources, packed

    @staticmethod
    def _crc(sources: list[torch.Tensor], segments: list[Segment]) -> int:
        crc = 0
        for src in sources:
            crc = zlib.crc32(_host_view(src), crc)
        return crc & 0xFFFFFFFF

    def _abort_at(
        self, k: int, error: BaseException, in_flight: deque[tuple[Pending, str, int]], deadline: Deadline
    ) -> None:
        """Tell receivers bucket `k` will never come; they stop after this same collective."""
        control = Control(k, 0, None, f"sender failed at bucket {k}: {type(error).__name__}: {error}")
        op = self.wire.broadcast(_bytes_tensor(control.encode(), self.wire.device))
        while in_flight:
            pending, what, _ = in_flight.popleft()
            pending.wait(deadline, what)
        op.wait(deadline, "abort control word")


class ProtocolReceiver(_Session):
    """Receiving end of the broadcast protocol over any `Wire`."""

    def __init__(self, layout: Layout, wire: Wire) -> None:
        super().__init__(wire, DEFAULT_DIRECT_MIN_BYTES)
        if wire.rank == wire.src:
            raise ValueError(f"rank {wire.rank} is the sender of this group, not a receiver")
        self.layout = layout

    def receive(self, consumer: BucketConsumer, deadline: Deadline | float | None = None) -> SyncStats:
        """Receive one version into `consumer`; on any failure it is aborted and raises."""
        self._check_usable()
        deadline = Deadline.coerce(deadline)
        start = time.perf_counter()
        try:
            version, total, buckets = self._receive(consumer, deadline)
        except WeightSyncError as exc:
            if _is_transport_error(exc):
                self._fail(exc)
            raise
        except BaseException as exc:
            self._fail(exc)
            raise
        return SyncStats(version, buckets, total, time.perf_counter() - start)

    def _receive(self, consumer: BucketConsumer, deadline: Deadline) -> tuple[int, int, int]:
        wire = self.wire
        layout = consumer.layout
        raw = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=wire.device)
        wire.broadcast(raw).wait(deadline, "sync header broadcast")
        header = Header.decode(_tensor_bytes(raw))
        if header.abort is not None:
            raise SyncAbortedError(f"sender aborted version {header.version}: {header.abort}")

        # -- negotiation ----------------------------------------------------------------
        code = Status.OK
        own_error: WeightSyncError | None = None
        began = False
        if header.digest != layout.digest:
            code = Status.LAYOUT
        else:
            try:
                consumer.begin(header.version)
                began = True
            except VersionError as exc:
                code, own_error = Status.VERSION, exc
            except Exception as exc:
                code = Status.CONSUMER
                own_error = SyncAbortedError(f"consumer refused version {header.version}: {exc}")
        try:
            codes = self._status_round(code, deadline, "sync negotiation")
            if any(codes):
                if Status.LAYOUT in codes:
                    theirs = self._receive_layout(header, deadline)
                    if code == Status.LAYOUT:
                        problem = layout.diff(theirs) or "digests differ"
                        name = problem.split("'")[1] if "'" in problem else None
                        raise LayoutMismatchError(
                            f"version {header.version} not applied: "
                            f"layout mismatch with the sender: {problem}",
                            name,
                        )
                if own_error is not None:
                    raise own_error
                raise SyncAbortedError(
                    f"version {header.version} not applied: {_describe(codes, skip=wire.rank)}"
                )
            total, failure = self._receive_buckets(consumer, header, deadline)
            codes = self._status_round(
                Status.OK if failure is None else _status_of(failure), deadline, "sync commit"
            )
        except BaseException as exc:
            if began:
                _safe_abort(consumer, exc)
            raise
        if failure is not None:
            _safe_abort(consumer, failure)
            raise failure
        if any(codes):
            error = SyncAbortedError(
                f"version {header.version} aborted, nothing applied: {_describe(codes, skip=wire.rank)}"
            )
            _safe_abort(consumer, error)
            raise error
        consumer.commit(header.version)
        return header.version, total, header.buckets

    def _receive_layout(self, header: Header, deadline: Deadline) -> Layout:
        from rlfleet.weightsync._layout import MAX_METADATA_BYTES

        if header.layout_nbytes > MAX_METADATA_BYTES:
            raise MetadataError(
                f"sender's layout is {header.layout_nbytes} bytes, over the {MAX_METADATA_BYTES} limit"
            )
        raw = torch.zeros(header.layout_nbytes, dtype=torch.uint8, device=self.wire.device)
        self.wire.broadcast(raw).wait(deadline, "layout broadcast")
        return Layout.from_json(_tensor_bytes(raw))

    def _receive_buckets(
        self, consumer: BucketConsumer, header: Header, deadline: Deadline
    ) -> tuple[int, WeightSyncError | None]:
        wire = self.wire
        layout = consumer.layout
        if header.buckets != len(layout.buckets):
            raise MetadataError(
                f"header announces {header.buckets} buckets, layout has {len(layout.buckets)}"
            )
        plans = [bucket_segments(layout, b.index, header.direct_min) for b in layout.buckets]
        targets = consumer if isinstance(consumer, BucketTarget) else None
        landing = consumer if isinstance(consumer, TensorTarget) else None
        failure: WeightSyncError | None = None
        total = 0
        n = len(layout.buckets)

        def post_control() -> tuple[torch.Tensor, Pending]:
            t = torch.zeros(CONTROL_BYTES, dtype=torch.uint8, device=wire.device)
            return t, wire.broadcast(t)

        def read_control(k: int, pending: tuple[torch.Tensor, Pending]) -> Control:
            t, op = pending
            op.wait(deadline, f"control word {k}")
            control = Control.decode(_tensor_bytes(t))
            if control.abort is not None:
                raise SyncAbortedError(f"sender aborted version {header.version}: {control.abort}")
            expected = wire_nbytes(plans[k])
            if control.bucket != k or control.nbytes != expected:
                raise MetadataError(
                    f"control word says bucket {control.bucket} with {control.nbytes} bytes, "
                    f"expected bucket {k} with {expected}"
                )
            return control

        def post_data(k: int) -> tuple[torch.Tensor, list[Pending], list[torch.Tensor]]:
            nbytes = layout.buckets[k].nbytes
            dest: torch.Tensor | None = None
            if targets is not None and failure is None:
                dest = targets.bucket_target(k)
                if dest is not None and (
                    dest.dtype != torch.uint8
                    or dest.dim() != 1
                    or dest.numel() < nbytes
                    or dest.device != wire.device
                ):
                    dest = None
            own = dest is None
            if dest is None:
                dest = self._buffer(k % 2, layout.max_bucket_nbytes)
            regions: list[torch.Tensor] = []
            for seg in plans[k]:
                region = None
                if own and seg.tensor is not None and landing is not None and failure is None:
                    region = _tensor_region(
                        landing.tensor_target(seg.tensor), layout[seg.tensor], wire.device
                    )
                regions.append(dest[seg.start : seg.end] if region is None else region)
            return dest, [wire.broadcast(r) for r in regions], regions

        if n == 0:
            return 0, None
        control = read_control(0, post_control())
        current = post_data(0)
        for k in range(n):
            next_control = post_control() if k + 1 < n else None
            dest, ops, regions = current
            for op in ops:
                op.wait(deadline, f"bucket {k} broadcast")
            total += wire_nbytes(plans[k])
            following: Control | None = None
            if next_control is not None:
                following = read_control(k + 1, next_control)
                current = post_data(k + 1)  # lands while bucket k is consumed
            if failure is None:
                try:
                    if header.checksums:
                        got = _crc_regions(regions)
                        if control.crc is None or got != control.crc:
                            raise ChecksumMismatchError(
                                f"bucket {k} of version {header.version}: crc32 {got:#010x}, "
                                f"sender computed {control.crc!r}",
                                k,
                            )
                    consumer.consume(k, dest[: layout.buckets[k].nbytes])
                except ChecksumMismatchError as exc:
                    failure = exc
                except WeightSyncError as exc:
                    failure = exc
                except Exception as exc:
                    failure = SyncAbortedError(f"consumer failed on bucket {k}: {type(exc).__name__}: {exc}")
                    failure.__cause__ = exc
            if following is not None:
                control = following
        return total, failure


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dst.copy_(src) for every pair; one fused call when torch has it (2,000 small tensors)."""
    if not dsts:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None and all(s.device == dsts[0].device for s in srcs):
        try:
            foreach(dsts, srcs)
            return
        except (RuntimeError, TypeError):
            pass
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src)


def _status_of(error: WeightSyncError) -> Status:
    if isinstance(error, ChecksumMismatchError):
        return Status.CHECKSUM
    if isinstance(error, LayoutMismatchError):
        return Status.LAYOUT
    return Status.CONSUMER


def _is_transport_error(error: WeightSyncError) -> bool:
    """Errors after which the group is mid-collective (the wire cannot be reused)."""
    from rlfleet.weightsync._errors import PeerLostError, SyncTimeoutError

    return isinstance(error, (PeerLostError, SyncTimeoutError, MetadataError))


def _safe_abort(consumer: BucketConsumer, error: BaseException) -> None:
    try:
        consumer.abort(error)
    except Exception:  # the consumer's own cleanup must not hide the sync's error
        import logging

        logging.getLogger(__name__).exception("consumer.abort failed")
