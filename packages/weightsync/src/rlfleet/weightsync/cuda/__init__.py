"""GPU transports through CuPy (imported lazily, behind the `[cuda12]`/`[cuda13]` extras):
CUDA IPC between processes of one node and NCCL across nodes.
"""

from rlfleet.weightsync.cuda._cuda_ipc import ControlBlock, CudaIpcReceiver, CudaIpcSender
from rlfleet.weightsync.cuda._nccl import NcclReceiver, NcclSender, NcclWire

__all__ = [
    "ControlBlock",
    "CudaIpcReceiver",
    "CudaIpcSender",
    "NcclReceiver",
    "NcclSender",
    "NcclWire",
]
