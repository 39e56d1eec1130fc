"""Reshard execution: each generation rank receives exactly its own shard, point to point.

A reshard plan (``rlfleet.placement.plan_reshard``) says which training rank sends which slice
to which generation ranks; each process executes its `RankProgram` (the plan's
``rank_program(side, rank)``, plain JSON). The session has the broadcast path's guarantees:
versioned, atomic, deadline-bounded; a version lands on every generation rank or on none.

One sync of version ``v``, over one or more process groups (one per training pipeline stage,
as NeMo RL's ``nccl_reshard`` forms them, or one for everybody):

1. header: the lowest training rank of each group sends a fixed-size JSON frame (version,
   plan digest, extras such as kv-cache scales, or an abort reason) to every generation rank
   of the group; a generation rank checks that all headers agree and calls ``consumer.begin``;
2. negotiation: a sum all-reduce per group of (status, version, plan digest) per member; a
   group where anything disagrees moves no data;
3. data: point-to-point messages, bucketed per (sender, receiver) pair: slices smaller than
   ``direct_min`` are packed into buckets of at most ``bucket_bytes`` (ordered by element size,
   so every slice sits aligned with no padding); larger ones travel alone, straight from the
   sender's storage and into the receiver's staging when the slice is contiguous. Every rank
   posts its messages in one global order (message index within its pair, sender, receiver)
   with at most ``max_in_flight`` outstanding, which cannot deadlock: the globally oldest
   message is always posted on both ends. Receivers land everything in staging (the
   consumer's own storage when it offers `BucketTarget`, else a staging buffer), never in the
   live weights; a sender that fails to read a slice keeps sending zeros so every pair stays in
   step, and reports the failure in the commit;
4. commit: a status all-reduce per group, then a decision all-reduce per group in which every
   generation rank (each sees every group) votes; all generation ranks reach the same decision
   and commit, or all abort.

Every wait takes the sync's deadline. A timeout is a `SyncTimeoutError`, a peer that vanished a
`PeerLostError`; either leaves the group mid-protocol (`broken`), the consumer is aborted and
the applied version stays intact. Clean failures (a stale version, a layout mismatch, a sender
that could not read a tensor, a consumer error) leave the group usable.

Transports are `P2PWire` objects: `TorchP2PWire` over a torch.distributed process group (gloo
on CPU, nccl on GPU) and `NcclP2PWire` over a cupy NCCL communicator (cupy imported lazily).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from rlfleet.weightsync._cupy import import_nccl
from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._dist import _GroupMember, _TorchPending, map_dist_error
from rlfleet.weightsync._dtypes import dtype_from_name
from rlfleet.weightsync._errors import (
    LayoutMismatchError,
    MetadataError,
    PeerLostError,
    SyncAbortedError,
    SyncTimeoutError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync._json import decode_json
from rlfleet.weightsync._layout import DEFAULT_BUCKET_BYTES, MAX_METADATA_BYTES, Layout
from rlfleet.weightsync._nccl import NcclWire, _NcclPending
from rlfleet.weightsync._packing import bucket_starts, typed_view
from rlfleet.weightsync._protocol import BucketConsumer
from rlfleet.weightsync._wire import BucketTarget

__all__ = [
    "DEFAULT_RESHARD_BUCKET_BYTES",
    "DEFAULT_RESHARD_DIRECT_MIN",
    "GEN",
    "TRAIN",
    "NcclP2PWire",
    "P2PWire",
    "PeerGroup",
    "RankProgram",
    "ReshardMessage",
    "ReshardReceiver",
    "ReshardSender",
    "ReshardStats",
    "TorchP2PWire",
    "Transfer",
]

RESHARD_FORMAT = 1
MAGIC = "rlfleet-reshard"
HEADER_BYTES = 4096
HEADER_TAG = 0
DEFAULT_RESHARD_BUCKET_BYTES = 16 * 1024 * 1024
DEFAULT_RESHARD_DIRECT_MIN = 1024 * 1024
DEFAULT_MAX_IN_FLIGHT = 8
MAX_TRANSFERS = 10_000_000
TRAIN = "train"
GEN = "gen"
Peer = tuple[str, int]


class _Code(IntEnum):
    OK = 0
    LAYOUT = 1
    VERSION = 2
    PLAN = 3
    CONSUMER = 4
    ABORTED = 5
    SENDER = 6


_WORDS = {
    _Code.LAYOUT: "has tensors that do not match the plan",
    _Code.VERSION: "rejected the version",
    _Code.PLAN: "executes a different plan",
    _Code.CONSUMER: "failed to stage the version",
    _Code.ABORTED: "aborted",
    _Code.SENDER: "failed to read its weights",
}


def _word(code: int) -> str:
    try:
        return _WORDS.get(_Code(code), "failed")
    except ValueError:
        return f"reported unknown status {code}"


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MetadataError(f"{what} must be an int >= {minimum}, got {value!r:.80}")
    return value


def _digest_word(digest: str) -> int:
    return int.from_bytes(hashlib.sha256(digest.encode()).digest()[:7], "little")


# -- the program one rank executes ------------------------------------------------------------
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


def _slice_shape(shape: tuple[int, ...], dim: int | None, length: int) -> tuple[int, ...]:
    if dim is None:
        return shape
    out = list(shape)
    out[dim] = length
    return tuple(out)


@dataclass(frozen=True)
class RankProgram:
    """What one training or generation rank does in a reshard, read from JSON and validated."""

    role: str
    rank: int
    digest: str
    train_world_size: int
    gen_world_size: int
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    transfers: tuple[Transfer, ...]
    _shapes: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._shapes.update({name: (shape, dtype) for name, shape, dtype in self.tensors})

    @classmethod
    def coerce(cls, value: RankProgram | Mapping[str, Any] | str | bytes) -> RankProgram:
        if isinstance(value, RankProgram):
            return value
        if isinstance(value, (str, bytes)):
            value = decode_json(value, "rank program", MAX_METADATA_BYTES)
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, data: Any) -> RankProgram:
        """Validate a program produced by ``ReshardPlan.rank_program``; MetadataError if malformed."""
        if not isinstance(data, Mapping) or data.get("format") != RESHARD_FORMAT:
            raise MetadataError(f"not a reshard rank program of format {RESHARD_FORMAT}")
        role = data.get("role")
        if role not in (TRAIN, GEN):
            raise MetadataError(f"rank program role must be {TRAIN!r} or {GEN!r}, got {role!r:.40}")
        rank = _int(data.get("rank"), "rank program 'rank'")
        train_world = _int(data.get("train_world_size"), "rank program 'train_world_size'", 1)
        gen_world = _int(data.get("gen_world_size"), "rank program 'gen_world_size'", 1)
        if rank >= (train_world if role == TRAIN else gen_world):
            raise MetadataError(f"{role} rank {rank} outside its world")
        digest = data.get("digest")
        if not isinstance(digest, str) or not digest or len(digest) > 128:
            raise MetadataError("rank program 'digest' must be a short string")
        raw_tensors = data.get("tensors")
        raw_transfers = data.get("transfers")
        if not isinstance(raw_tensors, list) or not isinstance(raw_transfers, list):
            raise MetadataError("rank program needs 'tensors' and 'transfers' lists")
        if len(raw_transfers) > MAX_TRANSFERS:
            raise MetadataError(f"rank program has {len(raw_transfers)} transfers, over {MAX_TRANSFERS}")
        layout = Layout(raw_tensors)  # validates names, shapes, dtypes (MetadataError)
        tensors = tuple((s.name, s.shape, s.dtype) for s in layout.tensors)
        shapes = {name: (shape, dtype) for name, shape, dtype in tensors}
        transfers = []
        for i, entry in enumerate(raw_transfers):
            if not isinstance(entry, (list, tuple)) or len(entry) != 10:
                raise MetadataError(f"transfer {i} must be a 10-item list, got {entry!r:.200}")
            src, dst, src_param, dst_param, dim, src_offset, dst_offset, length, nbytes, dtype = entry
            what = f"transfer {i}"
            src = _int(src, f"{what} src")
            dst = _int(dst, f"{what} dst")
            if src >= train_world or dst >= gen_world:
                raise MetadataError(f"{what}: train rank {src} -> gen rank {dst} outside the worlds")
            if (role == TRAIN and src != rank) or (role == GEN and dst != rank):
                raise MetadataError(f"{what} ({src} -> {dst}) does not involve {role} rank {rank}")
            if not isinstance(src_param, str) or not isinstance(dst_param, str) or not isinstance(dtype, str):
                raise MetadataError(f"{what}: parameter names and dtype must be strings")
            if dim is not None:
                dim = _int(dim, f"{what} dim")
            transfer = Transfer(
                src,
                dst,
                src_param,
                dst_param,
                dim,
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
                raise LayoutMismatchError(
                    f"{what}: {local!r} is {local_dtype}, the transfer says {dtype}", local
                )
            if dim is not None and (dim >= len(shape) or offset + transfer.length > shape[dim]):
                raise MetadataError(
                    f"{what}: [{offset}:{offset + transfer.length}] along dim {dim} "
                    f"is outside {local!r} {shape}"
                )
            expected = math.prod(_slice_shape(shape, dim, transfer.length)) * dtype_from_name(dtype).itemsize
            if expected != transfer.nbytes:
                raise MetadataError(
                    f"{what}: slice of {local!r} is {expected} bytes, the plan says {transfer.nbytes}"
                )
            transfers.append(transfer)
        return cls(role, rank, digest, train_world, gen_world, tensors, tuple(transfers))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RESHARD_FORMAT,
            "digest": self.digest,
            "role": self.role,
            "rank": self.rank,
            "train_world_size": self.train_world_size,
            "gen_world_size": self.gen_world_size,
            "tensors": [[n, list(s), d] for n, s, d in self.tensors],
            "transfers": [
                [
                    t.src,
                    t.dst,
                    t.src_param,
                    t.dst_param,
                    t.dim,
                    t.src_offset,
                    t.dst_offset,
                    t.length,
                    t.nbytes,
                    t.dtype,
                ]
                for t in self.transfers
            ],
        }

    @property
    def me(self) -> Peer:
        return (self.role, self.rank)

    def layout(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Layout:
        """The layout of this rank's local tensors (what a generation rank's consumer holds)."""
        return Layout(self.tensors, bucket_bytes)

    def shape_of(self, name: str) -> tuple[tuple[int, ...], str]:
        return self._shapes[name]

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
            index = 0
            bucket: list[Transfer] = []
            size = 0

            def flush(src: int = src, dst: int = dst) -> None:
                nonlocal index, bucket, size
                if not bucket:
                    return
                items, offset = [], 0
                for t in sorted(bucket, key=lambda t: -t.itemsize):  # stable: aligned, no padding
                    items.append((t, offset))
                    offset += t.nbytes
                out.append(ReshardMessage(src, dst, index, offset, tuple(items)))
                index += 1
                bucket, size = [], 0

            for t in sorted(transfers, key=lambda t: t.key):
                if t.nbytes >= direct_min or t.nbytes > bucket_bytes:
                    flush()
                    out.append(ReshardMessage(src, dst, index, t.nbytes, ((t, 0),)))
                    index += 1
                    continue
                if size + t.nbytes > bucket_bytes:
                    flush()
                bucket.append(t)
                size += t.nbytes
            flush()
        return sorted(out, key=lambda m: m.order)


# -- wires --------------------------------------------------------------------------------------
class Pending(Protocol):
    def wait(self, deadline: Deadline, what: str) -> None: ...


class P2PWire(Protocol):
    """Point-to-point sends and receives plus a sum all-reduce over one group, on one device."""

    @property
    def device(self) -> torch.device: ...

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending: ...

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> Pending: ...


def _is_torch_group(obj: Any) -> bool:
    """A torch.distributed ProcessGroup, or a backend made directly (``ProcessGroupGloo(store, ...)``)."""
    return isinstance(obj, (dist.ProcessGroup, _c10d.Backend))


def _group_device(group: Any) -> torch.device:
    if isinstance(group, dist.ProcessGroupGloo):
        return torch.device("cpu")
    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:
        backend = str(getattr(group, "name", lambda: "")()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchP2PWire(_GroupMember):
    """A torch.distributed process group (registered or not) as a `P2PWire`; ranks are group ranks."""

    def __init__(self, group: Any = None, device: str | torch.device | None = None) -> None:
        if group is None:
            if not dist.is_initialized():
                raise RuntimeError("torch.distributed is not initialized and no process group was given")
            group = dist.group.WORLD
        if not _is_torch_group(group):
            raise TypeError(f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
        self.group: Any = group
        dev = torch.device(device) if device is not None else _group_device(group)
        super().__init__(dev, int(group.rank()), int(group.size()))

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _TorchPending:
        try:
            return _TorchPending(self.group.send([tensor], peer, tag), "send")
        except Exception as exc:
            raise map_dist_error(exc, f"send to group rank {peer}") from exc

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _TorchPending:
        try:
            return _TorchPending(self.group.recv([tensor], peer, tag), "recv")
        except Exception as exc:
            raise map_dist_error(exc, f"receive from group rank {peer}") from exc

    def all_reduce_sum(self, tensor: torch.Tensor) -> _TorchPending:
        try:
            return _TorchPending(self.group.allreduce([tensor]), "all_reduce")
        except Exception as exc:
            raise map_dist_error(exc, "all_reduce") from exc


class NcclP2PWire(_GroupMember):  # pragma: no cover - needs several GPUs and cupy
    """A cupy NCCL communicator (`NcclWire`: bounded rendezvous, side stream, abort at the
    deadline) as a `P2PWire` for multi-GPU reshards.

    NCCL matches point-to-point operations between two ranks by call order, which the global
    message order guarantees, so tags are not needed. A wait past the deadline aborts the
    communicator (the session is then broken and must be rebuilt).
    """

    def __init__(self, wire: NcclWire) -> None:
        super().__init__(wire.device, wire.rank, wire.size)
        self.base = wire

    @classmethod
    def create(
        cls,
        store: Any,
        rank: int,
        world_size: int,
        device: str | torch.device | int | None = None,
        deadline: Deadline | float | None = 120.0,
        name: str = "reshard",
    ) -> NcclP2PWire:
        return cls(NcclWire.create(store, rank, world_size, 0, device, deadline, name))

    def _launch(self, tensor: torch.Tensor, peer: int, op: str) -> _NcclPending:
        base = self.base
        if base.aborted:
            raise PeerLostError("the NCCL communicator was aborted after an earlier failure")
        if tensor.device != base.device or not tensor.is_contiguous():
            raise ValueError(f"NCCL tensors must be contiguous on {base.device}, got {tensor.device}")
        nccl = import_nccl()
        stream = base.stream
        stream.wait_stream(torch.cuda.current_stream(base.device))
        with torch.cuda.stream(stream):
            call = base.comm.send if op == "send" else base.comm.recv
            call(tensor.data_ptr(), tensor.numel(), nccl.NCCL_UINT8, peer, stream.cuda_stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        tensor.record_stream(stream)
        return _NcclPending(base, event, tensor)

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _NcclPending:
        return self._launch(tensor.view(torch.uint8), peer, "send")

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _NcclPending:
        return self._launch(tensor.view(torch.uint8), peer, "recv")

    def all_reduce_sum(self, tensor: torch.Tensor) -> _NcclPending:
        return self.base.all_reduce_sum(tensor)


# -- groups ---------------------------------------------------------------------------------------
class PeerGroup:
    """One process group of a reshard and who is who in it.

    `members` maps ``("train", r)`` / ``("gen", g)`` to group ranks. Every rank lists its groups
    with the same `key` order. Every generation rank must belong to every group (true for
    `world` and for one group per training pipeline stage, `stage`).
    """

    def __init__(self, wire: P2PWire | dist.ProcessGroup, members: Mapping[Peer, int], key: int = 0) -> None:
        self.wire: P2PWire = TorchP2PWire(wire) if _is_torch_group(wire) else cast(P2PWire, wire)
        self.key = int(key)
        self.members: dict[Peer, int] = {}
        ranks: set[int] = set()
        for (side, r), group_rank in members.items():
            if side not in (TRAIN, GEN):
                raise ValueError(f"group {key}: member side must be {TRAIN!r} or {GEN!r}, got {side!r}")
            if not 0 <= group_rank < self.wire.size or group_rank in ranks:
                raise ValueError(
                    f"group {key}: group rank {group_rank} of {side} rank {r} is invalid or taken"
                )
            ranks.add(group_rank)
            self.members[(side, int(r))] = int(group_rank)
        if len(self.members) != self.wire.size:
            raise ValueError(
                f"group {key}: {len(self.members)} members listed for a group of {self.wire.size}"
            )
        self.labels = {v: k for k, v in self.members.items()}
        trains = sorted(r for side, r in self.members if side == TRAIN)
        self.lead: int | None = trains[0] if trains else None
        self.gens = sorted(r for side, r in self.members if side == GEN)

    @classmethod
    def world(
        cls,
        group: P2PWire | dist.ProcessGroup | None,
        train_world_size: int,
        gen_world_size: int,
        key: int = 0,
    ) -> PeerGroup:
        """One group of everybody: training rank r is group rank r, generation rank g is T + g."""
        wire = TorchP2PWire(group) if group is None or _is_torch_group(group) else group
        members: dict[Peer, int] = {(TRAIN, r): r for r in range(train_world_size)}
        members.update({(GEN, g): train_world_size + g for g in range(gen_world_size)})
        return cls(wire, members, key)

    @classmethod
    def stage(
        cls, group: P2PWire | dist.ProcessGroup, train_ranks: Sequence[int], gen_world_size: int, key: int
    ) -> PeerGroup:
        """One pipeline stage's group: its training ranks (in the given order), then every generation rank."""
        members: dict[Peer, int] = {(TRAIN, int(r)): i for i, r in enumerate(train_ranks)}
        members.update({(GEN, g): len(train_ranks) + g for g in range(gen_world_size)})
        return cls(group, members, key)

    def label(self, group_rank: int) -> str:
        side, r = self.labels[group_rank]
        return f"{side} rank {r}"


