"""Strategy "Sharded": each of N receivers keeps 1/N of the model, and an all-gather rebuilds it.

The seed names this strategy and never builds it. Here the buckets are split into N
contiguous runs of about equal bytes; member ``r`` keeps run ``r`` in a shard (its pending
version in a second shard, so version v stays intact while v+1 arrives). Between syncs each
member holds ~1/N of the model (twice that while a sync is pending). `gather` all-gathers the
equal-size (padded) shards into one flat tensor on every member and returns views of every
tensor into it: bit-exact, and no copy after the all-gather.

As a `BucketConsumer` it takes every bucket a transport delivers and keeps only its own (so
it works behind any transport); `owned` lists them, for transports that can skip the rest.
It also offers its pending shard as a landing zone (`bucket_target`), so a broadcast writes
owned buckets straight into place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.weightsync._deadline import DEFAULT_SYNC_TIMEOUT_S, Deadline
from rlfleet.weightsync._errors import IncompleteSyncError, MetadataError, VersionError
from rlfleet.weightsync.buffers._buffers import BufferBase
from rlfleet.weightsync.dist._dist import TorchPending
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import bucket_views

__all__ = ["ShardedBuffer", "balanced_ranges"]


def balanced_ranges(sizes: Sequence[int], parts: int) -> list[range]:
    """Split consecutive items with `sizes` into `parts` contiguous runs of about equal total.

    Greedy on cumulative bytes: run ``r`` ends where the running total first reaches
    ``(r + 1) / parts`` of the whole. Runs may be empty when there are fewer items than parts.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    total = sum(sizes)
    bounds = [0]
    running = 0
    index = 0
    for r in range(1, parts):
        goal = total * r / parts
        while index < len(sizes) and running + sizes[index] / 2 <= goal:
            running += sizes[index]
            index += 1
        bounds.append(index)
    bounds.append(len(sizes))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def _digest_word(layout: Layout) -> int:
    return int.from_bytes(hashlib.sha256(layout.digest.encode()).digest()[:7], "little")


class ShardedBuffer(BufferBase):
    """A receiver's 1/N share of the model; `gather` rebuilds the whole on every member."""

    def __init__(
        self,
        layout: Layout,
        rank: int,
        world_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a sharded group of {world_size}")
        super().__init__(layout)
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        sizes = [b.nbytes for b in layout.buckets]
        self.ranges = balanced_ranges(sizes, world_size)
        #: Offset of each bucket inside its owner's shard.
        self._offset: dict[int, int] = {}
        shard_sizes = []
        for run in self.ranges:
            cursor = 0
            for i in run:
                self._offset[i] = cursor
                cursor += sizes[i]
            shard_sizes.append(cursor)
        self.shard_bytes = max(max(shard_sizes, default=0), 1)
        self._owner = {i: r for r, run in enumerate(self.ranges) for i in run}
        self.owned: tuple[int, ...] = tuple(self.ranges[rank])
        self._applied = torch.zeros(self.shard_bytes, dtype=torch.uint8, device=self.device)
        self._pending_shard: torch.Tensor | None = None

    @property
    def extra_bytes(self) -> int:
        """Bytes held for this member's share (one shard, two while a sync is pending)."""
        return self.shard_bytes * (1 if self._pending_shard is None else 2)

    def _region(self, shard: torch.Tensor, index: int) -> torch.Tensor:
        start = self._offset[index]
        return shard[start : start + self._layout.buckets[index].nbytes]

    def bucket_target(self, index: int) -> torch.Tensor | None:
        """Where an owned bucket may land directly (the pending shard); None for the others."""
        with self._state_lock:
            if self._pending is None or self._pending_shard is None or self._owner.get(index) != self.rank:
                return None
            return self._region(self._pending_shard, index)

    # -- BufferBase hooks -------------------------------------------------------------------
    def _needed(self) -> tuple[int, ...]:
        return self.owned

    def _begin(self, version: int) -> None:
        if self._pending_shard is None:
            self._pending_shard = torch.empty(self.shard_bytes, dtype=torch.uint8, device=self.device)

    def _stage(self, index: int, data: torch.Tensor) -> None:
        if self._owner[index] == self.rank and self._pending_shard is not None:
            region = self._region(self._pending_shard, index)
            if region.data_ptr() != data.data_ptr():
                region.copy_(data)

    def _publish(self, version: int) -> None:
        assert self._pending_shard is not None
        self._applied, self._pending_shard = self._pending_shard, self._applied

    def release_pending(self) -> None:
        """Free the second shard between syncs (it is re-allocated by the next `begin`)."""
        with self._state_lock:
            if self._pending is None:
                self._pending_shard = None

    @property
    def shard(self) -> torch.Tensor:
        """This member's applied shard (flat uint8, `shard_bytes` long, zero-padded)."""
        return self._applied

    # -- reassembly -----------------------------------------------------------------------
    def gather(
        self,
        group: Any = None,
        deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S,
        out: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """All-gather every member's applied shard; views of every tensor, in layout order.

        Every member of `group` (whose ranks must match the buffers' ranks) calls it. Raises
        VersionError if members hold different versions, and the mapped transport errors
        (`SyncTimeoutError`, `PeerLostError`) if a member is late or gone; the deadline
        defaults to `DEFAULT_SYNC_TIMEOUT_S`.
        """
        deadline = Deadline.coerce(deadline)
        group_rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        if size != self.world_size or group_rank != self.rank:
            raise ValueError(
                f"group has {size} members and this is rank {group_rank}; the buffer was built for "
                f"rank {self.rank} of {self.world_size}"
            )

        def wait(work: Any, what: str) -> None:
            TorchPending(work, what).wait(deadline, what)

        with self._state_lock:
            applied, version = self._applied, self._version
        ident = torch.tensor([version, _digest_word(self._layout)], dtype=torch.int64, device=self.device)
        idents = torch.empty(2 * size, dtype=torch.int64, device=self.device)
        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        wait(gather_single(idents, ident, group=group, async_op=True), "sharded gather (versions)")
        pairs = idents.view(size, 2).cpu().tolist()
        if any(p[1] != pairs[0][1] for p in pairs):
            bad = [r for r, p in enumerate(pairs) if p[1] != pairs[self.rank][1]]
            raise MetadataError(f"sharded gather: member(s) {bad} hold a different layout")
        versions = [p[0] for p in pairs]
        if len(set(versions)) != 1:
            raise VersionError(f"sharded gather: members hold different versions {versions} (by rank)")
        if versions[0] < 0:
            raise IncompleteSyncError("sharded gather: no version has been committed yet")
        need = self.shard_bytes * size
        if out is None:
            out = torch.empty(need, dtype=torch.uint8, device=self.device)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < need or out.device != self.device:
            raise ValueError(f"out must be a flat uint8 tensor of >= {need} bytes on {self.device}")
        flat = out[:need]
        wait(gather_single(flat, applied, group=group, async_op=True), "sharded gather")
        views: dict[str, torch.Tensor] = {}
        for index, owner in sorted(self._owner.items()):
            start = owner * self.shard_bytes + self._offset[index]
            bucket = self._layout.buckets[index]
            views.update(bucket_views(self._layout, index, flat[start : start + bucket.nbytes]))
        return {name: views[name] for name in self._layout.names}
