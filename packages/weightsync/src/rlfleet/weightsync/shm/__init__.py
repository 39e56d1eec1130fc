"""Shared memory on one node: segments with creator-checked names, the control block, the
`ShmRing` transport and the node buffer (`SharedBuffer`, two slots every local reader maps).
"""

from rlfleet.weightsync.shm._ring_format import DEFAULT_RING_TIMEOUT_S
from rlfleet.weightsync.shm._shared_buffer import SharedBuffer, SharedBufferReader
from rlfleet.weightsync.shm._shm import (
    SharedSegment,
    cleanup_stale_segments,
    process_alive,
    process_identity,
)
from rlfleet.weightsync.shm._shm_ring import ShmRingReceiver, ShmRingSender
from rlfleet.weightsync.shm._termination import install_termination_cleanup, register_termination_cleanup

__all__ = [
    "DEFAULT_RING_TIMEOUT_S",
    "SharedBuffer",
    "SharedBufferReader",
    "SharedSegment",
    "ShmRingReceiver",
    "ShmRingSender",
    "cleanup_stale_segments",
    "install_termination_cleanup",
    "process_alive",
    "process_identity",
    "register_termination_cleanup",
]