@dataclass(frozen=True)
class ReshardStats:
    """What one reshard moved on this rank."""

    version: int
    messages: int
    nbytes: int
    seconds: float
    peers: int
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


# -- sessions --------------------------------------------------------------------------------------
def _encode_header(payload: dict[str, Any]) -> bytes:
    raw = json.dumps(payload, separators=(",", ":")).encode()
    if len(raw) > HEADER_BYTES:
        raise MetadataError(
            f"reshard header is {len(raw)} bytes, over its {HEADER_BYTES}-byte frame (extras too big?)"
        )
    return raw + b"\0" * (HEADER_BYTES - len(raw))


def _decode_header(raw: bytes) -> dict[str, Any]:
    data = decode_json(raw.rstrip(b"\0"), "reshard header")
    if not isinstance(data, dict) or data.get("magic") != MAGIC or data.get("format") != RESHARD_FORMAT:
        raise MetadataError("reshard header has the wrong magic or format")
    _int(data.get("version"), "reshard header 'version'", -(2**62))
    if not isinstance(data.get("digest"), str):
        raise MetadataError("reshard header 'digest' must be a string")
    if data.get("abort") is not None and not isinstance(data.get("abort"), str):
        raise MetadataError("reshard header 'abort' must be a string or null")
    if not isinstance(data.get("extras"), dict):
        raise MetadataError("reshard header 'extras' must be an object")
    return data


