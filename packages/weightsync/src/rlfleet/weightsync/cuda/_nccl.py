"""NCCL through CuPy (cross-node GPU), speaking the same protocol as `_dist.py`.

A `NcclWire` is a `cupy.cuda.nccl.NcclCommunicator` built from a unique id that the source
rank publishes in a `torch.distributed` store with a fresh generation of the group's name, and
whose init is bounded by the caller's deadline (`_nccl_init`). Header, negotiation, control
words, double-buffered buckets and the two-phase commit are `_wire.py`, shared with the
torch.distributed transport.

Stream contract. Every collective runs on the wire's own side stream, after the work already
queued on the caller's current stream of the wire's device (``wait_stream``): a tensor written
there (packing bucket k+1, or the caller's own writes) is complete before NCCL reads it, and
packing bucket k+1 overlaps bucket k on the wire. Work the caller queued on *other* streams is
not waited for: synchronize it with the current stream first. Each collective records an event;
a wait polls it against the sync's deadline (at the deadline the communicator is aborted, since
a stuck NCCL kernel never returns, and the wait raises SyncTimeoutError), then makes the
caller's current stream wait on it, so received bytes are ordered before later work on that
stream only; a consumer reading them on another stream synchronizes itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlfleet.weightsync._deadline import Backoff, Deadline
from rlfleet.weightsync._errors import PeerLostError, SyncTimeoutError
from rlfleet.weightsync.cuda._cupy import import_cupy, import_nccl
from rlfleet.weightsync.cuda._nccl_init import decode_unique_id, encode_unique_id, join_communicator
from rlfleet.weightsync.dist._dist import WireBase
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._wire import DEFAULT_DIRECT_MIN_BYTES, ProtocolReceiver, ProtocolSender

__all__ = ["NcclReceiver", "NcclSender", "NcclWire", "decode_unique_id", "encode_unique_id"]


def _cuda_device(device: str | torch.device | int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("the NCCL transport needs a CUDA device, and torch sees none")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"the NCCL transport needs a cuda device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


class NcclPending:
    __slots__ = ("_event", "_keep", "_wire")

    def __init__(self, wire: NcclWire, event: torch.cuda.Event, keep: torch.Tensor) -> None:
        self._wire = wire
        self._event = event
        self._keep = keep  # the tensor must outlive the collective

    def wait(self, deadline: Deadline, what: str) -> None:
        backoff = Backoff(initial=10e-6, maximum=1e-3)
        while not self._event.query():  # type: ignore[no-untyped-call]
            if deadline.expired:
                self._wire.abort()
                raise SyncTimeoutError(
                    f"{what} on NCCL did not finish within the deadline "
                    f"({deadline.seconds}s); the communicator was aborted"
                )
            error = self._wire.async_error()
            if error is not None:
                raise PeerLostError(f"{what}: NCCL reported an asynchronous error ({error})")
            backoff.sleep(deadline.remaining())
        torch.cuda.current_stream(self._wire.device).wait_event(self._event)


class NcclWire(WireBase):
    """One NCCL communicator as a protocol `Wire` (ranks are communicator ranks)."""

    def __init__(self, comm: Any, rank: int, size: int, src: int, device: torch.device) -> None:
        self._nccl = import_nccl()
        super().__init__(device, rank, size, src)
        self.comm = comm
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.aborted = False

    @classmethod
    def create(
        cls,
        store: Any,
        rank: int,
        world_size: int,
        src: int = 0,
        device: str | torch.device | int | None = None,
        deadline: Deadline | float | None = 120.0,
        name: str = "weights",
    ) -> NcclWire:
        """Rendezvous through `store` (a torch.distributed Store) and build the communicator.

        Every rank joins a fresh generation of group `name` (a missing rank is named within the
        deadline), rank `src` publishes a fresh unique id with it, and every rank builds the
        communicator, bounded by the same deadline (`_nccl_init`). Rebuilding on the same store
        and name is safe: it never reads an earlier generation's id.
        """
        nccl = import_nccl()
        deadline = Deadline.coerce(deadline)
        dev = _cuda_device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()

        def bind() -> None:  # on the init thread: NCCL binds the communicator to its current device
            torch.cuda.set_device(index)
            import_cupy().cuda.runtime.setDevice(index)

        comm = join_communicator(nccl, store, name, rank, world_size, src, deadline, bind)
        return cls(comm, rank, world_size, src, dev)

    def enqueue(self, tensor: torch.Tensor, collective: Callable[[int], None]) -> NcclPending:
        """Run ``collective(cuda_stream)`` on the wire's side stream, after the work queued on the
        caller's current stream; returns its pending wait (see the module's stream contract).

        `tensor` (what the collective reads or writes) must be contiguous on the wire's device;
        it is kept alive until the collective finished. A wire aborted earlier refuses.
        """
        if self.aborted:
            raise PeerLostError("the NCCL communicator was aborted after an earlier failure")
        if tensor.device != self._device or not tensor.is_contiguous():
            raise ValueError(f"NCCL tensors must be contiguous on {self._device}, got {tensor.device}")
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            collective(stream.cuda_stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        tensor.record_stream(stream)
        return NcclPending(self, event, tensor)

    def broadcast(self, tensor: torch.Tensor) -> NcclPending:
        data = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
        nccl, ptr, count, src = self._nccl, data.data_ptr(), data.numel(), self._src
        return self.enqueue(data, lambda stream: self.comm.bcast(ptr, count, nccl.NCCL_UINT8, src, stream))

    def all_reduce_sum(self, tensor: torch.Tensor) -> NcclPending:
        if tensor.dtype != torch.int64:
            raise ValueError(f"all_reduce_sum takes int64 tensors, got {tensor.dtype}")
        nccl, ptr, count = self._nccl, tensor.data_ptr(), tensor.numel()
        return self.enqueue(
            tensor,
            lambda stream: self.comm.allReduce(ptr, ptr, count, nccl.NCCL_INT64, nccl.NCCL_SUM, stream),
        )

    def async_error(self) -> str | None:
        try:
            self.comm.check_async_error()
        except Exception as exc:
            return str(exc)
        return None

    def abort(self) -> None:
        """Abort the communicator (unblocks a stuck kernel); the wire is unusable afterwards."""
        if not self.aborted:
            self.aborted = True
            with contextlib.suppress(Exception):  # already destroyed or failed: nothing to unblock
                self.comm.abort()

    def close(self) -> None:
        if not self.aborted:
            self.comm.destroy()
            self.aborted = True


class NcclSender(ProtocolSender):
    """`BroadcastSender` over a `NcclWire` (GPU state dict; large tensors sent in place)."""

    def __init__(
        self,
        layout: Layout,
        wire: NcclWire,
        checksums: bool = False,
        direct_min: int = DEFAULT_DIRECT_MIN_BYTES,
    ) -> None:
        super().__init__(layout, wire, checksums, direct_min)


class NcclReceiver(ProtocolReceiver):
    """`BroadcastReceiver` over a `NcclWire`."""

    def __init__(self, layout: Layout, wire: NcclWire) -> None:
        super().__init__(layout, wire)


def nccl_ranks(members: Sequence[int], me: int) -> int:
    """This process's communicator rank among `members` (global ranks, in order)."""
    try:
        return list(members).index(me)
    except ValueError:
        raise ValueError(f"rank {me} is not among the NCCL group members {list(members)}") from None
