"""Bucketed, pipelined weight broadcast over torch.distributed (gloo on CPU, nccl on GPU).

The protocol (header, negotiation, control words, double-buffered buckets, two-phase commit,
aborts) is `_wire.py`; this module only adapts a torch.distributed process group to its `Wire`:
async broadcasts and all-reduces whose waits take the sync's deadline, and torch's errors mapped
to ours (a peer whose socket closed is a `PeerLostError`, a wait past its deadline a
`SyncTimeoutError`). Bucket buffers live on the device that follows the group's backend.

Two kinds of group: a torch ProcessGroup of the default world (`TorchWire`, global ranks, as
torch's collectives take them) and a `MemberGroup` built by its members alone, with no
default group (`MemberWire`, member ranks).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import PeerLostError, SyncTimeoutError, WeightSyncError
from rlfleet.weightsync.codec._delta import DEFAULT_MAX_FRACTION
from rlfleet.weightsync.dist._member import MemberGroup
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._frames import DEFAULT_DIRECT_MIN_BYTES
from rlfleet.weightsync.protocol._wire_receiver import ProtocolReceiver
from rlfleet.weightsync.protocol._wire_sender import ProtocolSender

__all__ = ["BroadcastReceiver", "BroadcastSender", "MemberWire", "TorchWire", "map_dist_error"]

_PEER_WORDS = (
    "connection closed",
    "connection reset",
    "closed by peer",
    "broken pipe",
    "econnreset",
    "socket closed",
    "connection refused",
    "remote worker",
    "peer",
)


def map_dist_error(exc: BaseException, what: str) -> WeightSyncError:
    """Our error for a torch.distributed failure during `what`."""
    if isinstance(exc, WeightSyncError):
        return exc
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    low = message.lower()
    if isinstance(exc, TimeoutError) or "timed out" in low or "timeout" in low:
        error: WeightSyncError = SyncTimeoutError(f"{what} timed out: {message}")
    elif any(word in low for word in _PEER_WORDS):
        error = PeerLostError(f"{what}: a peer of the process group is gone: {message}")
    else:
        error = PeerLostError(f"{what} failed in the process group (a peer is likely gone): {message}")
    error.__cause__ = exc
    return error


def default_device(group: Any = None) -> torch.device:
    """cuda (current device) for an nccl group, else cpu."""
    return _backend_device(str(dist.get_backend(group)))


def _backend_device(backend: str) -> torch.device:
    if "nccl" in backend.lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _indexed(dev: torch.device) -> torch.device:
    if dev.type == "cuda" and dev.index is None:  # "cuda" means the current device, by index
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class TorchPending:
    """A torch.distributed Work whose wait is bounded by a Deadline (collectives and point-to-point)."""

    __slots__ = ("_what", "_work")

    def __init__(self, work: Any, what: str) -> None:
        self._work = work
        self._what = what

    def wait(self, deadline: Deadline, what: str) -> None:
        left = deadline.remaining()
        if left is not None and left <= 0:
            raise deadline.error(what)
        try:
            if left is None:
                self._work.wait()
            else:
                # a sub-microsecond remainder would round to timedelta(0): keep it positive
                self._work.wait(timeout=timedelta(seconds=max(left, 0.001)))
        except Exception as exc:
            raise map_dist_error(exc, what) from exc


class GroupMember:
    """What every wire states about itself: its device, its rank in the group and the group's size."""

    def __init__(self, device: torch.device, rank: int, size: int) -> None:
        self._device = device
        self._rank = rank
        self._size = size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return self._rank

    @property
    def size(self) -> int:
        return self._size


class WireBase(GroupMember):
    """A broadcast `Wire`: a group member that also knows the group rank of the sender."""

    def __init__(self, device: torch.device, rank: int, size: int, src: int) -> None:
        super().__init__(device, rank, size)
        self._src = src

    @property
    def src(self) -> int:
        """Group rank of the sender."""
        return self._src


