"""The program one rank executes in a reshard, and the messages it cuts into.

A reshard plan (``rlfleet.placement.plan_reshard``) hands each process its `RankProgram`
(``rank_program(side, rank)``, plain JSON): its local tensors and the slices it sends or
receives. The program is checked on arrival: every slice must lie inside its tensor and carry
the bytes its shape says, and a generation rank's slices must cover each of its tensors, so a
receiver never commits bytes that nothing would send.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlfleet.weightsync._errors import LayoutMismatchError, MetadataError
from rlfleet.weightsync.layout._dtypes import dtype_from_name
from rlfleet.weightsync.layout._json import decode_json
from rlfleet.weightsync.layout._layout import DEFAULT_BUCKET_BYTES, MAX_METADATA_BYTES, Layout

__all__ = ["GEN", "TRAIN", "Peer", "RankProgram", "ReshardMessage", "Transfer"]

RESHARD_FORMAT = 1
MAX_TRANSFERS = 10_000_000
TRAIN = "train"
GEN = "gen"
Peer = tuple[str, int]
Shape = tuple[int, ...]


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MetadataError(f"{what} must be an int >= {minimum}, got {value!r:.80}")
    return value


@dataclass(frozen=True)
class Transfer:
    """One slice from training rank `src` to generation rank `dst` (see the plan's ``Move``)."""

    src: int
    dst: int
    src_param: str
    dst_param: str
    dim: int | None
    src_offset: int
    dst_offset: int
    length: int
    nbytes: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return dtype_from_name(self.dtype).itemsize

    @property
    def key(self) -> tuple[Any, ...]:
        """Canonical order within a pair (identical on both ends)."""
        return (self.dst_param, self.dst_offset, self.src_param, self.src_offset, self.length)

    def as_list(self) -> list[Any]:
        return [
            self.src,
            self.dst,
            self.src_param,
            self.dst_param,
            self.dim,
            self.src_offset,
            self.dst_offset,
            self.length,
            self.nbytes,
            self.dtype,
        ]


@dataclass(frozen=True)
class ReshardMessage:
    """One point-to-point message: `items` are (transfer, byte offset in the message)."""

    src: int
    dst: int
    index: int
    nbytes: int
    items: tuple[tuple[Transfer, int], ...]

    @property
    def tag(self) -> int:
        return 1 + self.index

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.index, self.src, self.dst)


def _slice_shape(shape: Shape, dim: int | None, length: int) -> Shape:
    if dim is None:
        return shape
    out = list(shape)
    out[dim] = length
    return tuple(out)


def _parse_transfer(
    entry: Any, i: int, role: str, rank: int, worlds: tuple[int, int], shapes: Mapping[str, tuple[Shape, str]]
) -> Transfer:
    """Transfer `i` of a program, checked against the worlds and this rank's tensors."""
    what = f"transfer {i}"
    if not isinstance(entry, (list, tuple)) or len(entry) != 10:
        raise MetadataError(f"{what} must be a 10-item list, got {entry!r:.200}")
    src, dst, src_param, dst_param, dim, src_offset, dst_offset, length, nbytes, dtype = entry
    src, dst = _int(src, f"{what} src"), _int(dst, f"{what} dst")
    if src >= worlds[0] or dst >= worlds[1]:
        raise MetadataError(f"{what}: train rank {src} -> gen rank {dst} outside the worlds")
    if (role == TRAIN and src != rank) or (role == GEN and dst != rank):
        raise MetadataError(f"{what} ({src} -> {dst}) does not involve {role} rank {rank}")
    if not isinstance(src_param, str) or not isinstance(dst_param, str) or not isinstance(dtype, str):
        raise MetadataError(f"{what}: parameter names and dtype must be strings")
    transfer = Transfer(
        src,
        dst,
        src_param,
        dst_param,
        None if dim is None else _int(dim, f"{what} dim"),
        _int(src_offset, f"{what} src_offset"),
        _int(dst_offset, f"{what} dst_offset"),
        _int(length, f"{what} length", 1),
        _int(nbytes, f"{what} nbytes", 1),
        dtype,
    )
    local = src_param if role == TRAIN else dst_param
    offset = transfer.src_offset if role == TRAIN else transfer.dst_offset
    if local not in shapes:
        raise LayoutMismatchError(f"{what}: {role} rank {rank} holds no tensor {local!r}", local)
    shape, local_dtype = shapes[local]
    if local_dtype != dtype:
        raise LayoutMismatchError(f"{what}: {local!r} is {local_dtype}, the transfer says {dtype}", local)
    dim = transfer.dim
    if dim is not None and (dim >= len(shape) or offset + transfer.length > shape[dim]):
        raise MetadataError(
            f"{what}: [{offset}:{offset + transfer.length}] along dim {dim} is outside {local!r} {shape}"
        )
    expected = math.prod(_slice_shape(shape, dim, transfer.length)) * dtype_from_name(dtype).itemsize
    if expected != transfer.nbytes:
        raise MetadataError(
            f"{what}: slice of {local!r} is {expected} bytes, the plan says {transfer.nbytes}"
        )
    return transfer


