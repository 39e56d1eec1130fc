"""What the broadcast protocol puts on the wire besides bucket bytes, and how a bucket travels.

`Header` opens a sync (version, layout digest, bucket count, the sender's share of the
buckets, checksum flag, or an abort reason); `Control` precedes each bucket (which bucket, how
many bytes, its crc32, or an abort reason). Both are fixed-size JSON frames (`_core`).
`bucket_segments` cuts a bucket into the runs that travel as one broadcast each, from the
layout and the direct-send threshold alone, so sender and receivers agree without talking.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.weightsync._errors import MetadataError
from rlfleet.weightsync.codec._delta import DELTA_KINDS
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._core import (
    MAX_VERSION,
    decode_frame,
    encode_frame,
    int_field,
    reason_field,
    truncate,
)

MAGIC = "rlfleet-weightsync"
PROTOCOL = 2
HEADER_BYTES = 4096
CONTROL_BYTES = 512
#: Tensors at least this large travel as their own segment, straight from their storage.
DEFAULT_DIRECT_MIN_BYTES = 4 * 1024 * 1024


def share_ranges(indices: Iterable[int]) -> list[list[int]]:
    """Sorted bucket indices as ``[start, stop)`` runs (a contiguous share is one run)."""
    runs: list[list[int]] = []
    for index in sorted(set(indices)):
        if runs and runs[-1][1] == index:
            runs[-1][1] = index + 1
        else:
            runs.append([index, index + 1])
    return runs


def check_share(buckets: Sequence[int] | None, count: int, what: str = "buckets") -> tuple[int, ...] | None:
    """Sorted, distinct bucket indices of a layout of `count` buckets (None: every bucket)."""
    if buckets is None:
        return None
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        raise ValueError(f"{what} must be a sequence of bucket indices, got {type(buckets).__name__}")
    out = []
    for index in buckets:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"{what}: {index!r} is not a bucket of this layout (it has {count})")
        out.append(index)
    if len(set(out)) != len(out):
        raise ValueError(f"{what} lists a bucket twice: {sorted(out)}")
    return tuple(sorted(out))


def _decode_share(value: Any, count: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > count:
        raise MetadataError("sync header: field 'share' must be a list of [start, stop) runs or null")
    indices: list[int] = []
    for run in value:
        if (
            not isinstance(run, list)
            or len(run) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in run)
            or not (indices[-1] if indices else -1) < run[0] < run[1] <= count
        ):
            raise MetadataError(
                f"sync header: share run {run!r:.60} is not an ordered run inside {count} buckets"
            )
        indices.extend(range(run[0], run[1]))
    return tuple(indices)


@dataclass(frozen=True)
class Header:
    """First message of a sync: what is coming, or why nothing is."""

    version: int
    #: The sender's layout digest: a receiver whose layout differs refuses the sync at once.
    digest: str
    buckets: int
    checksums: bool = False
    layout_nbytes: int = 0
    direct_min: int = DEFAULT_DIRECT_MIN_BYTES
    abort: str | None = None
    #: The bucket indices this sender sends (None: all of them).
    share: tuple[int, ...] | None = None
    #: The version the sender offers a delta against (None: full); each receiver says in the
    #: negotiation whether it holds it, and the version is a delta only if every one does.
    base: int | None = None

    def encode(self) -> bytes:
        return encode_frame(
            {
                "magic": MAGIC,
                "protocol": PROTOCOL,
                "version": self.version,
                "digest": self.digest,
                "buckets": self.buckets,
                "share": None if self.share is None else share_ranges(self.share),
                "checksums": self.checksums,
                "layout_nbytes": self.layout_nbytes,
                "direct_min": self.direct_min,
                "abort": None if self.abort is None else truncate(self.abort, 2000),
                "base": self.base,
            },
            HEADER_BYTES,
            "sync header",
        )

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        data = decode_frame(raw, HEADER_BYTES, "sync header")
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
        buckets = int_field(data, "buckets", "sync header")
        return cls(
            version=int_field(data, "version", "sync header", maximum=MAX_VERSION),
            digest=digest,
            buckets=buckets,
            checksums=checksums,
            layout_nbytes=int_field(data, "layout_nbytes", "sync header"),
            direct_min=int_field(data, "direct_min", "sync header", minimum=1),
            abort=reason_field(data, "sync header"),
            share=_decode_share(data.get("share"), buckets),
            base=None if data.get("base") is None else int_field(data, "base", "sync header"),
        )


@dataclass(frozen=True)
class Control:
    """The word sent before each bucket: which bucket, how many bytes, its crc32, or an abort.

    In a delta version, `kind` says how the bucket travels (``full``: its segments as ever;
    ``sparse`` / ``bitmap``: one encoded payload of `nbytes`) and `digest` is the sender's
    digest of the bucket's new bytes, which the receiver's rebuild must match.
    """

    bucket: int
    nbytes: int
    crc: int | None = None
    abort: str | None = None
    kind: str = "full"
    digest: int | None = None

    def encode(self) -> bytes:
        payload: Mapping[str, Any] = {
            "bucket": self.bucket,
            "nbytes": self.nbytes,
            "crc": self.crc,
            "abort": None if self.abort is None else truncate(self.abort),
            "kind": self.kind,
            "digest": self.digest,
        }
        return encode_frame(payload, CONTROL_BYTES, "bucket control word")

    @classmethod
    def decode(cls, raw: bytes) -> Control:
        data = decode_frame(raw, CONTROL_BYTES, "bucket control word")
        crc = data.get("crc")
        if crc is not None and (not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 2**32):
            raise MetadataError(f"bucket control word: invalid crc {crc!r:.40}")
        kind = data.get("kind", "full")
        if kind not in DELTA_KINDS:
            raise MetadataError(f"bucket control word: unknown kind {kind!r:.40}")
        digest = data.get("digest")
        if digest is not None and (
            not isinstance(digest, int) or isinstance(digest, bool) or not 0 <= digest < 2**64
        ):
            raise MetadataError(f"bucket control word: invalid digest {digest!r:.40}")
        return cls(
            bucket=int_field(data, "bucket", "bucket control word"),
            nbytes=int_field(data, "nbytes", "bucket control word"),
            crc=crc,
            abort=reason_field(data, "bucket control word"),
            kind=kind,
            digest=digest,
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
    exchanging anything. A run of small tensors travels as one range, with the few bytes that
    align each tensor inside it (small tensors are packed densely); the padding before a large
    tensor and at the end of a bucket is never sent.
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


def wire_nbytes(segments: Sequence[Segment]) -> int:
    return sum(s.nbytes for s in segments)
