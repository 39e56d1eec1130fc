"""The layout of a model's weights in transfer buckets, computed once per model.

Sender and receivers derive the same layout from the same (name, shape, dtype) list, so the
only metadata a sync carries is that list, as plain JSON, and a digest both sides compare.

A tensor's ``dtype`` is the one on the wire, what the receiver holds and serves; a sender whose
tensors are in another floating dtype (fp32 master weights for a bf16 engine) records that
``source`` dtype in its layout and casts while it packs, once per version. The source is the
sender's business: it changes no byte on the wire, so it is not part of the digest, and a
receiver that builds its layout from its bf16 model matches a sender casting from fp32.

Alignment where it matters, density everywhere else: a tensor of at least `DENSE_BELOW`
bytes starts at a 512-byte boundary (copy engines and vector units gain, and the padding is
under 1% of it); a smaller one starts at a multiple of its element size, which every typed
view needs, so a model of many tiny tensors costs its own bytes on the wire and in a slot, not
512 bytes each. Every bucket is a whole number of 512-byte units, so buckets laid back to back
(a flat buffer, a shared-memory slot) keep every large tensor 512-byte aligned. Buckets are
capped at ``bucket_bytes``; a tensor larger than the cap gets a bucket alone.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from rlfleet.weightsync._errors import LayoutMismatchError, MetadataError
from rlfleet.weightsync.layout._dtypes import dtype_from_name, dtype_name
from rlfleet.weightsync.layout._json import decode_json

ALIGNMENT = 512
#: Tensors smaller than this are packed densely (aligned to their element size only).
DENSE_BELOW = 64 * 1024
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
LAYOUT_FORMAT = 2

# Bounds on metadata decoded from a peer: generous for any real model, small enough that a
# malformed or hostile message cannot make a receiver allocate without limit.
MAX_METADATA_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_NAME_LENGTH = 1024
MAX_DIMS = 32
MAX_TENSOR_BYTES = 1 << 44
#: No dimension can exceed the bytes a tensor may have (even when another dimension is 0).
MAX_DIM = MAX_TENSOR_BYTES


#: What a wire dtype is given as: a dtype, its name, a mapping of tensor names to either, or None.
WireDtype = torch.dtype | str | Mapping[str, torch.dtype | str] | None


def _wire_name(value: object, what: str) -> str:
    if isinstance(value, torch.dtype):
        name = dtype_name(value)
    elif isinstance(value, str):
        name = value.removeprefix("torch.")
        dtype_from_name(name)
    else:
        raise TypeError(f"{what} must be a torch dtype or its name, got {type(value).__name__}")
    if not dtype_from_name(name).is_floating_point:
        raise ValueError(f"{what}: a wire dtype is a floating dtype, got {name}")
    return name


def _entry(spec: TensorSpec) -> list[Any]:
    """A tensor's JSON entry: [name, shape, dtype], with its source dtype when the sender casts."""
    entry: list[Any] = [spec.name, list(spec.shape), spec.dtype]
    return entry if spec.source is None else [*entry, spec.source]


