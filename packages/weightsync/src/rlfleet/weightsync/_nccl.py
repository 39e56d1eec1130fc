"""NCCL through CuPy (cross-node GPU), speaking the same protocol as `_dist.py`.

A `NcclWire` is a `cupy.cuda.nccl.NcclCommunicator` built from a unique id that rank 0 puts in
a `torch.distributed.TCPStore` (after a bounded check-in that names missing ranks, see
`_rendezvous.py`). Collectives run on a side stream, ordered after the work already queued on
the caller's stream (so packing bucket k+1 on the caller's stream overlaps bucket k on the
wire), and each one records an event. Waits poll that event against the sync's deadline; at the
deadline the communicator is aborted (a stuck NCCL kernel otherwise never returns) and the wait
raises SyncTimeoutError. Header, negotiation, control words, double-buffered buckets and the
two-phase commit are `_wire.py`, shared with the torch.distributed transport.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from rlfleet.weightsync._cupy import import_nccl
from rlfleet.weightsync._deadline import Backoff, Deadline
from rlfleet.weightsync._dist import _WireBase
from rlfleet.weightsync._errors import MetadataError, PeerLostError, SyncTimeoutError
from rlfleet.weightsync._json import decode_json
from rlfleet.weightsync._layout import Layout
from rlfleet.weightsync._rendezvous import RendezvousTimeoutError, check_in
from rlfleet.weightsync._wire import DEFAULT_DIRECT_MIN_BYTES, ProtocolReceiver, ProtocolSender

__all__ = ["NcclReceiver", "NcclSender", "NcclWire", "decode_unique_id", "encode_unique_id"]


def encode_unique_id(uid: Any) -> str:
    """A NCCL unique id as JSON text.

    CuPy's ``nccl.get_unique_id()`` returns a tuple of 128 C ``char`` values (signed on x86-64,
    unsigned on aarch64); raw bytes are accepted too. Either form decodes back unchanged.
    """
    if isinstance(uid, (bytes, bytearray)):
        return json.dumps({"b64": base64.b64encode(bytes(uid)).decode()})
    return json.dumps({"ints": [int(x) for x in uid]})


def decode_unique_id(text: str | bytes) -> bytes | tuple[int, ...]:
    """Inverse of `encode_unique_id`; malformed input raises MetadataError."""
    data = decode_json(text, "NCCL unique id")
    if isinstance(data, dict) and isinstance(data.get("b64"), str):
        try:
            raw = base64.b64decode(data["b64"], validate=True)
        except ValueError as exc:  # binascii.Error
            raise MetadataError(f"NCCL unique id is not valid base64: {exc}") from None
        if len(raw) != 128:
            raise MetadataError(f"NCCL unique id must be 128 bytes, got {len(raw)}")
        return raw
    ints = data.get("ints") if isinstance(data, dict) else None
    if (
        isinstance(ints, list)
        and len(ints) == 128
        and all(isinstance(x, int) and -128 <= x < 256 for x in ints)
    ):
        return tuple(ints)
    raise MetadataError("NCCL unique id must be {'b64': ...} or {'ints': [128 ints]}")


def _cuda_device(device: str | torch.device | int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("the NCCL transport needs a CUDA device, and torch sees none")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"the NCCL transport needs a cuda device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _communicator(nccl: Any, world_size: int, uid: bytes | tuple[int, ...], rank: int) -> Any:
    """``NcclCommunicator(ndev, commId, rank)``: CuPy types `commId` as a tuple of 128 C chars.

    Bytes are refused there (TypeError), and each item must fit this platform's ``char``: signed
    on x86-64, unsigned on aarch64. The id is tried signed, then unsigned; a value that does not
    fit raises OverflowError while CuPy copies the id, before ``ncclCommInitRank`` runs.
    """
    raw = bytes(x & 0xFF for x in uid)
    try:
        return nccl.NcclCommunicator(world_size, tuple(b - 256 if b >= 128 else b for b in raw), rank)
    except OverflowError:
        return nccl.NcclCommunicator(world_size, tuple(raw), rank)


class _NcclPending:
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


class NcclWire(_WireBase):
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

        Every rank checks in first (a missing rank is named within the deadline), then rank
        `src` publishes a fresh unique id and every rank joins the communicator.
        """
        nccl = import_nccl()
        deadline = Deadline.coerce(deadline)
        dev = _cuda_device(device)
        prefix = f"rlfleet/nccl/{name}"
        check_in(store, f"{prefix}/join", rank, range(world_size), deadline, f"NCCL group {name!r}")
        key = f"{prefix}/uid"
        if rank == src:
            store.set(key, encode_unique_id(nccl.get_unique_id()))
        backoff = Backoff(initial=1e-3, maximum=50e-3)
        while not store.check([key]):
            if deadline.expired:
                raise RendezvousTimeoutError(
                    f"NCCL group {name!r}: rank {src} never published the unique id", [src]
                )
            backoff.sleep(deadline.remaining())
        uid = decode_unique_id(store.get(key))
        with torch.cuda.device(dev):  # the communicator binds to the current device
            comm = _communicator(nccl, world_size, uid, rank)
        return cls(comm, rank, world_size, src, dev)

    def _launch(self, tensor: torch.Tensor, op: str) -> _NcclPending:
        if self.aborted:
            raise PeerLostError("the NCCL communicator was aborted after an earlier failure")
        if tensor.device != self._device or not tensor.is_contiguous():
            raise ValueError(f"NCCL tensors must be contiguous on {self._device}, got {tensor.device}")
        nccl = self._nccl
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            if op == "bcast":
                self.comm.bcast(
                    tensor.data_ptr(), tensor.numel(), nccl.NCCL_UINT8, self._src, stream.cuda_stream
                )
            else:
                self.comm.allReduce(
                    tensor.data_ptr(),
                    tensor.data_ptr(),
                    tensor.numel(),
                    nccl.NCCL_INT64,
                    nccl.NCCL_SUM,
                    stream.cuda_stream,
                )
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        tensor.record_stream(stream)
        return _NcclPending(self, event, tensor)

    def broadcast(self, tensor: torch.Tensor) -> _NcclPending:
        if tensor.dtype != torch.uint8:
            tensor = tensor.view(torch.uint8)
        return self._launch(tensor, "bcast")

    def all_reduce_sum(self, tensor: torch.Tensor) -> _NcclPending:
        if tensor.dtype != torch.int64:
            raise ValueError(f"all_reduce_sum takes int64 tensors, got {tensor.dtype}")
        return self._launch(tensor, "allreduce")

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
