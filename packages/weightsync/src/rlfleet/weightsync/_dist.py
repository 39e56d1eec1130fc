"""Bucketed, pipelined weight broadcast over torch.distributed (gloo on CPU, nccl on GPU).

The protocol (header, negotiation, control words, double-buffered buckets, two-phase commit,
aborts) is `_wire.py`; this module only adapts a torch.distributed process group to its `Wire`:
async broadcasts and all-reduces whose waits take the sync's deadline, and torch's errors mapped
to ours (a peer whose socket closed is a `PeerLostError`, a wait past its deadline a
`SyncTimeoutError`). Bucket buffers live on the device that follows the group's backend.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import PeerLostError, SyncTimeoutError, WeightSyncError
from rlfleet.weightsync._layout import Layout
from rlfleet.weightsync._wire import DEFAULT_DIRECT_MIN_BYTES, ProtocolReceiver, ProtocolSender

__all__ = ["BroadcastReceiver", "BroadcastSender", "TorchWire", "map_dist_error"]

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
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _TorchPending:
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


class TorchWire:
    """A torch.distributed group as a protocol `Wire`; `src_rank` is a global rank, like torch's."""

    def __init__(self, group: Any, src_rank: int, device: str | torch.device | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (see init_process_group_bounded)")
        chosen = group if group is not None else dist.group.WORLD
        if not isinstance(chosen, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup, got {type(chosen).__name__}")
        self.group: dist.ProcessGroup = chosen
        dev = torch.device(device) if device is not None else default_device(self.group)
        if dev.type == "cuda" and dev.index is None:  # "cuda" means the current device, by index
            dev = torch.device("cuda", torch.cuda.current_device())
        self._device = dev
        self._rank = dist.get_rank(self.group)
        if self._rank < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of this process group")
        self._size = dist.get_world_size(self.group)
        self.src_global = int(src_rank)
        try:
            self._src = dist.get_group_rank(self.group, self.src_global)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"source rank {src_rank} is not a member of this process group") from exc

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def src(self) -> int:
        return self._src

    def broadcast(self, tensor: torch.Tensor) -> _TorchPending:
        try:
            work = dist.broadcast(tensor, src=self.src_global, group=self.group, async_op=True)
        except Exception as exc:
            raise map_dist_error(exc, "broadcast") from exc
        return _TorchPending(work, "broadcast")

    def all_reduce_sum(self, tensor: torch.Tensor) -> _TorchPending:
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except Exception as exc:
            raise map_dist_error(exc, "all_reduce") from exc
        return _TorchPending(work, "all_reduce")


class BroadcastSender(ProtocolSender):
    """Sends versions of a state dict to every other member of `group`.

    ``send(state_dict, version, deadline)`` returns `SyncStats` once every receiver committed;
    it raises (and no receiver applies anything) if a receiver rejects the layout or version,
    fails a bucket, or if the state dict does not fit `layout`. Extra memory: at most two
    bucket buffers (large tensors travel straight from their own storage).
    """

    def __init__(
        self,
        layout: Layout,
        group: Any,
        src_rank: int,
        device: str | torch.device | None = None,
        checksums: bool = False,
        direct_min: int = DEFAULT_DIRECT_MIN_BYTES,
    ) -> None:
        super().__init__(layout, TorchWire(group, src_rank, device), checksums, direct_min)


class BroadcastReceiver(ProtocolReceiver):
    """Receives versions from `src_rank` into a `BucketConsumer` (``receive(consumer, deadline)``)."""

    def __init__(
        self, layout: Layout, group: Any, src_rank: int, device: str | torch.device | None = None
    ) -> None:
        super().__init__(layout, TorchWire(group, src_rank, device))