def align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def tensor_alignment(nbytes: int, itemsize: int) -> int:
    """Where a tensor of `nbytes` may start: 512-byte boundaries for large ones, else its item size."""
    return ALIGNMENT if nbytes >= DENSE_BELOW else itemsize


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives: its bucket and its byte offset in that bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int
    nbytes: int
    #: The dtype the sender's tensor has, cast to `dtype` while packing (None: `dtype` itself).
    source: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def source_dtype(self) -> torch.dtype:
        """What a sender's tensor may be besides `torch_dtype` (the same when nothing is cast)."""
        return dtype_from_name(self.source or self.dtype)

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether a sender may pack `tensor` here: the shape, and the wire or the source dtype."""
        return tuple(tensor.shape) == self.shape and tensor.dtype in (self.torch_dtype, self.source_dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketSpec:
    """One transfer unit: the tensors it holds and its (aligned) size in bytes."""

    index: int
    nbytes: int
    tensors: tuple[TensorSpec, ...]


Entry = tuple[str, Sequence[int], str] | tuple[str, Sequence[int], str, str | None]


def _validate_entry(entry: Any, position: int) -> tuple[str, tuple[int, ...], str, str | None]:
    if not isinstance(entry, Sequence) or isinstance(entry, str) or len(entry) not in (3, 4):
        raise MetadataError(
            f"tensor entry {position} must be [name, shape, dtype] or [name, shape, dtype, source dtype], "
            f"got {entry!r:.200}"
        )
    name, shape, dtype = entry[0], entry[1], entry[2]
    source = entry[3] if len(entry) == 4 else None
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise MetadataError(f"tensor entry {position}: invalid name {name!r:.200}")
    if (
        not isinstance(shape, Sequence)
        or isinstance(shape, str)
        or len(shape) > MAX_DIMS
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_TENSOR_BYTES for d in shape
        )
    ):
        raise MetadataError(
            f"tensor {name!r}: invalid shape {shape!r:.200} (each dimension an int in [0, {MAX_DIM}])"
        )
    if not isinstance(dtype, str):
        raise MetadataError(f"tensor {name!r}: dtype must be a string, got {dtype!r:.100}")
    dtype_from_name(dtype)
    if source is not None:
        if not isinstance(source, str):
            raise MetadataError(
                f"tensor {name!r}: source dtype must be a string or null, got {source!r:.100}"
            )
        if source != dtype and not (
            dtype_from_name(source).is_floating_point and dtype_from_name(dtype).is_floating_point
        ):
            raise MetadataError(
                f"tensor {name!r}: a sender casts only between floating dtypes, not {source} to {dtype}"
            )
    return name, tuple(shape), dtype, None if source == dtype else source


class Layout:
    """Bucketed, aligned placement of named tensors; equal layouts have equal digests."""

    def __init__(
        self,
        entries: Iterable[Entry],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGNMENT:
            raise MetadataError(f"bucket_bytes must be an int >= {ALIGNMENT}, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        specs: list[TensorSpec] = []
        buckets: list[list[TensorSpec]] = []
        sizes: list[int] = []
        seen: set[str] = set()
        cursor = 0
        for position, entry in enumerate(entries):
            if position >= MAX_TENSORS:
                raise MetadataError(f"more than {MAX_TENSORS} tensors in one layout")
            name, shape, dtype, source = _validate_entry(entry, position)
            if name in seen:
                raise MetadataError(f"tensor {name!r} appears twice in the layout")
            seen.add(name)
            itemsize = dtype_from_name(dtype).itemsize
            nbytes = math.prod(shape) * itemsize
            if nbytes > MAX_TENSOR_BYTES:
                raise MetadataError(
                    f"tensor {name!r} claims {nbytes} bytes, over the {MAX_TENSOR_BYTES} limit"
                )
            offset = align(cursor, tensor_alignment(nbytes, itemsize))
            if not buckets or (buckets[-1] and align(offset + nbytes) > bucket_bytes):
                buckets.append([])  # the first bucket, or this tensor would overflow the current one
                sizes.append(0)
                offset = 0
            spec = TensorSpec(name, shape, dtype, len(buckets) - 1, offset, nbytes, source)
            buckets[-1].append(spec)
            specs.append(spec)
            cursor = offset + nbytes
            sizes[-1] = max(ALIGNMENT, align(cursor))
        self.tensors: tuple[TensorSpec, ...] = tuple(specs)
        self.buckets: tuple[BucketSpec, ...] = tuple(
            BucketSpec(i, size, tuple(members))
            for i, (size, members) in enumerate(zip(sizes, buckets, strict=True))
        )
        self._by_name = {spec.name: spec for spec in specs}

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        wire_dtype: WireDtype = None,
    ) -> Layout:
        """The layout of `state_dict`, in its own key order (TypeError naming an entry that is no tensor).

        `wire_dtype` (a dtype, its name, or a mapping of names to either): what floating tensors
        travel as, the engine's dtype; the sender casts them while packing (see `cast`).
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"a state dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
            )
        for name, tensor in state_dict.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        layout = cls(
            ((name, tuple(t.shape), dtype_name(t.dtype)) for name, t in state_dict.items()),
            bucket_bytes,
        )
        return layout if wire_dtype is None else layout.cast(wire_dtype)

    def cast(self, wire_dtype: WireDtype) -> Layout:
        """This layout with floating tensors carried as `wire_dtype`, each recording its source dtype.

        A dtype (or its name) applies to every floating tensor; a mapping, to the tensors it names
        (ValueError naming one the layout lacks). Integer and bool tensors, and tensors already in
        the wire dtype, are left as they are. Casting again keeps the first source.
        """
        if wire_dtype is None:
            return self
        if isinstance(wire_dtype, Mapping):
            wanted = {name: _wire_name(d, f"wire_dtype[{name!r}]") for name, d in wire_dtype.items()}
            unknown = [name for name in wanted if name not in self._by_name]
            if unknown:
                raise ValueError(f"wire_dtype names {unknown[0]!r}, which is not in the layout")
        else:
            every = _wire_name(wire_dtype, "wire_dtype")
            wanted = {s.name: every for s in self.tensors if dtype_from_name(s.dtype).is_floating_point}
        entries: list[Entry] = []
        for s in self.tensors:
            target = wanted.get(s.name, s.dtype)
            if target != s.dtype and not dtype_from_name(s.dtype).is_floating_point:
                raise ValueError(f"wire_dtype: {s.name!r} is {s.dtype}; only floating tensors are cast")
            entries.append((s.name, s.shape, target, s.source or s.dtype))
        return Layout(entries, self.bucket_bytes)

    @property
    def casts(self) -> bool:
        """Whether a sender casts any tensor (some source dtype differs from the wire dtype)."""
        return any(s.source is not None for s in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form: the entries, the bucket cap and the digest to check on arrival."""
        return {
            "format": LAYOUT_FORMAT,
            "bucket_bytes": self.bucket_bytes,
            "alignment": ALIGNMENT,
            "dense_below": DENSE_BELOW,
            "tensors": [_entry(s) for s in self.tensors],
            "digest": self.digest,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Layout:
        """Rebuild a layout sent by a peer; malformed or inconsistent data raises MetadataError."""
        if not isinstance(data, Mapping):
            raise MetadataError(f"layout must be a mapping, got {type(data).__name__}")
        if type(data.get("format")) is not int or data.get("format") != LAYOUT_FORMAT:  # not True, not 1.0
            raise MetadataError(f"unsupported layout format {data.get('format')!r}; expected {LAYOUT_FORMAT}")
        if type(data.get("alignment")) is not int or data.get("alignment") != ALIGNMENT:
            raise MetadataError(f"layout alignment {data.get('alignment')!r} differs from ours ({ALIGNMENT})")
        if type(data.get("dense_below")) is not int or data.get("dense_below") != DENSE_BELOW:
            raise MetadataError(
                f"layout packs densely below {data.get('dense_below')!r} bytes, we below {DENSE_BELOW}"
            )
        tensors = data.get("tensors")
        if not isinstance(tensors, list):
            raise MetadataError("layout 'tensors' must be a list")
        if len(tensors) > MAX_TENSORS:
            raise MetadataError(f"layout lists {len(tensors)} tensors, over the {MAX_TENSORS} limit")
        layout = cls(tensors, data.get("bucket_bytes"))  # type: ignore[arg-type]
        if data.get("digest") != layout.digest:
            raise MetadataError("layout digest does not match its entries (corrupted or tampered metadata)")
        return layout

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str, max_bytes: int = MAX_METADATA_BYTES) -> Layout:
        return cls.from_dict(decode_json(raw, "layout metadata", max_bytes))

    # -- queries ----------------------------------------------------------------------
    @cached_property
    def digest(self) -> str:
        """Identity of the layout: entries, order, bucket cap and alignment."""
        canon = json.dumps(
            [
                LAYOUT_FORMAT,
                ALIGNMENT,
                DENSE_BELOW,
                self.bucket_bytes,
                [[s.name, list(s.shape), s.dtype] for s in self.tensors],
            ],
            separators=(",", ":"),
        )
        return hashlib.sha256(canon.encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(s.nbytes for s in self.tensors)

    @property
    def padded_bytes(self) -> int:
        """Bytes of every bucket at its aligned size: a flat buffer's or a shared-memory slot's size."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_nbytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise LayoutMismatchError(f"parameter {name!r} is not in the layout", name) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return (
            f"Layout({len(self.tensors)} tensors, {len(self.buckets)} buckets, "
            f"{self.total_bytes} bytes, digest={self.digest[:12]})"
        )

    def check_state_dict(
        self,
        state_dict: Mapping[str, torch.Tensor],
        buckets: Iterable[int] | None = None,
        *,
        sending: bool = False,
    ) -> None:
        """Raise LayoutMismatchError naming the first parameter that differs from the layout.

        With `buckets`, only the tensors of those buckets must be there (a sender's share), and
        other entries are not checked. `sending`: the state dict a sender packs, whose tensors may
        also be in their source dtype (cast while packing); a receiver's holds the wire dtype.
        """
        specs = self.tensors if buckets is None else [t for b in buckets for t in self.buckets[b].tensors]
        for spec in specs:
            tensor = state_dict.get(spec.name)
            if tensor is None:
                raise LayoutMismatchError(
                    f"parameter {spec.name!r} is missing from the state dict (the layout has it)", spec.name
                )
            if not isinstance(tensor, torch.Tensor):
                raise LayoutMismatchError(f"parameter {spec.name!r} is a {type(tensor).__name__}", spec.name)
            if tuple(tensor.shape) != spec.shape:
                raise LayoutMismatchError(
                    f"parameter {spec.name!r} has shape {tuple(tensor.shape)}, layout says {spec.shape}",
                    spec.name,
                )
            if tensor.dtype != spec.torch_dtype and not (sending and tensor.dtype == spec.source_dtype):
                says = (
                    spec.dtype if not sending or spec.source is None else f"{spec.dtype} (from {spec.source})"
                )
                raise LayoutMismatchError(
                    f"parameter {spec.name!r} has dtype {dtype_name(tensor.dtype)}, layout says {says}",
                    spec.name,
                )
        extra = [name for name in state_dict if name not in self._by_name] if buckets is None else []
        if extra:
            raise LayoutMismatchError(
                f"parameter {extra[0]!r} is not in the layout (the state dict has it)", extra[0]
            )

    def difference(self, other: Layout) -> tuple[str | None, str] | None:
        """The first difference from `other`: (the parameter's name or None, a sentence), or None."""
        if self.digest == other.digest:
            return None
        for mine, theirs in zip(self.tensors, other.tensors, strict=False):
            if mine.name != theirs.name:
                return mine.name, f"parameter {mine.name!r} where the peer has {theirs.name!r}"
            if mine.shape != theirs.shape:
                return mine.name, f"parameter {mine.name!r}: shape {mine.shape} vs peer {theirs.shape}"
            if mine.dtype != theirs.dtype:
                return mine.name, f"parameter {mine.name!r}: dtype {mine.dtype} vs peer {theirs.dtype}"
        if len(self.tensors) != len(other.tensors):
            longer = self if len(self.tensors) > len(other.tensors) else other
            name = longer.tensors[min(len(self.tensors), len(other.tensors))].name
            return name, f"parameter {name!r} exists on only one side"
        return None, f"bucket size {self.bucket_bytes} vs peer {other.bucket_bytes}"

    def diff(self, other: Layout) -> str | None:
        """The first difference from `other` as a sentence naming the parameter, or None."""
        found = self.difference(other)
        return None if found is None else found[1]

    def require_same(self, other: Layout) -> None:
        """Raise LayoutMismatchError naming the parameter where two layouts diverge."""
        found = self.difference(other)
        if found is not None:
            raise LayoutMismatchError(f"layout mismatch: {found[1]}", found[0])