class TorchWire(WireBase):
    """A torch.distributed group as a protocol `Wire`; `src_rank` is a global rank, like torch's."""

    def __init__(self, group: Any, src_rank: int, device: str | torch.device | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (see init_process_group_bounded)")
        chosen = group if group is not None else dist.group.WORLD
        if not isinstance(chosen, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup, got {type(chosen).__name__}")
        self.group: dist.ProcessGroup = chosen
        dev = _indexed(torch.device(device) if device is not None else default_device(self.group))
        rank = dist.get_rank(self.group)
        if rank < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of this process group")
        size = dist.get_world_size(self.group)
        self.src_global = int(src_rank)
        try:
            src = dist.get_group_rank(self.group, self.src_global)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"source rank {src_rank} is not a member of this process group") from exc
        super().__init__(dev, rank, size, src)

    def broadcast(self, tensor: torch.Tensor) -> TorchPending:
        try:
            work = dist.broadcast(tensor, src=self.src_global, group=self.group, async_op=True)
        except Exception as exc:
            raise map_dist_error(exc, "broadcast") from exc
        return TorchPending(work, "broadcast")

    def all_reduce_sum(self, tensor: torch.Tensor) -> TorchPending:
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except Exception as exc:
            raise map_dist_error(exc, "all_reduce") from exc
        return TorchPending(work, "all_reduce")


class MemberWire(WireBase):
    """A `MemberGroup` as a protocol `Wire`; `src` is the sender's member rank.

    Needs no default group: collectives go straight to the group's backend object.
    """

    def __init__(self, group: MemberGroup, src: int, device: str | torch.device | None = None) -> None:
        if not isinstance(group, MemberGroup):
            raise TypeError(f"group must be a MemberGroup, got {type(group).__name__}")
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < group.size:
            raise ValueError(f"source rank {src!r} is not a member rank of {group!r} (0..{group.size - 1})")
        self.group = group
        dev = _indexed(torch.device(device) if device is not None else _backend_device(group.backend))
        super().__init__(dev, group.rank, group.size, src)

    def broadcast(self, tensor: torch.Tensor) -> TorchPending:
        opts = dist.BroadcastOptions()
        opts.rootRank = self._src
        opts.rootTensor = 0
        try:
            work = self.group.process_group.broadcast([tensor], opts)
        except Exception as exc:
            raise map_dist_error(exc, "broadcast") from exc
        return TorchPending(work, "broadcast")

    def all_reduce_sum(self, tensor: torch.Tensor) -> TorchPending:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        try:
            work = self.group.process_group.allreduce([tensor], opts)
        except Exception as exc:
            raise map_dist_error(exc, "all_reduce") from exc
        return TorchPending(work, "all_reduce")


def _wire_for(group: Any, src_rank: int, device: str | torch.device | None) -> TorchWire | MemberWire:
    if isinstance(group, MemberGroup):
        return MemberWire(group, src_rank, device)
    return TorchWire(group, src_rank, device)


class BroadcastSender(ProtocolSender):
    """Sends versions of a state dict to every other member of `group`.

    `group` is a torch ProcessGroup of the default world (None: the world), with `src_rank`
    the sender's global rank, or a `MemberGroup`, with `src_rank` the sender's member rank.
    ``send(state_dict, version, deadline, buckets=None)`` returns `SyncStats` once every
    receiver committed; it raises (and no receiver applies anything) if a receiver rejects the
    layout or version, fails a bucket or cannot prepare its commit, or if the state dict does
    not fit `layout`. ``buckets`` sends only that share of the layout (several senders, each
    in its own group, assembled on the receivers by `Assembly`). The deadline defaults to
    `DEFAULT_SYNC_TIMEOUT_S`. Extra memory: at most two bucket buffers (large tensors travel
    straight from their own storage).

    ``delta="auto"`` sends a version as its difference from the last one every receiver
    committed (`codec`): one more model copy on the host, in the wire dtype.
    """

    def __init__(
        self,
        layout: Layout,
        group: Any,
        src_rank: int,
        device: str | torch.device | None = None,
        checksums: bool = False,
        direct_min: int = DEFAULT_DIRECT_MIN_BYTES,
        *,
        delta: str = "off",
        delta_max_fraction: float = DEFAULT_MAX_FRACTION,
    ) -> None:
        super().__init__(
            layout,
            _wire_for(group, src_rank, device),
            checksums,
            direct_min,
            delta=delta,
            delta_max_fraction=delta_max_fraction,
        )


class BroadcastReceiver(ProtocolReceiver):
    """Receives versions from `src_rank` into a `BucketConsumer` (``receive(consumer, deadline)``).

    `group` and `src_rank` as for `BroadcastSender`: a torch ProcessGroup and the sender's
    global rank, or a `MemberGroup` and the sender's member rank. ``buckets=`` names the share
    this sender sends (an `Assembly` part's share); the deadline defaults to
    `DEFAULT_SYNC_TIMEOUT_S`.
    """

    def __init__(
        self, layout: Layout, group: Any, src_rank: int, device: str | torch.device | None = None
    ) -> None:
        super().__init__(layout, _wire_for(group, src_rank, device))
