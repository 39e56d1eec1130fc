"""A sender's weights produced on demand: `WeightStream`, read bucket by bucket in layout order.

A trainer sharded with FSDP2 holds no full tensor: each one exists only once it is gathered
(``DTensor.full_tensor()``). Every sender (`BroadcastSender.send`, `ShmRingSender.send`,
`SharedBuffer.publish`, `CudaIpcSender.send`) takes, next to a state dict, a `WeightStream` (or
any iterable of ``(name, tensor)`` pairs that is not a Mapping) and pulls its tensors while it
packs each bucket: at most the buckets in flight and the tensor in hand are alive, never the
whole model. The layout is known up front (`layout_entries` of the module or of a meta-device
copy), so nothing is read ahead.

The layout fixes the order: the stream yields the layout's tensors (those of the buckets a
sender sends, for a share) exactly in layout order. Anything else (a tensor out of order, a
name missing, twice or not in the layout, a wrong shape or dtype, something that is not a
tensor) is a `LayoutMismatchError` naming the parameter, raised while the version is on the
wire: the version aborts through the transport's protocol and every receiver keeps the
previous one.

A producer may reuse one buffer for every tensor it yields (gather into the same scratch, yield
a view of it): every sender consumes or copies a stream's tensor before it asks for the next.
The broadcast, which keeps a bucket on the wire while it pulls the next one, copies a stream's
tensors into the bucket's buffer, unless the stream is ``fresh`` (each tensor new memory that
the producer never writes again, as `full_tensors` yields): then a large tensor goes on the
wire from its own storage, without a copy.

The tensors of an FSDP2 stream are gathered by collectives that every rank of the mesh takes
part in. A sender that stopped reading at a failure would leave the other ranks waiting in a
gather (and pair their next collective with the wrong one), so after a failure the sender
drains what is left of the stream (`drain`), within the sync's deadline. A stream is read once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import LayoutMismatchError
from rlfleet.weightsync.layout._copy import copy_pairs
from rlfleet.weightsync.layout._dtypes import dtype_name
from rlfleet.weightsync.layout._layout import ALIGNMENT, Layout, TensorSpec, align
from rlfleet.weightsync.layout._packing import typed_view
from rlfleet.weightsync.protocol._core import raw_bytes
from rlfleet.weightsync.protocol._feed import FullTensors, full_tensors
from rlfleet.weightsync.protocol._frames import Segment

__all__ = [
    "Source",
    "StreamCursor",
    "WeightStream",
    "Weights",
    "drain_on_error",
    "fill_bucket",
    "open_source",
]

_log = logging.getLogger(__name__)

#: What a sender sends: a state dict (every tensor at hand) or a stream of (name, tensor) pairs.
Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


class WeightStream:
    """``(name, tensor)`` pairs produced on demand, read once, in the layout's order.

    ``WeightStream(pairs)`` wraps any iterable (a generator that gathers one parameter at a
    time); ``WeightStream.from_module(model)`` is `full_tensors(model)`: every state-dict entry,
    DTensors gathered one at a time. Every rank of the mesh must iterate such a stream (the
    gathers are collectives); the sender's rank hands it to the sender, the others `drain` it.

    ``fresh`` says the producer never writes a tensor's memory again once it yielded it (a new
    tensor per pair); a sender may then keep a tensor past the next pull and send it from its
    own storage. By default (False, or None for a plain iterable) a tensor is copied before the
    next one is asked for, so the producer may reuse one buffer for every tensor; `full_tensors`
    (and `from_module`) are fresh.
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], *, fresh: bool | None = None) -> None:
        if isinstance(weights, Mapping):
            raise TypeError("a Mapping is a state dict: hand it to the sender as it is, not as a stream")
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
            raise TypeError(f"a weight stream iterates (name, tensor) pairs, got {type(weights).__name__}")
        self.fresh = bool(fresh) if fresh is not None else isinstance(weights, FullTensors)
        self._iterator: Iterator[Any] = iter(weights)
        self._pulled = 0
        self._ended = False
        self._claimed = False

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> WeightStream:
        """The stream of `module`'s state dict, each DTensor gathered when it is reached."""
        return cls(full_tensors(module), fresh=True)

    @property
    def pulled(self) -> int:
        """Pairs read from the stream so far."""
        return self._pulled

    def claim(self) -> None:
        """Mark the stream as read by one sync; a second sync of the same stream is refused."""
        if self._claimed:
            raise ValueError(
                "this weight stream was already sent: a stream is read once, make one per version"
            )
        self._claimed = True

    def pull(self) -> tuple[str, torch.Tensor] | None:
        """The next pair (checked to be a name and a tensor), or None at the end."""
        if self._ended:
            return None
        try:
            item = next(self._iterator)
        except StopIteration:
            self._ended = True
            return None
        self._pulled += 1
        if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str):
            raise LayoutMismatchError(
                f"weight stream item {self._pulled} is {type(item).__name__} {item!r:.80}, "
                "not a (name, tensor) pair"
            )
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise LayoutMismatchError(f"parameter {name!r} is a {type(tensor).__name__}, not a tensor", name)
        if _is_dtensor(tensor):
            raise LayoutMismatchError(
                f"parameter {name!r} is a DTensor (a shard): gather it first (full_tensors(module) does)",
                name,
            )
        return name, tensor

    def drain(self, deadline: Deadline | float | None = None) -> int:
        """Read and drop whatever is left, until the end or `deadline`; returns the pairs dropped.

        A stream whose pairs come from collectives must be read to its end on every rank, even
        after a failure on this one. An error raised by the stream itself ends the drain.
        """
        deadline = Deadline.coerce(deadline)
        dropped = 0
        while not self._ended:
            if deadline.expired:
                _log.warning("weight stream: deadline passed while draining after %d pair(s)", dropped)
                break
            try:
                item = next(self._iterator)
            except StopIteration:
                self._ended = True
                break
            except Exception:
                _log.warning("weight stream: the stream failed while it was drained", exc_info=True)
                self._ended = True
                break
            dropped += 1
            del item
        return dropped

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The pairs, checked (a consumer that takes any order, as `feed`, reads it this way)."""
        self.claim()
        while (pair := self.pull()) is not None:
            yield pair


class StreamCursor:
    """Reads a `WeightStream` in `layout`'s order for the buckets a sender sends, checking each
    tensor against its spec (`bucket`), then that nothing follows the last one (`finish`)."""

    def __init__(self, stream: WeightStream, layout: Layout, buckets: Sequence[int] | None = None) -> None:
        stream.claim()
        self.stream = stream
        self.layout = layout
        indices = range(len(layout.buckets)) if buckets is None else sorted(buckets)
        self._order = [spec for k in indices for spec in layout.buckets[k].tensors]
        self._position = {spec.name: i for i, spec in enumerate(self._order)}
        self._share = buckets is not None
        self._next = 0

    def bucket(self, index: int) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
        """Bucket `index`'s specs and their tensors, pulled from the stream one at a time."""
        for spec in self.layout.buckets[index].tensors:
            yield spec, self._take(spec)

    def _take(self, spec: TensorSpec) -> torch.Tensor:
        expected = self._order[self._next] if self._next < len(self._order) else None
        if expected is None or expected.name != spec.name:
            raise LayoutMismatchError(f"the sender reads {spec.name!r} out of the layout's order", spec.name)
        pair = self.stream.pull()
        if pair is None:
            left = len(self._order) - self._next
            raise LayoutMismatchError(
                f"the weight stream ended without parameter {spec.name!r} "
                f"({left} tensor(s) of the layout never came)",
                spec.name,
            )
        name, tensor = pair
        if name != spec.name:
            raise self._misplaced(name, spec)
        if not spec.takes(tensor):  # the wire dtype, or the source dtype it is cast from
            raise LayoutMismatchError(
                f"parameter {name!r} is {dtype_name(tensor.dtype)} {tuple(tensor.shape)} in the weight "
                f"stream, layout says {spec.dtype} {spec.shape}",
                name,
            )
        self._next += 1
        return tensor

    def _misplaced(self, name: str, spec: TensorSpec) -> LayoutMismatchError:
        where = self._position.get(name)
        if where is None:
            scope = (
                "this sender's share of the layout" if self._share and name in self.layout else "the layout"
            )
            return LayoutMismatchError(
                f"the weight stream yielded {name!r}, which is not in {scope} (expected {spec.name!r})", name
            )
        if where < self._next:
            return LayoutMismatchError(f"the weight stream yielded parameter {name!r} twice", name)
        return LayoutMismatchError(
            f"the weight stream yielded {name!r} where the layout expects {spec.name!r} "
            f"(out of the layout's order, or {spec.name!r} is missing)",
            name,
        )

    def finish(self) -> None:
        """Check that every tensor was read and that the stream has nothing more to give."""
        if self._next < len(self._order):
            missing = self._order[self._next].name
            raise LayoutMismatchError(f"parameter {missing!r} was never read from the weight stream", missing)
        pair = self.stream.pull()
        if pair is not None:
            name = pair[0]
            why = "twice" if name in self._position else "but it is not in the layout"
            if name in self.layout and name not in self._position:
                why = "but it is not in this sender's share of the layout"
            raise LayoutMismatchError(
                f"the weight stream yielded {name!r} after the last tensor, {why}", name
            )

    def ordered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every pair of the buckets sent, checked and in layout order, then `finish`."""
        for spec in self._order:
            yield spec.name, self._take(spec)
        self.finish()


#: Where a sync's tensors come from: a state dict, or a stream read in the layout's order.
Source = Mapping[str, torch.Tensor] | StreamCursor


def open_source(weights: Weights, layout: Layout, buckets: Sequence[int] | None = None) -> Source:
    """A state dict as it is; anything else as a `WeightStream` read in `layout`'s order."""
    if isinstance(weights, Mapping):
        return weights
    stream = weights if isinstance(weights, WeightStream) else WeightStream(weights)
    return StreamCursor(stream, layout, buckets)