def _is_transport(error: BaseException) -> bool:
    """Errors after which the groups are mid-protocol and cannot be reused."""
    return isinstance(error, (PeerLostError, SyncTimeoutError, MetadataError)) or not isinstance(
        error, WeightSyncError
    )


class _Session:
    def __init__(
        self,
        program: RankProgram | Mapping[str, Any] | str | bytes,
        groups: PeerGroup | Sequence[PeerGroup],
        role: str,
        bucket_bytes: int,
        direct_min: int,
        max_in_flight: int,
    ) -> None:
        self.program = RankProgram.coerce(program)
        if self.program.role != role:
            raise ValueError(f"{type(self).__name__} runs a {role} program, got a {self.program.role} one")
        if bucket_bytes < 1 or direct_min < 1 or max_in_flight < 1:
            raise ValueError("bucket_bytes, direct_min and max_in_flight must be positive")
        self.groups = sorted([groups] if isinstance(groups, PeerGroup) else list(groups), key=lambda g: g.key)
        if len({g.key for g in self.groups}) != len(self.groups):
            raise ValueError("peer groups need distinct keys")
        me = self.program.me
        self.groups = [g for g in self.groups if me in g.members]
        if not self.groups:
            raise ValueError(f"{me[0]} rank {me[1]} is in none of the given peer groups")
        for g in self.groups:
            if g.members[me] != g.wire.rank:
                raise ValueError(
                    f"group {g.key}: {me[0]} rank {me[1]} is listed as group rank {g.members[me]}, "
                    f"but this process is group rank {g.wire.rank}"
                )
        self._route: dict[Peer, tuple[PeerGroup, int]] = {}
        for peer in self.program.peers():
            for g in self.groups:
                if peer in g.members:
                    self._route[peer] = (g, g.members[peer])
                    break
            else:
                raise ValueError(f"{peer[0]} rank {peer[1]} shares no peer group with {me[0]} rank {me[1]}")
        self.bucket_bytes = bucket_bytes
        self.direct_min = direct_min
        self.max_in_flight = max_in_flight
        self.messages = self.program.messages(bucket_bytes, direct_min)
        #: Size of a pooled message buffer: the largest message that may need one, at most a bucket.
        self._buf_bytes = min(bucket_bytes, max((m.nbytes for m in self.messages), default=0))
        self._digest_word = _digest_word(self.program.digest)
        self._broken: str | None = None
        self._pool: list[torch.Tensor] = []
        self._decide = True

    @property
    def broken(self) -> str | None:
        """Why this session's groups can no longer be used (a timeout or a lost peer mid-sync)."""
        return self._broken

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise SyncAbortedError(
                f"this reshard session broke in an earlier sync ({self._broken}); rebuild its process groups"
            )

    def _fail(self, error: BaseException) -> None:
        if self._broken is None:
            self._broken = f"{type(error).__name__}: {str(error)[:200]}"

    def release_buffers(self) -> None:
        self._pool = []

    def _device(self, peer: Peer) -> torch.device:
        return self._route[peer][0].wire.device

    def _take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if nbytes <= self._buf_bytes:
            for i, buf in enumerate(self._pool):
                if buf.device == device:
                    return self._pool.pop(i)
            return torch.empty(self._buf_bytes, dtype=torch.uint8, device=device)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _give(self, buf: torch.Tensor | None) -> None:
        if buf is not None and buf.numel() == self._buf_bytes and len(self._pool) < self.max_in_flight + 1:
            self._pool.append(buf)

    def _peer_of(self, msg: ReshardMessage) -> Peer:
        return (GEN, msg.dst) if self.program.role == TRAIN else (TRAIN, msg.src)

    # -- rounds -------------------------------------------------------------------------------
    def _round(
        self, group: PeerGroup, parts: Sequence[int], deadline: Deadline, what: str
    ) -> list[list[int]]:
        """Sum all-reduce of one int64 per member per part; returns each part as a per-rank list."""
        n = group.wire.size
        vec = torch.zeros(len(parts) * n, dtype=torch.int64)
        for i, value in enumerate(parts):
            vec[i * n + group.wire.rank] = int(value)
        vec = vec.to(group.wire.device)
        group.wire.all_reduce_sum(vec).wait(deadline, f"{what} in group {group.key}")
        values = [int(v) for v in vec.cpu().tolist()]
        return [values[i * n : (i + 1) * n] for i in range(len(parts))]

    def _negotiate(
        self, code: int, version: int, deadline: Deadline
    ) -> tuple[dict[int, str | None], list[int]]:
        """Per group: None if it agreed, else why not; plus every code seen.

        Generation ranks also report how many groups they are in (every generation rank is in
        every group): with one group, everybody sees the same commit statuses and the decision
        round is skipped (`_decide`).
        """
        outcome: dict[int, str | None] = {}
        seen: list[int] = []
        groups_here = len(self.groups) if self.program.role == GEN else 0
        self._decide = False
        for g in self.groups:
            codes, versions, digests, counts = self._round(
                g, (code, version, self._digest_word, groups_here), deadline, "negotiation"
            )
            seen.extend(codes)
            self._decide = self._decide or max(counts) > 1
            problems = [f"{g.label(i)} {_word(c)}" for i, c in enumerate(codes) if c]
            if len(set(digests)) > 1:
                problems.append("members execute different plans (digests differ)")
            if not problems and len(set(versions)) > 1:
                problems.append(
                    "members disagree on the version: "
                    + ", ".join(f"{g.label(i)} v{v}" for i, v in enumerate(versions))
                )
            outcome[g.key] = "; ".join(problems) if problems else None
        return outcome, seen

    def _commit_rounds(
        self, ok_groups: Iterable[PeerGroup], code: int, vote: int, deadline: Deadline
    ) -> tuple[list[str], bool]:
        """Status round in every usable group; with several groups, then the generation ranks'
        decision round (a training rank sees only its own group's statuses)."""
        groups = list(ok_groups)
        problems: list[str] = []
        for g in groups:
            (codes,) = self._round(g, (code,), deadline, "commit status")
            problems += [f"{g.label(i)} {_word(c)}" for i, c in enumerate(codes) if c]
        if not self._decide:
            return sorted(set(problems)), not problems and vote == 0
        if self.program.role == GEN and problems:
            vote = 1
        commit = True
        for g in groups:
            (votes,) = self._round(g, (vote,), deadline, "commit decision")
            if any(votes[g.members[(GEN, r)]] for r in g.gens):
                commit = False
        return sorted(set(problems)), commit


