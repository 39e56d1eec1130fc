"""rlfleet.weightsync: bucketed, versioned, atomic weight sync from trainers to rollout workers."""

from rlfleet.weightsync.__about__ import __version__
from rlfleet.weightsync._buffers import BufferBase, DirectBuffer, DoubleBuffer, ServingLock, live_tensors
from rlfleet.weightsync._cuda_ipc import ControlBlock, CudaIpcReceiver, CudaIpcSender
from rlfleet.weightsync._deadline import (
    Backoff,
    Deadline,
    Watchdog,
    armed_watchdogs,
    stand_down,
    stand_down_armed_watchdogs,
)
from rlfleet.weightsync._dist import BroadcastReceiver, BroadcastSender, TorchWire, map_dist_error
from rlfleet.weightsync._dtypes import DTYPES, dtype_from_name, dtype_name
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    IncompleteSyncError,
    LayoutMismatchError,
    MetadataError,
    PeerLostError,
    SyncAbortedError,
    SyncTimeoutError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync._integrity import bucket_checksum, checksum, compare_fingerprints, fingerprint
from rlfleet.weightsync._layout import ALIGNMENT, DEFAULT_BUCKET_BYTES, BucketSpec, Layout, TensorSpec
from rlfleet.weightsync._nccl import NcclReceiver, NcclSender, NcclWire
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
from rlfleet.weightsync._rendezvous import (
    RendezvousTimeoutError,
    check_in,
    connect_store,
    init_process_group_bounded,
    new_group_bounded,
)
from rlfleet.weightsync._sharded import ShardedBuffer, balanced_ranges
from rlfleet.weightsync._shared_buffer import SharedBuffer, SharedBufferReader
from rlfleet.weightsync._shm import SharedSegment, cleanup_stale_segments, process_alive
from rlfleet.weightsync._shm_ring import ShmRingReceiver, ShmRingSender
from rlfleet.weightsync._wire import (
    BucketTarget,
    Control,
    Header,
    SyncStats,
    TensorTarget,
    bucket_segments,
)

__all__ = [
    "BroadcastReceiver",
    "BroadcastSender",
    "BucketTarget",
    "Control",
    "Header",
    "RendezvousTimeoutError",
    "ControlBlock",
    "CudaIpcReceiver",
    "CudaIpcSender",
    "NcclReceiver",
    "NcclSender",
    "NcclWire",
    "ShardedBuffer",
    "balanced_ranges",
    "SyncStats",
    "TensorTarget",
    "TorchWire",
    "bucket_segments",
    "check_in",
    "connect_store",
    "init_process_group_bounded",
    "map_dist_error",
    "new_group_bounded",
    "ALIGNMENT",
    "Backoff",
    "Deadline",
    "Watchdog",
    "armed_watchdogs",
    "stand_down",
    "stand_down_armed_watchdogs",
    "BufferBase",
    "DirectBuffer",
    "DoubleBuffer",
    "ServingLock",
    "live_tensors",
    "OffloadStats",
    "is_offloaded",
    "offload_module",
    "offload_optimizer",
    "reload_module",
    "reload_optimizer",
    "SharedBuffer",
    "SharedBufferReader",
    "SharedSegment",
    "cleanup_stale_segments",
    "process_alive",
    "ShmRingReceiver",
    "ShmRingSender",
    "DEFAULT_BUCKET_BYTES",
    "DTYPES",
    "BucketConsumer",
    "BucketSpec",
    "ChecksumMismatchError",
    "IncompleteSyncError",
    "Layout",
    "LayoutMismatchError",
    "MetadataError",
    "PeerLostError",
    "SyncAbortedError",
    "SyncTimeoutError",
    "TensorSpec",
    "VersionError",
    "WeightSyncError",
    "__version__",
    "bucket_checksum",
    "bucket_starts",
    "bucket_views",
    "checksum",
    "compare_fingerprints",
    "dtype_from_name",
    "dtype_name",
    "fingerprint",
    "flat_views",
    "pack_all",
    "pack_bucket",
    "typed_view",
    "unpack_bucket_into",
]