@contextlib.contextmanager
def drain_on_error(source: Source, deadline: Deadline) -> Iterator[None]:
    """On an error inside the block, drain `source`'s stream (the other ranks' gathers finish)."""
    try:
        yield
    except Exception:
        if isinstance(source, StreamCursor):
            source.stream.drain(deadline)
        raise


def fill_bucket(
    cursor: StreamCursor, index: int, region: torch.Tensor, views: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Pull bucket `index`'s tensors from `cursor` and copy each into `region` (the bucket's
    bytes: a bucket buffer or a slot), through `views` when the caller keeps typed views.

    Each tensor is dropped once copied, before the next is produced.
    """
    for spec, tensor in cursor.bucket(index):
        if spec.nbytes:
            target = views[spec.name] if views is not None else typed_view(region, spec)
            copy_pairs([target], [tensor.detach()])
        del tensor


class StreamedBuckets:
    """A broadcast's buckets built from a stream, each holding only its own bytes.

    The tensors are copied into a buffer of the bucket's wire bytes, allocated for the bucket and
    freed once it is on the wire, so the producer may reuse its memory as soon as the next tensor
    is asked for. From a ``fresh`` stream a large tensor (a segment of its own) travels from its
    storage as it arrives, with no copy, and only the runs of small tensors are copied. Two
    buckets in flight thus hold at most two buckets' bytes, and the tensor being produced is the
    only other memory.
    """

    def __init__(self, layout: Layout, segments: Sequence[Sequence[Segment]], device: torch.device) -> None:
        self.layout = layout
        self.segments = segments
        self.device = device
        self._plans: dict[tuple[int, bool], tuple[list[int | None], int, dict[str, int]]] = {}

    def _plan(self, k: int, fresh: bool) -> tuple[list[int | None], int, dict[str, int]]:
        """Where each segment of bucket `k` lies in its buffer (None: a large tensor of a fresh
        stream, sent from its own storage), the buffer's size, and the segment of each tensor. A
        segment keeps its offset modulo 512, so every tensor's typed view stays aligned as in the
        layout."""
        plan = self._plans.get((k, fresh))
        if plan is None:
            positions: list[int | None] = []
            cursor = 0
            owner: dict[str, int] = {}
            for g, seg in enumerate(self.segments[k]):
                if seg.tensor is not None and fresh:
                    positions.append(None)
                    owner[seg.tensor] = g
                    continue
                where = align(cursor) + seg.start % ALIGNMENT
                positions.append(where)
                cursor = where + seg.nbytes
                for spec in self.layout.buckets[k].tensors:
                    if spec.nbytes and seg.start <= spec.offset < seg.end:
                        owner[spec.name] = g
            plan = self._plans[(k, fresh)] = (positions, cursor, owner)
        return plan

    def pull(self, cursor: StreamCursor, k: int) -> list[torch.Tensor]:
        """Bucket `k`'s tensors from `cursor`; returns what to broadcast, segment by segment."""
        positions, size, owner = self._plan(k, cursor.stream.fresh)
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device) if size else None
        sources: list[torch.Tensor | None] = [None] * len(positions)
        for spec, tensor in cursor.bucket(k):
            if not spec.nbytes:
                continue
            g = owner[spec.name]
            where = positions[g]
            if where is None:  # a large tensor of a fresh stream: its own bytes go on the wire
                sources[g] = _own_bytes(tensor.to(spec.torch_dtype), self.device)  # a cast: once
                continue
            assert buffer is not None
            start = where + spec.offset - self.segments[k][g].start
            view = buffer[start : start + spec.nbytes].view(spec.torch_dtype).view(spec.shape)
            copy_pairs([view], [tensor.detach()])
        for g, (where, seg) in enumerate(zip(positions, self.segments[k], strict=True)):
            if where is not None:
                assert buffer is not None
                sources[g] = buffer[where : where + seg.nbytes]
        return [src for src in sources if src is not None]


def _own_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor`'s bytes as a flat uint8 tensor on `device`: its own storage when it can be."""
    own = raw_bytes(tensor, device)
    if own is None:
        resolved = tensor.detach().to(device).resolve_conj().resolve_neg().contiguous()
        own = raw_bytes(resolved, device)
    assert own is not None
    return own