class ReshardSender(_Session):
    """Training side: sends this rank's slices of each version to the generation ranks that need them.

    ``send(state_dict, version, deadline, extras)`` returns once every generation rank committed
    (or raises, and none did). `state_dict` holds this rank's local shards by the names of the
    plan's training parameters (extra entries are ignored). `extras` (JSON-safe, small: e.g.
    ``{"kv_scales": {...}}``) reach every generation rank with the header.
    """

    def __init__(
        self,
        program: RankProgram | Mapping[str, Any] | str | bytes,
        groups: PeerGroup | Sequence[PeerGroup],
        *,
        bucket_bytes: int = DEFAULT_RESHARD_BUCKET_BYTES,
        direct_min: int = DEFAULT_RESHARD_DIRECT_MIN,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        super().__init__(program, groups, TRAIN, bucket_bytes, direct_min, max_in_flight)

    def send(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        deadline: Deadline | float | None = None,
        extras: Mapping[str, Any] | None = None,
    ) -> ReshardStats:
        self._check_usable()
        if isinstance(version, bool) or not isinstance(version, int):
            raise VersionError(f"version must be an int, got {version!r}")
        deadline = Deadline.coerce(deadline)
        start = time.perf_counter()
        try:
            return self._send(state_dict, version, deadline, dict(extras or {}), start)
        except BaseException as exc:
            if _is_transport(exc):
                self._fail(exc)
            raise

    def _check_state(self, state_dict: Mapping[str, torch.Tensor]) -> WeightSyncError | None:
        needed = {t.src_param for t in self.program.transfers}
        for name, shape, dtype in self.program.tensors:
            if name not in needed:
                continue
            tensor = state_dict.get(name)
            if tensor is None:
                return LayoutMismatchError(
                    f"train rank {self.program.rank}: parameter {name!r} is missing", name
                )
            if tuple(tensor.shape) != shape or tensor.dtype != dtype_from_name(dtype):
                return LayoutMismatchError(
                    f"train rank {self.program.rank}: parameter {name!r} is {tensor.dtype} "
                    f"{tuple(tensor.shape)}, "
                    f"the plan's shard is {dtype} {shape}",
                    name,
                )
        return None

    def _send(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        deadline: Deadline,
        extras: dict[str, Any],
        start: float,
    ) -> ReshardStats:
        rank = self.program.rank
        problem = self._check_state(state_dict)

        def header_for(extras: dict[str, Any], problem: WeightSyncError | None) -> bytes:
            return _encode_header(
                {
                    "magic": MAGIC,
                    "format": RESHARD_FORMAT,
                    "version": version,
                    "digest": self.program.digest,
                    "extras": extras,
                    "abort": None if problem is None else str(problem)[:2000],
                }
            )

        try:
            header = header_for(extras, problem)
        except (TypeError, ValueError) as exc:  # extras not JSON-safe or too big: tell the receivers
            problem = SyncAbortedError(f"train rank {rank}: extras cannot travel in the header: {exc}")
            header = header_for({}, problem)
        ops: list[tuple[Pending, str]] = []
        keep: list[torch.Tensor] = []
        for g in self.groups:
            if g.lead != rank:
                continue
            frame = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(g.wire.device)
            keep.append(frame)
            for r in g.gens:
                ops.append(
                    (g.wire.send(frame, g.members[(GEN, r)], HEADER_TAG), f"reshard header to gen rank {r}")
                )
        for op, what in ops:
            op.wait(deadline, what)
        outcome, codes = self._negotiate(_Code.ABORTED if problem else _Code.OK, version, deadline)
        if problem is not None:
            raise problem
        ok = {key for key, why in outcome.items() if why is None}
        failure: WeightSyncError | None = None
        total, sent = 0, 0
        messages = [m for m in self.messages if self._route[self._peer_of(m)][0].key in ok]
        if messages:
            failure, total, sent = self._send_data(state_dict, messages, deadline)
        groups = [g for g in self.groups if g.key in ok]
        problems, commit = self._commit_rounds(
            groups, _Code.OK if failure is None else _Code.SENDER, 0, deadline
        )
        if failure is not None:
            raise failure
        bad = [f"group {k}: {why}" for k, why in outcome.items() if why is not None]
        if bad:
            message = f"version {version} not sent: {'; '.join(bad)}"
            if _Code.VERSION in codes:
                raise VersionError(message)
            if _Code.LAYOUT in codes or _Code.PLAN in codes:
                raise LayoutMismatchError(message)
            raise SyncAbortedError(message)
        if not commit:
            raise SyncAbortedError(
                f"version {version} aborted, nothing applied: "
                f"{'; '.join(problems) or 'a generation rank voted no'}"
            )
        return ReshardStats(
            version, sent, total, time.perf_counter() - start, len(self.program.peers()), extras
        )

    def _source(self, state_dict: Mapping[str, torch.Tensor], t: Transfer) -> torch.Tensor:
        tensor = state_dict[t.src_param].detach()
        return tensor if t.dim is None else tensor.narrow(t.dim, t.src_offset, t.length)

    def _send_data(
        self, state_dict: Mapping[str, torch.Tensor], messages: list[ReshardMessage], deadline: Deadline
    ) -> tuple[WeightSyncError | None, int, int]:
        failure: WeightSyncError | None = None
        in_flight: deque[tuple[Pending, torch.Tensor | None, str]] = deque()
        zeros: torch.Tensor | None = None
        total = 0

        def pop() -> None:
            op, buf, what = in_flight.popleft()
            op.wait(deadline, what)
            self._give(buf)

        with torch.no_grad():
            for msg in messages:
                while len(in_flight) >= self.max_in_flight:
                    pop()
                peer = (GEN, msg.dst)
                group, group_rank = self._route[peer]
                device = group.wire.device
                buf: torch.Tensor | None = None
                payload: torch.Tensor | None = None
                if failure is None:
                    try:
                        payload, buf = self._pack(state_dict, msg, device)
                    except Exception as exc:
                        name = ", ".join(sorted({t.src_param for t, _ in msg.items}))
                        failure = SyncAbortedError(
                            f"train rank {self.program.rank} failed to read {name}: "
                            f"{type(exc).__name__}: {exc}"
                        )
                        failure.__cause__ = exc
                        self._give(buf)
                        buf = None
                if payload is None:  # keep the pair in step after a failure
                    if zeros is None or zeros.numel() < msg.nbytes or zeros.device != device:
                        zeros = torch.zeros(
                            max(msg.nbytes, self.bucket_bytes), dtype=torch.uint8, device=device
                        )
                    payload = zeros[: msg.nbytes]
                what = f"reshard message {msg.index} to gen rank {msg.dst}"
                in_flight.append((group.wire.send(payload, group_rank, msg.tag), buf, what))
                total += msg.nbytes
            while in_flight:
                pop()
        return failure, total, len(messages)

    def _pack(
        self, state_dict: Mapping[str, torch.Tensor], msg: ReshardMessage, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if len(msg.items) == 1:
            region = self._source(state_dict, msg.items[0][0])
            if region.is_contiguous() and region.device == device:
                return region.reshape(-1).view(torch.uint8), None
        buf = self._take(msg.nbytes, device)
        try:
            for t, offset in msg.items:
                region = self._source(state_dict, t)
                buf[offset : offset + t.nbytes].view(region.dtype).view(region.shape).copy_(region)
        except BaseException:
            self._give(buf)
            raise
        return buf[: msg.nbytes], buf


class ReshardReceiver(_Session):
    """Generation side: receives this rank's shard of each version into a `BucketConsumer`.

    The consumer's layout must hold exactly this rank's tensors (`RankProgram.layout` builds
    one; any bucket size works). ``receive(consumer, deadline)`` stages everything, checks every
    group agreed, then commits on every generation rank or aborts on all; the returned stats
    carry the header's extras (e.g. kv-cache scales).
    """

    def __init__(
        self,
        program: RankProgram | Mapping[str, Any] | str | bytes,
        groups: PeerGroup | Sequence[PeerGroup],
        *,
        bucket_bytes: int = DEFAULT_RESHARD_BUCKET_BYTES,
        direct_min: int = DEFAULT_RESHARD_DIRECT_MIN,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        super().__init__(program, groups, GEN, bucket_bytes, direct_min, max_in_flight)
        self._staging: torch.Tensor | None = None

    def release_buffers(self) -> None:
        super().release_buffers()
        self._staging = None

    def receive(self, consumer: BucketConsumer, deadline: Deadline | float | None = None) -> ReshardStats:
        self._check_usable()
        deadline = Deadline.coerce(deadline)
        start = time.perf_counter()
        began = False

        def on_begin() -> None:
            nonlocal began
            began = True

        try:
            return self._receive(consumer, deadline, start, on_begin)
        except BaseException as exc:
            if _is_transport(exc):
                self._fail(exc)
                if began:
                    _safe_abort(consumer, exc)
            raise

    def _check_layout(self, layout: Layout) -> WeightSyncError | None:
        mine = {name: (shape, dtype) for name, shape, dtype in self.program.tensors}
        for spec in layout.tensors:
            if spec.name not in mine:
                return LayoutMismatchError(
                    f"gen rank {self.program.rank}: consumer holds {spec.name!r}, which the plan does not",
                    spec.name,
                )
            if mine[spec.name] != (spec.shape, spec.dtype):
                shape, dtype = mine[spec.name]
                return LayoutMismatchError(
                    f"gen rank {self.program.rank}: consumer's {spec.name!r} is {spec.dtype} {spec.shape}, "
                    f"the plan's shard is {dtype} {shape}",
                    spec.name,
                )
        missing = [name for name in mine if name not in layout]
        if missing:
            return LayoutMismatchError(
                f"gen rank {self.program.rank}: consumer lacks {missing[0]!r} of the plan", missing[0]
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
            headers.append(_decode_header(bytes(frame.cpu().numpy().tobytes())))
        if not headers:
            raise MetadataError(f"gen rank {self.program.rank}: no peer group has a training rank")
        return headers

    def _receive(
        self, consumer: BucketConsumer, deadline: Deadline, start: float, on_begin: Any
    ) -> ReshardStats:
        rank = self.program.rank
        layout = consumer.layout
        headers = self._headers(deadline)
        versions = {h["version"] for h in headers}
        version = headers[0]["version"] if len(versions) == 1 else -1
        extras: dict[str, Any] = {}
        for h in headers:
            for key, value in h["extras"].items():
                if isinstance(value, dict) and isinstance(extras.get(key), dict):
                    extras[key].update(value)
                else:
                    extras[key] = value
        code = _Code.OK
        own: WeightSyncError | None = None
        aborts = [h["abort"] for h in headers if h["abort"]]
        if aborts:
            code, own = _Code.ABORTED, SyncAbortedError(f"sender aborted version {version}: {aborts[0]}")
        elif len(versions) != 1:
            code, own = (
                _Code.VERSION,
                VersionError(f"training ranks announced different versions {sorted(versions)}"),
            )
        elif any(h["digest"] != self.program.digest for h in headers):
            code, own = _Code.PLAN, LayoutMismatchError("a training rank executes a different reshard plan")
        else:
            own = self._check_layout(layout)
            if own is not None:
                code = _Code.LAYOUT
        if code == _Code.OK:
            try:
                consumer.begin(version)
                on_begin()
            except VersionError as exc:
                code, own = _Code.VERSION, exc
            except Exception as exc:
                code = _Code.CONSUMER
                own = SyncAbortedError(f"consumer refused version {version}: {exc}")
                own.__cause__ = exc
        outcome, codes = self._negotiate(code, version, deadline)
        ok = {key for key, why in outcome.items() if why is None}
        messages = [m for m in self.messages if self._route[self._peer_of(m)][0].key in ok]
        failure: WeightSyncError | None = None
        total = 0
        if messages or (code == _Code.OK and len(ok) == len(self.groups)):
            staging, regions = self._staging_for(consumer, layout, code == _Code.OK)
            total = self._receive_data(messages, staging, deadline)
            if code == _Code.OK and len(ok) == len(self.groups):
                try:
                    for bucket, region in zip(layout.buckets, regions, strict=True):
                        consumer.consume(bucket.index, region)
                except Exception as exc:
                    failure = (
                        exc
                        if isinstance(exc, WeightSyncError)
                        else SyncAbortedError(
                            f"consumer failed to take version {version}: {type(exc).__name__}: {exc}"
                        )
                    )
        vote = 0 if code == _Code.OK and failure is None and len(ok) == len(self.groups) else 1
        problems, commit = self._commit_rounds(
            [g for g in self.groups if g.key in ok],
            _Code.OK if failure is None else _Code.CONSUMER,
            vote,
            deadline,
        )
        if own is not None or failure is not None or not commit or len(ok) != len(self.groups):
            if own is not None:
                error: WeightSyncError = own
            elif failure is not None:
                error = failure
            else:
                why = [f"group {k}: {w}" for k, w in outcome.items() if w is not None] + problems
                error = SyncAbortedError(
                    f"gen rank {rank}: version {version} not applied: "
                    f"{'; '.join(why) or 'a generation rank voted no'}"
                )
                if _Code.VERSION in codes:
                    error = VersionError(str(error))
            if code == _Code.OK:
                _safe_abort(consumer, error)
            raise error
        consumer.commit(version)
        return ReshardStats(
            version, len(messages), total, time.perf_counter() - start, len(self.program.peers()), extras
        )

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
        regions: list[torch.Tensor] = []
        if any(t is None for t in targets) and (
            self._staging is None
            or self._staging.numel() < layout.padded_bytes
            or self._staging.device != device
        ):
            self._staging = torch.empty(layout.padded_bytes, dtype=torch.uint8, device=device)
        starts = bucket_starts(layout)
        for bucket, start in zip(layout.buckets, starts, strict=True):
            t = targets[bucket.index]
            if t is None:
                assert self._staging is not None
                t = self._staging[start : start + bucket.nbytes]
            regions.append(t[: bucket.nbytes])
        views = {spec.name: typed_view(regions[spec.bucket], spec) for spec in layout.tensors}
        return views, regions

    def _receive_data(
        self, messages: list[ReshardMessage], staging: Mapping[str, torch.Tensor], deadline: Deadline
    ) -> int:
        in_flight: deque[tuple[ReshardMessage, Pending, torch.Tensor | None, str]] = deque()
        total = 0

        def region(t: Transfer) -> torch.Tensor:
            tensor = staging[t.dst_param]
            return tensor if t.dim is None else tensor.narrow(t.dim, t.dst_offset, t.length)

        def pop() -> None:
            msg, op, buf, what = in_flight.popleft()
            op.wait(deadline, what)
            if buf is not None:
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
                buf: torch.Tensor | None = None
                dest: torch.Tensor | None = None
                if len(msg.items) == 1:
                    r = region(msg.items[0][0])
                    if r.is_contiguous() and r.device == device:
                        dest = r.reshape(-1).view(torch.uint8)
                if dest is None:
                    buf = self._take(msg.nbytes, device)
                    dest = buf[: msg.nbytes]
                what = f"reshard message {msg.index} from train rank {msg.src}"
                in_flight.append((msg, group.wire.recv(dest, group_rank, msg.tag), buf, what))
                total += msg.nbytes
            while in_flight:
                pop()
        return total


def _safe_abort(consumer: BucketConsumer, error: BaseException) -> None:
    try:
        consumer.abort(error)
    except Exception:  # the consumer's cleanup must not hide the sync's error
        import logging

        logging.getLogger(__name__).exception("consumer.abort failed")
