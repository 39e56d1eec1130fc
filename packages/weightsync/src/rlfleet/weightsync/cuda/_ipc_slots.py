"""The two bucket slots of a CUDA IPC channel: GPU memory shared by IPC handle, or host stand-ins.

The sender's `CudaSlots` are two ``cudaMalloc`` buffers (CuPy's ``cuda.Memory``, so one IPC
handle covers exactly one buffer), exported once with ``ipcGetMemHandle``; a reader's
`CudaOpened` maps them once with ``ipcOpenMemHandle``. torch sees both through DLPack, without
copies. `HostSlots` / `HostOpened` put the same two slots in one shared-memory segment, so the
whole channel runs on machines without a GPU (the tests).

Streams and lifetimes (CUDA):
- `sync` waits for the current torch stream of the slot device: the sender packs a slot there,
  and a reader's consumer reads a slot there (see `_cuda_ipc`).
- `settle` waits for the whole device (every stream): on a failure the reader cannot know on
  which streams its consumer queued reads of a slot, so it settles before releasing the slot.
- `close` on a reader settles the device, then unmaps (``ipcCloseMemHandle``) on the device it
  opened on: an unmap under a queued read is undefined. The sender frees its slots only once no
  live reader maps them (it keeps them until then: `CudaIpcSender.free_slots`).
"""

from __future__ import annotations

import base64
import contextlib
import logging
from collections.abc import Callable

import torch
from torch.utils.dlpack import from_dlpack

from rlfleet.weightsync._errors import MetadataError
from rlfleet.weightsync.cuda._cupy import import_cupy
from rlfleet.weightsync.cuda._ipc_control import NUM_SLOTS
from rlfleet.weightsync.layout._lent import lend
from rlfleet.weightsync.shm._shm import SharedSegment, memory_fence, page_align

__all__ = ["CudaOpened", "CudaSlots", "HostOpened", "HostSlots"]

_log = logging.getLogger(__name__)


def _settle_device(device: torch.device) -> None:
    """Wait for every stream of `device`; a broken context (sticky error) has nothing in flight."""
    try:
        torch.cuda.synchronize(device)
    except Exception:  # a sticky CUDA error: no kernel of this context runs any more
        _log.exception("IPC slots: synchronizing %s failed; continuing", device)


class CudaSlots:
    """Two cudaMalloc'ed buffers (CuPy) viewed as torch tensors; handles exported once."""

    kind = "cuda"

    def __init__(self, nbytes: int, device: torch.device) -> None:
        cp = import_cupy()
        self.device = device
        self.nbytes = nbytes
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device_index = index
        self.device = torch.device("cuda", index)
        with cp.cuda.Device(index):
            self._mems = [cp.cuda.Memory(nbytes) for _ in range(NUM_SLOTS)]
            arrays = [
                cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(m, 0)) for m in self._mems
            ]
            self.tensors = [from_dlpack(a) for a in arrays]
            # ipcGetMemHandle returns the 64 bytes of cudaIpcMemHandle_t
            self.handles = [
                base64.b64encode(bytes(cp.cuda.runtime.ipcGetMemHandle(m.ptr))).decode() for m in self._mems
            ]

    def sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def settle(self) -> None:
        _settle_device(self.device)

    def close(self) -> None:
        """Free the slots (only once no reader maps them: see `CudaIpcSender.close`)."""
        self.settle()  # no kernel of ours still writes them
        self.tensors = []
        self._mems = []


class CudaOpened:
    """A reader's view of the sender's slots: IPC handles opened once, closed on `close`."""

    kind = "cuda"

    def __init__(self, handles: list[str], nbytes: int, device: torch.device) -> None:
        cp = import_cupy()
        self._cp = cp
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._index = index
        self.device = torch.device("cuda", index)
        self._ptrs: list[int] = []
        self._lent: list[Callable[[], None]] = []
        self.tensors: list[torch.Tensor] = []
        with cp.cuda.Device(index):
            try:
                for handle in handles:
                    ptr = cp.cuda.runtime.ipcOpenMemHandle(base64.b64decode(handle))
                    self._ptrs.append(ptr)
                    self._lent.append(lend(ptr, nbytes, "a CUDA IPC slot of another process", "cuda"))
                    mem = cp.cuda.UnownedMemory(ptr, nbytes, None, index)
                    arr = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
                    self.tensors.append(from_dlpack(arr))
            except BaseException:
                self.close()
                raise

    def sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def settle(self) -> None:
        _settle_device(self.device)

    def close(self) -> None:
        self.tensors = []
        for release in self._lent:
            release()
        self._lent = []
        ptrs, self._ptrs = self._ptrs, []  # each mapping is closed once, even if a close fails
        if not ptrs:
            return
        self.settle()  # no queued read of a slot outlives its mapping
        with contextlib.suppress(Exception), self._cp.cuda.Device(self._index):  # the opening device
            for ptr in ptrs:
                with contextlib.suppress(Exception):  # the context may be tearing down already
                    self._cp.cuda.runtime.ipcCloseMemHandle(ptr)


class _HostFenced:
    """Host slots: a store is visible to the peer process once fenced; no stream to wait for."""

    kind = "host"
    #: Where the slots' bytes live (a delta is rebuilt on this device).
    device = torch.device("cpu")

    def sync(self) -> None:
        memory_fence()

    def settle(self) -> None:
        memory_fence()


class HostSlots(_HostFenced):
    """CPU stand-in for the GPU slots: one shared-memory segment; its name is the "handle"."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = page_align(nbytes)
        self._segment = SharedSegment.create(self.nbytes * NUM_SLOTS, prefix="rlfleet-ipcslots")
        self.tensors = [self._segment.tensor(j * self.nbytes, self.nbytes) for j in range(NUM_SLOTS)]
        self.handles = [self._segment.name]

    def close(self) -> None:
        self.tensors = []
        self._segment.close()
        self._segment.unlink()


class HostOpened(_HostFenced):
    """A reader's read-only mapping of `HostSlots`."""

    def __init__(self, handles: list[str], nbytes: int) -> None:
        if len(handles) != 1:
            raise MetadataError(f"host slots carry one segment name, got {len(handles)}")
        self.name = handles[0]
        self._segment = SharedSegment.attach(handles[0], readonly=True)
        stride = page_align(nbytes)
        self.tensors = [self._segment.tensor(j * stride, nbytes) for j in range(NUM_SLOTS)]

    def close(self) -> None:
        self.tensors = []
        self._segment.close()
