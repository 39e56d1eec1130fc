"""CUDA IPC transport (same node, GPU): two ping-pong GPU bucket slots, opened once by readers.

The sender allocates two GPU bucket buffers with CuPy (plain ``cudaMalloc``, so an IPC handle
covers exactly one buffer), exports their IPC handles once (``ipcGetMemHandle``), and readers
open them once (``ipcOpenMemHandle``); torch sees both ends through DLPack, without copies
(`_ipc_slots`). Per bucket the sender packs into slot ``k % 2`` (once every reader acknowledged
that slot's previous bucket), synchronizes its stream and publishes the slot's sequence number;
a reader hands the slot to its `BucketConsumer`, synchronizes, and acknowledges. Packing bucket
k+1 overlaps the readers consuming bucket k. With ``delta="auto"`` a slot carries its bucket's
delta when every reader holds the sender's base (encoded on a host copy; see `CudaIpcSender`).

The control plane is a small shared-memory segment (`_ipc_control`): a control block of shape
`IPC`, described like ShmRing's and SharedBuffer's (`_control_block`), then the handles (base64
in JSON) and the sender's layout. Its words hold per-slot sequence numbers and sessions,
per-reader liveness and acks, and a two-phase commit: each reader, once its consumer took every
bucket and prepared its commit (`prepare_commit`: what the commit needs, acquired before the
vote), reports *prepared*, or *failed*; the sender then writes *commit* only if every reader
prepared, else *abort*, so a version lands on all readers or on none. Waits poll under a
`Deadline` and check the peer's liveness (pid + start time): a dead peer is a `PeerLostError`,
a stuck one a `SyncTimeoutError`.

Sessions. Each `send` is a session, numbered in the control block (its generation). A reader
marks the session whose slots it may still read; a new session rewrites no slot until every
live reader of an earlier one (a straggler of an aborted version) has finished its reads, or
fails at its deadline naming them. The sender frees its slots only when no live reader maps
them: otherwise `close` raises `SlotsStillMappedError` and keeps them until the last of those
readers unmapped them or died (`free_slots`), never for the life of the process.

Stream contract (CUDA slots):
- Sender: `send` packs each bucket into its slot with torch copies on the *current stream* of
  the slot device and synchronizes that stream before publishing the bucket. The state dict
  must be ready there: writes queued on other streams must be ordered before the current
  stream (or synchronized) by the caller.
- Reader: `consume(k, data)` must read `data` on the *current stream* of the reader's device
  (what torch ops do by default) or finish its reads before returning; the receiver
  synchronizes that stream before acknowledging the slot, and never hands out a slot again
  after that. A consumer must not keep `data` (a view of the sender's slot) beyond `consume`.
- Failures: before releasing slots after a failure, and before unmapping them in `close`, the
  reader synchronizes the whole device (every stream), since it cannot know where a failed
  consumer queued reads. The sender synchronizes its device before freeing its slots.

``backend="host"`` swaps the GPU slots for a shared-memory segment with the same control
plane; it exists so the whole state machine runs, across real processes, on machines without
a GPU (the tests), and is not a CPU transport of its own (that is `ShmRingSender`).
"""

from __future__ import annotations

from rlfleet.weightsync.cuda._ipc_control import IPC, ChannelBlock
from rlfleet.weightsync.cuda._ipc_control import decode_meta as _decode_meta
from rlfleet.weightsync.cuda._ipc_receiver import CudaIpcReceiver
from rlfleet.weightsync.cuda._ipc_sender import DETACH_WAIT_S, CudaIpcSender
from rlfleet.weightsync.shm._control_block import ControlBlock

# ControlBlock: the control-block accessors every shared-memory channel shares (kept exported here
# for the package's public name); ChannelBlock: an IPC channel's, a ControlBlock of shape IPC.
__all__ = [
    "DETACH_WAIT_S",
    "IPC",
    "ChannelBlock",
    "ControlBlock",
    "CudaIpcReceiver",
    "CudaIpcSender",
    "_decode_meta",
]