def _first_gap(intervals: list[tuple[int, int]], size: int) -> tuple[int, int] | None:
    """The first ``[start, stop)`` of ``[0, size)`` that no interval covers, or None."""
    cursor = 0
    for start, stop in sorted(intervals):
        if start > cursor:
            return cursor, start
        cursor = max(cursor, stop)
    return None if cursor >= size else (cursor, size)


def _check_coverage(rank: int, shapes: Mapping[str, tuple[Shape, str]], transfers: list[Transfer]) -> None:
    """Every element of every tensor of generation rank `rank` is written by some transfer.

    A transfer narrows at most one dimension and keeps the others whole, so a tensor is covered
    exactly when some dimension's slices cover its whole extent (or one transfer takes it all):
    otherwise an element uncovered in every dimension exists.
    """
    slices: dict[str, dict[int | None, list[tuple[int, int]]]] = {}
    for t in transfers:
        slices.setdefault(t.dst_param, {}).setdefault(t.dim, []).append(
            (t.dst_offset, t.dst_offset + t.length)
        )
    for name, (shape, _) in shapes.items():
        if math.prod(shape) == 0:
            continue
        mine = slices.get(name, {})
        if None in mine:
            continue
        gaps = {dim: _first_gap(spans, shape[dim]) for dim, spans in mine.items() if dim is not None}
        if any(gap is None for gap in gaps.values()):
            continue
        if not gaps:
            raise MetadataError(f"reshard program of gen rank {rank}: no transfer writes {name!r} {shape}")
        dim, gap = next(iter(sorted(gaps.items(), key=lambda item: item[0] or 0)))
        assert gap is not None
        raise MetadataError(
            f"reshard program of gen rank {rank}: [{gap[0]}:{gap[1]}] of {name!r} {shape} along dim {dim} "
            "is covered by no transfer (nothing would fill it; the program is refused)"
        )


