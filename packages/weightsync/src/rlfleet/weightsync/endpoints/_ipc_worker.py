"""A worker's CUDA IPC channels across versions: the one it writes, the one it reads.

A sync plan's "cuda_ipc" step has one writer (holding every bucket) and its same-node readers.
`IpcChannelWriter` owns the writer's `CudaIpcSender`: made at the first `channel` call for a
set of readers, reused for every version while the readers, the layout and the backend stay
the same, replaced when they change, and closed after a failed send, so that its readers fail
at once (the channel is closed) instead of waiting for a version that will not come. A channel
closed while a late reader still maps its slots keeps them only until that reader left (every
call of the writer frees what no reader maps any more; `held_slots` counts them).
`IpcChannelReader` holds the reader's `CudaIpcReceiver`, attached at its first receive from a
channel and kept while the channel is; it receives into the worker's endpoint (two-phase
commit: a version lands on every reader or on none) and leaves the channel after any failure,
as its writer does. Neither knows about Ray: policygroup's step calls are thin wrappers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import SlotsStillMappedError, WeightSyncError
from rlfleet.weightsync.cuda._ipc_receiver import CudaIpcReceiver
from rlfleet.weightsync.cuda._ipc_sender import DETACH_WAIT_S, Backend, CudaIpcSender
from rlfleet.weightsync.endpoints._endpoints import WeightEndpoint
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._stream import Weights

__all__ = ["IpcChannelReader", "IpcChannelWriter", "cuda_device_of"]

_log = logging.getLogger(__name__)
IPC_BACKENDS: tuple[str, ...] = ("cuda", "host")


def cuda_device_of(module: torch.nn.Module) -> torch.device | None:
    """The CUDA device the module's weights live on (None: on the host)."""
    for tensor in module.state_dict().values():
        if tensor.is_cuda:
            device: torch.device = tensor.device
            return device
    return None


class IpcChannelWriter:
    """The IPC channel one worker writes (see the module docstring)."""

    def __init__(self, detach_timeout_s: float = DETACH_WAIT_S) -> None:
        self.detach_timeout_s = detach_timeout_s
        self._sender: CudaIpcSender | None = None
        self._key: tuple[object, ...] | None = None
        self._readers: tuple[str, ...] = ()  # the open channel's readers, by index
        self._retired: list[CudaIpcSender] = []  # closed while a reader still mapped their slots
        self._lock = threading.Lock()

    @property
    def name(self) -> str | None:
        """The open channel's name (None: none is open)."""
        sender = self._sender
        return None if sender is None else sender.name

    @property
    def held_slots(self) -> int:
        """Slot buffers this writer holds: the open channel's, and those of closed channels that a
        live reader still maps (each freed as soon as no reader does: looked at on every call)."""
        with self._lock:
            self._free_retired_locked()
            held = sum(sender.held_slots for sender in self._retired)
            return held + (0 if self._sender is None else self._sender.held_slots)

    def channel(
        self,
        readers: Sequence[str],
        layout: Layout,
        backend: str,
        device: torch.device | None = None,
        checksums: bool = False,
        delta: str = "off",
    ) -> str:
        """The channel to `readers` (ids, in reader-index order): the open one when it was made for
        them with this layout, backend, device, checksums and delta mode, else a new one (the old
        one closed first). `device`: where the slots live ("cuda"; None: the current device);
        ``delta="auto"``: versions go as deltas when every reader holds the last one."""
        if backend not in IPC_BACKENDS:
            raise ValueError(f"IPC backend must be one of {list(IPC_BACKENDS)}, got {backend!r}")
        if not readers:
            raise ValueError("an IPC channel needs at least one reader")
        key = (tuple(readers), layout.digest, layout.bucket_bytes, backend, device, checksums, delta)
        with self._lock:
            self._free_retired_locked()
            if self._sender is not None and self._key == key:
                return self._sender.name
            self._close_locked()
            cuda: Backend = "cuda" if backend == "cuda" else "host"
            self._sender = CudaIpcSender(
                layout,
                len(readers),
                device=device,
                checksums=checksums,
                backend=cuda,
                detach_timeout_s=self.detach_timeout_s,
                delta=delta,
            )
            self._key, self._readers = key, tuple(str(r) for r in readers)
            return self._sender.name

    def send(self, name: str, weights: Weights, version: int, deadline: Deadline) -> int:
        """Send `version` through channel `name` (it must be the open one); bytes moved. On any
        failure the channel is closed: its readers stop waiting, the next version gets a new one."""
        with self._lock:
            self._free_retired_locked()
            sender = self._sender
        if sender is None or sender.name != name:
            raise WeightSyncError(
                f"IPC channel {name!r} is not open on this writer (open: {self.name!r}); "
                "it was replaced or closed before this version was sent"
            )
        try:
            return sender.send(weights, version, deadline)
        except BaseException:
            with self._lock:
                if self._sender is sender:
                    self._close_locked()
            raise

    def last_wire(self, name: str, version: int) -> dict[str, Any] | None:
        """What sending `version` through channel `name` put in its slots, when the channel
        encodes deltas (``delta="auto"``) and that was its last version: ``bytes``, ``full_bytes``,
        ``base`` (None: full) and ``lacking`` (the ids of the readers without the base offered);
        None otherwise."""
        with self._lock:
            sender, readers = self._sender, self._readers
        if sender is None or sender.name != name or sender.delta is None:
            return None
        last = sender.delta.last
        if last.version != version:
            return None
        return {
            "bytes": int(last.sent_bytes),
            "full_bytes": int(last.full_bytes),
            "base": last.base,
            "lacking": [str(readers[i]) for i in sender.last_full_readers],
        }

    def close(self) -> None:
        """Close the open channel (its readers see it closed); free every slot no reader maps."""
        with self._lock:
            self._close_locked()
            self._free_retired_locked()

    def _close_locked(self) -> None:
        sender, self._sender, self._key = self._sender, None, None
        if sender is None:
            return
        try:
            sender.close()
        except SlotsStillMappedError as exc:  # kept, not freed under a reader: freed once it left
            _log.warning("%s", exc)
            self._retired.append(sender)

    def _free_retired_locked(self) -> None:
        self._retired = [sender for sender in self._retired if not sender.free_slots()]


class IpcChannelReader:
    """The IPC channel one worker reads (see the module docstring)."""

    def __init__(self) -> None:
        self._receiver: CudaIpcReceiver | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str | None:
        receiver = self._receiver
        return None if receiver is None else receiver.name

    def receive(
        self,
        endpoint: WeightEndpoint,
        name: str,
        index: int,
        version: int,
        deadline: Deadline,
        device: torch.device | None = None,
    ) -> int:
        """Take `version` from channel `name` as reader `index` into `endpoint` (staged, or applied
        for "None"); attaches first when this is a new channel. Any failure leaves the channel."""
        with self._lock:
            receiver = self._attach(name, index, device)
            try:
                return int(endpoint.receive(receiver, version, deadline))
            except BaseException:
                self._close_locked()
                raise

    def _attach(self, name: str, index: int, device: torch.device | None) -> CudaIpcReceiver:
        receiver = self._receiver
        if receiver is not None and receiver.name == name and receiver.index == index:
            return receiver
        self._close_locked()
        self._receiver = CudaIpcReceiver.attach(name, index, device)
        return self._receiver

    def close(self) -> None:
        """Unmap the channel's slots and leave it (its writer may then free them)."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()
