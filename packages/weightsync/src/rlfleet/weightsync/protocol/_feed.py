"""Feeding a `BucketConsumer` from a stream of ``(name, tensor)`` pairs produced on demand.

A sharded trainer (FSDP2) holds no full tensor: each one exists only once it is gathered
(``DTensor.full_tensor()``, a collective every rank of the mesh takes part in). `feed` packs
such a stream into the layout's buckets as the tensors arrive and hands each bucket to a
consumer in the same process (the node's `SharedBuffer`, a `LoadWeightsConsumer`, any weight
buffer) as soon as it is complete, then commits the version with the consumer's two-phase
commit (`prepare_commit` when it has one). Peak extra memory: the buckets still open (one, when
the stream follows the layout's order) plus the tensor in hand, never the whole model. A
consumer that offers its own storage (`bucket_target`) is written in place, with no bucket
buffer at all.

`full_tensors(module)` is that stream for a module whose parameters may be DTensors: one
parameter gathered at a time, in state-dict order. Every rank of the mesh iterates it (the
gathers are collectives); only the rank that owns the consumer feeds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from rlfleet.weightsync._deadline import DEFAULT_SYNC_TIMEOUT_S, Deadline, caller_deadline
from rlfleet.weightsync._errors import IncompleteSyncError, LayoutMismatchError
from rlfleet.weightsync.layout._dtypes import dtype_name
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import typed_view
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.protocol._wire_base import BucketTarget

__all__ = ["FullTensors", "feed", "full_tensors", "layout_entries"]


class FullTensors(Iterator[tuple[str, torch.Tensor]]):
    """`full_tensors`: the pairs of a module's state dict, each tensor new memory (a gathered
    DTensor) or the module's own, never written by the iteration again (a *fresh* stream)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._pairs = _full_tensors(module)

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._pairs)


def full_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each state-dict entry of `module` as a full tensor, gathered one at a time if sharded.

    A DTensor (FSDP2 ``fully_shard``, tensor parallel) is gathered with ``full_tensor()`` when
    the iteration reaches it, so at most one gathered parameter is alive per step (if the caller
    drops it). Every rank of the mesh must iterate, in the same order. Each tensor is new
    memory (or the module's own), so a sender may send it from its own storage (a fresh
    `WeightStream`).
    """
    return FullTensors(module)


def _full_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    for name, value in module.state_dict(keep_vars=True).items():
        tensor = value.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor


def layout_entries(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, global shape, dtype) of every state-dict entry, without gathering anything.

    A DTensor reports its global shape, so a sharded trainer builds the same `Layout` as the
    unsharded model: ``Layout(layout_entries(model), bucket_bytes)``.
    """
    return [
        (name, tuple(value.shape), dtype_name(value.dtype))
        for name, value in module.state_dict(keep_vars=True).items()
    ]