@dataclass(frozen=True)
class RankProgram:
    """What one training or generation rank does in a reshard, read from JSON and validated."""

    role: str
    rank: int
    digest: str
    train_world_size: int
    gen_world_size: int
    tensors: tuple[tuple[str, Shape, str], ...]
    transfers: tuple[Transfer, ...]

    @classmethod
    def coerce(cls, value: RankProgram | Mapping[str, Any] | str | bytes) -> RankProgram:
        if isinstance(value, RankProgram):
            return value
        if isinstance(value, (str, bytes)):
            value = decode_json(value, "rank program", MAX_METADATA_BYTES)
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, data: Any) -> RankProgram:
        """Validate a program produced by ``ReshardPlan.rank_program``; MetadataError if malformed.

        A generation rank's program must cover every element of its tensors.
        """
        if not isinstance(data, Mapping) or data.get("format") != RESHARD_FORMAT:
            raise MetadataError(f"not a reshard rank program of format {RESHARD_FORMAT}")
        role = data.get("role")
        if role not in (TRAIN, GEN):
            raise MetadataError(f"rank program role must be {TRAIN!r} or {GEN!r}, got {role!r:.40}")
        rank = _int(data.get("rank"), "rank program 'rank'")
        worlds = (
            _int(data.get("train_world_size"), "rank program 'train_world_size'", 1),
            _int(data.get("gen_world_size"), "rank program 'gen_world_size'", 1),
        )
        if rank >= (worlds[0] if role == TRAIN else worlds[1]):
            raise MetadataError(f"{role} rank {rank} outside its world")
        digest = data.get("digest")
        if not isinstance(digest, str) or not digest or len(digest) > 128:
            raise MetadataError("rank program 'digest' must be a short string")
        raw_tensors, raw_transfers = data.get("tensors"), data.get("transfers")
        if not isinstance(raw_tensors, list) or not isinstance(raw_transfers, list):
            raise MetadataError("rank program needs 'tensors' and 'transfers' lists")
        if len(raw_transfers) > MAX_TRANSFERS:
            raise MetadataError(f"rank program has {len(raw_transfers)} transfers, over {MAX_TRANSFERS}")
        layout = Layout(raw_tensors)  # validates names, shapes, dtypes (MetadataError)
        tensors = tuple((s.name, s.shape, s.dtype) for s in layout.tensors)
        shapes = {name: (shape, dtype) for name, shape, dtype in tensors}
        transfers = [
            _parse_transfer(entry, i, role, rank, worlds, shapes) for i, entry in enumerate(raw_transfers)
        ]
        if role == GEN:
            _check_coverage(rank, shapes, transfers)
        return cls(role, rank, digest, worlds[0], worlds[1], tensors, tuple(transfers))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RESHARD_FORMAT,
            "digest": self.digest,
            "role": self.role,
            "rank": self.rank,
            "train_world_size": self.train_world_size,
            "gen_world_size": self.gen_world_size,
            "tensors": [[n, list(s), d] for n, s, d in self.tensors],
            "transfers": [t.as_list() for t in self.transfers],
        }

    @property
    def me(self) -> Peer:
        return (self.role, self.rank)

    def layout(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Layout:
        """The layout of this rank's local tensors (what a generation rank's consumer holds)."""
        return Layout(self.tensors, bucket_bytes)

    def peers(self) -> tuple[Peer, ...]:
        """The ranks of the other side this rank exchanges data with."""
        other = GEN if self.role == TRAIN else TRAIN
        return tuple(sorted({(other, t.dst if self.role == TRAIN else t.src) for t in self.transfers}))

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends (training) or receives (generation)."""
        return sum(t.nbytes for t in self.transfers)

    def messages(self, bucket_bytes: int, direct_min: int) -> list[ReshardMessage]:
        """This rank's messages in the global posting order; both ends of a pair derive the same."""
        pairs: dict[tuple[int, int], list[Transfer]] = {}
        for t in self.transfers:
            pairs.setdefault((t.src, t.dst), []).append(t)
        out: list[ReshardMessage] = []
        for (src, dst), transfers in pairs.items():
            out.extend(_pair_messages(src, dst, transfers, bucket_bytes, direct_min))
        return sorted(out, key=lambda m: m.order)


def _pair_messages(
    src: int, dst: int, transfers: list[Transfer], bucket_bytes: int, direct_min: int
) -> list[ReshardMessage]:
    """One pair's messages: small slices packed into buckets (ordered by element size, so each
    sits aligned with no padding), large ones alone."""
    out: list[ReshardMessage] = []
    bucket: list[Transfer] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        items, offset = [], 0
        for t in sorted(bucket, key=lambda t: -t.itemsize):  # stable: aligned, no padding
            items.append((t, offset))
            offset += t.nbytes
        out.append(ReshardMessage(src, dst, len(out), offset, tuple(items)))
        bucket, size = [], 0

    for t in sorted(transfers, key=lambda t: t.key):
        if t.nbytes >= direct_min or t.nbytes > bucket_bytes:
            flush()
            out.append(ReshardMessage(src, dst, len(out), t.nbytes, ((t, 0),)))
            continue
        if size + t.nbytes > bucket_bytes:
            flush()
        bucket.append(t)
        size += t.nbytes
    flush()
    return out
