"""rlfleet.weightsync: bucketed, versioned, atomic weight sync from trainers to rollout workers.

The public names, by family (the README has one section per family):

- layout and packing: `Layout` and its buckets, dtypes, packing helpers, `adopt`;
- consumers: the `BucketConsumer` protocol every transport drives, its landing extensions,
  `Assembly` (one version from several senders) and `RecordingConsumer` (a test double);
- weight buffers: the receive strategies "None" (`DirectBuffer`), "Double" (`DoubleBuffer`),
  "Sharded" (`ShardedBuffer`) and their `ServingLock`;
- shared memory: the node buffer ("Shared": `SharedBuffer`) and the `ShmRing` transport;
- broadcast: torch.distributed senders and receivers, member groups, bounded rendezvous;
- CUDA IPC and NCCL (CuPy, imported lazily);
- reshard: shard-to-shard moves between training and generation layouts;
- deadlines and watchdogs; integrity checks; offload; errors.
"""

from rlfleet.weightsync.__about__ import __version__

# -- consumers
from rlfleet.weightsync._assembly import Assembly, AssemblyPart

# -- layout and packing
from rlfleet.weightsync._block import adopt, flat_block

# -- weight buffers
from rlfleet.weightsync._buffers import BufferBase, DirectBuffer, DoubleBuffer, live_tensors
from rlfleet.weightsync._copy import copy_tensors, default_copy_threads

# -- CUDA IPC and NCCL
from rlfleet.weightsync._cuda_ipc import ControlBlock, CudaIpcReceiver, CudaIpcSender

# -- deadlines and watchdogs
from rlfleet.weightsync._deadline import (
    DEFAULT_SERVING_TIMEOUT_S,
    DEFAULT_SYNC_TIMEOUT_S,
    Deadline,
    Watchdog,
    armed_watchdogs,
    stand_down_armed_watchdogs,
)

# -- broadcast over torch.distributed
from rlfleet.weightsync._dist import BroadcastReceiver, BroadcastSender
from rlfleet.weightsync._dtypes import DTYPES, dtype_from_name, dtype_name

# -- errors
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    IncompleteSyncError,
    LayoutMismatchError,
    MetadataError,
    PeerLostError,
    RendezvousTimeoutError,
    SyncAbortedError,
    SyncTimeoutError,
    VersionError,
    WeightSyncError,
)

# -- integrity
from rlfleet.weightsync._integrity import bucket_checksum, checksum, compare_fingerprints, fingerprint
from rlfleet.weightsync._layout import ALIGNMENT, DEFAULT_BUCKET_BYTES, BucketSpec, Layout, TensorSpec
from rlfleet.weightsync._member import MemberGroup
from rlfleet.weightsync._nccl import NcclReceiver, NcclSender, NcclWire

# -- offload
from rlfleet.weightsync._offload import (
    OffloadStats,
    is_offloaded,
    offload_module,
    offload_optimizer,
    reload_module,
    reload_optimizer,
)
from rlfleet.weightsync._packing import (
    bucket_starts,
    bucket_views,
    flat_views,
    pack_all,
    pack_bucket,
    typed_view,
    unpack_bucket_into,
)
from rlfleet.weightsync._protocol import BucketConsumer
from rlfleet.weightsync._recording import RecordingConsumer
from rlfleet.weightsync._rendezvous import (
    check_in,
    connect_store,
    host_store,
    init_process_group_bounded,
    new_group_bounded,
    reset_group_numbering,
)

# -- reshard
from rlfleet.weightsync._reshard import (
    DEFAULT_RESHARD_BUCKET_BYTES,
    DEFAULT_RESHARD_DIRECT_MIN,
    NcclP2PWire,
    P2PWire,
    PeerGroup,
    RankProgram,
    ReshardReceiver,
    ReshardSender,
    ReshardStats,
    TorchP2PWire,
    Transfer,
)
from rlfleet.weightsync._serving import ServingLock
from rlfleet.weightsync._sharded import ShardedBuffer, balanced_ranges

# -- shared memory
from rlfleet.weightsync._shared_buffer import SharedBuffer, SharedBufferReader
from rlfleet.weightsync._shm import SharedSegment, cleanup_stale_segments, process_alive
from rlfleet.weightsync._shm_ring import ShmRingReceiver, ShmRingSender
from rlfleet.weightsync._wire_base import BucketTarget, SyncStats, TensorTarget

__all__ = [
    "ALIGNMENT",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_RESHARD_BUCKET_BYTES",
    "DEFAULT_RESHARD_DIRECT_MIN",
    "DEFAULT_SERVING_TIMEOUT_S",
    "DEFAULT_SYNC_TIMEOUT_S",
    "DTYPES",
    "Assembly",
    "AssemblyPart",
    "BroadcastReceiver",
    "BroadcastSender",
    "BucketConsumer",
    "BucketSpec",
    "BucketTarget",
    "BufferBase",
    "ChecksumMismatchError",
    "ControlBlock",
    "CudaIpcReceiver",
    "CudaIpcSender",
    "Deadline",
    "DirectBuffer",
    "DoubleBuffer",
    "IncompleteSyncError",
    "Layout",
    "LayoutMismatchError",
    "MemberGroup",
    "MetadataError",
    "NcclP2PWire",
    "NcclReceiver",
    "NcclSender",
    "NcclWire",
    "OffloadStats",
    "P2PWire",
    "PeerGroup",
    "PeerLostError",
    "RankProgram",
    "RecordingConsumer",
    "RendezvousTimeoutError",
    "ReshardReceiver",
    "ReshardSender",
    "ReshardStats",
    "ServingLock",
    "ShardedBuffer",
    "SharedBuffer",
    "SharedBufferReader",
    "SharedSegment",
    "ShmRingReceiver",
    "ShmRingSender",
    "SyncAbortedError",
    "SyncStats",
    "SyncTimeoutError",
    "TensorSpec",
    "TensorTarget",
    "TorchP2PWire",
    "Transfer",
    "VersionError",
    "Watchdog",
    "WeightSyncError",
    "__version__",
    "adopt",
    "armed_watchdogs",
    "balanced_ranges",
    "bucket_checksum",
    "bucket_starts",
    "bucket_views",
    "check_in",
    "checksum",
    "cleanup_stale_segments",
    "compare_fingerprints",
    "connect_store",
    "copy_tensors",
    "default_copy_threads",
    "dtype_from_name",
    "dtype_name",
    "fingerprint",
    "flat_block",
    "flat_views",
    "host_store",
    "init_process_group_bounded",
    "is_offloaded",
    "live_tensors",
    "new_group_bounded",
    "offload_module",
    "offload_optimizer",
    "pack_all",
    "pack_bucket",
    "process_alive",
    "reload_module",
    "reload_optimizer",
    "reset_group_numbering",
    "stand_down_armed_watchdogs",
    "typed_view",
    "unpack_bucket_into",
]