class _OpenBuckets:
    """Bucket buffers being filled: the consumer's own region when it offers one, else ours."""

    def __init__(self, consumer: BucketConsumer, layout: Layout) -> None:
        self.layout = layout
        self.targets = consumer if isinstance(consumer, BucketTarget) else None
        self.buffers: dict[int, torch.Tensor] = {}
        self.missing: dict[int, set[str]] = {}
        self.own: dict[int, torch.Tensor] = {}  # buckets packed into a buffer of ours, by index
        self.spare: torch.Tensor | None = None  # a finished bucket's buffer, reused for the next
        self.seen: set[str] = set()  # every name placed, its bucket open or handed over

    def place(self, name: str, tensor: torch.Tensor) -> int:
        """Copy `tensor` into its bucket; returns the bucket index."""
        spec = self.layout[name]
        if not spec.takes(tensor):  # the wire dtype, or the source dtype the copy casts from
            raise LayoutMismatchError(
                f"parameter {name!r} is {dtype_name(tensor.dtype)} {tuple(tensor.shape)}, "
                f"layout says {spec.dtype} {spec.shape}",
                name,
            )
        if name in self.seen:  # before anything is written: its bucket may be handed over already
            raise LayoutMismatchError(f"parameter {name!r} appears twice in the stream", name)
        self.seen.add(name)
        index = spec.bucket
        if index not in self.missing:
            self.missing[index] = {t.name for t in self.layout.buckets[index].tensors}
            self.buffers[index] = self._open(index)
        self.missing[index].discard(name)
        if spec.nbytes:
            with torch.no_grad():
                typed_view(self.buffers[index], spec).copy_(tensor)
        return index

    def _open(self, index: int) -> torch.Tensor:
        bucket = self.layout.buckets[index]
        region = self.targets.bucket_target(index) if self.targets is not None else None
        usable = region is not None and region.dtype == torch.uint8 and region.dim() == 1
        if region is None or not usable or region.numel() < bucket.nbytes:
            region, self.spare = self.spare, None
            if region is None:
                region = torch.empty(self.layout.max_bucket_nbytes, dtype=torch.uint8)
            self.own[index] = region
        region = region[: bucket.nbytes]
        cursor = 0  # alignment padding is part of the bucket (checksums read it): keep it zero
        for spec in bucket.tensors:
            if spec.offset > cursor:
                region[cursor : spec.offset].zero_()
            cursor = spec.offset + spec.nbytes
        region[cursor:].zero_()
        return region

    def close(self, index: int) -> torch.Tensor:
        """The finished bucket `index` (its buffer is reused once the consumer took it)."""
        buffer = self.buffers.pop(index)
        del self.missing[index]
        own = self.own.pop(index, None)
        if own is not None:
            self.spare = own
        return buffer


def feed(
    consumer: BucketConsumer,
    weights: Iterable[tuple[str, torch.Tensor]],
    version: int,
    deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S,
) -> int:
    """Hand `weights` to `consumer` as `version`, bucket by bucket, then commit it.

    Within `deadline` (seconds or a `Deadline`; None: no limit), which the consumer's own waits
    also keep (`caller_deadline`: a node buffer waits for its readers no longer than this, nor
    than its own `timeout_s`).

    Every name of the consumer's layout must come exactly once, with the layout's shape and
    dtype, in any order (the layout's order keeps one bucket open at a time); a name that comes
    again is refused before its second tensor is written anywhere. On any error the consumer is
    aborted (its applied version stays) and the error is raised, naming the parameter. Returns
    the version committed.
    """
    deadline = Deadline.coerce(deadline)
    with caller_deadline(deadline):  # a consumer's begin waits under this sync's deadline
        return _feed(consumer, weights, version, deadline)


def _feed(
    consumer: BucketConsumer, weights: Iterable[tuple[str, torch.Tensor]], version: int, deadline: Deadline
) -> int:
    layout = consumer.layout
    consumer.begin(version)
    try:
        open_buckets = _OpenBuckets(consumer, layout)
        done: set[int] = set()
        for name, tensor in weights:
            if name not in layout:
                raise LayoutMismatchError(f"parameter {name!r} is not in the layout", name)
            index = open_buckets.place(name, tensor)
            del tensor  # a gathered parameter is freed before the next one is produced
            if not open_buckets.missing[index]:
                consumer.consume(index, open_buckets.close(index))
                done.add(index)
            deadline.check(f"feeding version {version}")
        if len(done) != len(layout.buckets):
            first = next(b for b in layout.buckets if b.index not in done)
            absent = sorted(open_buckets.missing.get(first.index, {t.name for t in first.tensors}))
            raise IncompleteSyncError(
                f"the stream for version {version} ended without {absent[0]!r} "
                f"(bucket {first.index}; {len(layout.buckets) - len(done)} bucket(s) incomplete)"
            )
        prepare = getattr(consumer, "prepare_commit", None)
        if prepare is not None:
            prepare(version, deadline)
        consumer.commit(version)
    except BaseException as exc:
        consumer.abort(exc)
        raise
    return version
