"""rlfleet.weightsync: bucketed, versioned, atomic weight sync from trainers to rollout workers.

The public names, by family (the README has one section per family; the imports below are
sorted by module, so this list is the map):

- layout and packing: `Layout` and its buckets, dtypes, packing helpers, `adopt`;
- consumers: the `BucketConsumer` protocol every transport drives, its landing extensions,
  `Assembly` (one version from several senders; `SharesReceiver` receives one that way,
  `TimedConsumer` records where a receive spends its time) and `RecordingConsumer` (a test double);
- weight buffers: the receive strategies "None" (`DirectBuffer`), "Double" (`DoubleBuffer`),
  "Sharded" (`ShardedBuffer`) and their `ServingLock`;
- shared memory: the node buffer ("Shared": `SharedBuffer`) and the `ShmRing` transport;
- broadcast: torch.distributed senders and receivers, member groups, bounded rendezvous, and
  `bucket_segments` (how a bucket is cut on the wire: what a sync really moves, padding included);
- CUDA IPC and NCCL (CuPy, imported lazily); a worker's IPC channels across versions
  (`IpcChannelWriter`, `IpcChannelReader`: what a sync plan's "cuda_ipc" step runs);
- reshard: shard-to-shard moves between training and generation layouts;
- receive strategies: one endpoint per strategy (`create_endpoint`), `WorkerWeights`, the
  strategy names, and their adapter consumers (`DeferredCommit`, `DiscardingConsumer`);
- engines and streams: `LoadWeightsConsumer` (vLLM/SGLang `load_weights`), weight transforms,
  `feed` (a stream of (name, tensor) into any consumer), `full_tensors` (FSDP2, one parameter
  at a time), `WeightStream` (what every sender takes next to a state dict);
- a worker's calls: mixins any worker class inherits (`CommGroupCalls`, `WeightCalls`,
  `RefitCalls`, `ReshardCalls`, `StateCalls`, `ReferenceCalls`, `DeviceCalls`, `OffloadCalls`;
  all of them: `WorkerCalls`), reading what `WorkerHost` declares, and the parts they share
  (checkpoints, offload, device facts, profiler, timings);
- deadlines and watchdogs; integrity checks; offload; cost probes (`measure_copy_terms`); errors.
"""

from rlfleet.weightsync.__about__ import __version__
from rlfleet.weightsync._assembly import Assembly, AssemblyPart
from rlfleet.weightsync._block import adopt, flat_block
from rlfleet.weightsync._buffers import BufferBase, DirectBuffer, DoubleBuffer, live_tensors
from rlfleet.weightsync._checkpoint import Checkpoints
from rlfleet.weightsync._consumers import DeferredCommit, DiscardingConsumer, module_part_buffer
from rlfleet.weightsync._copy import copy_tensors, default_copy_threads
from rlfleet.weightsync._cuda_ipc import ControlBlock, CudaIpcReceiver, CudaIpcSender
from rlfleet.weightsync._deadline import (
    DEFAULT_SERVING_TIMEOUT_S,
    DEFAULT_SYNC_TIMEOUT_S,
    Deadline,
    Watchdog,
    armed_watchdogs,
    caller_deadline,
    current_deadline,
    stand_down_armed_watchdogs,
)
from rlfleet.weightsync._dist import BroadcastReceiver, BroadcastSender
from rlfleet.weightsync._dtypes import DTYPES, dtype_from_name, dtype_name
from rlfleet.weightsync._endpoint_worker import WorkerWeights
from rlfleet.weightsync._endpoints import (
    DirectEndpoint,
    DoubleEndpoint,
    ShardedEndpoint,
    SharedEndpoint,
    TransportReceiver,
    WeightEndpoint,
    commit_consumer,
    create_endpoint,
)
from rlfleet.weightsync._engines import EngineRefit, RolloutEngines
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    CommGroupError,
    IncompleteSyncError,
    LayoutMismatchError,
    MetadataError,
    PartialLoadError,
    PeerLostError,
    RefitChannelError,
    RendezvousTimeoutError,
    SlotsStillMappedError,
    SyncAbortedError,
    SyncTimeoutError,
    UnsafeSegmentError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync._feed import feed, full_tensors, layout_entries
from rlfleet.weightsync._frames import bucket_segments
from rlfleet.weightsync._integrity import bucket_checksum, checksum, compare_fingerprints, fingerprint
from rlfleet.weightsync._ipc_worker import IpcChannelReader, IpcChannelWriter
from rlfleet.weightsync._layout import ALIGNMENT, DEFAULT_BUCKET_BYTES, BucketSpec, Layout, TensorSpec
from rlfleet.weightsync._load_weights import LoadWeights, LoadWeightsConsumer
from rlfleet.weightsync._member import MemberGroup
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
from rlfleet.weightsync._probes import measure_copy_terms, probe_layout
from rlfleet.weightsync._protocol import BucketConsumer
from rlfleet.weightsync._recording import RecordingConsumer
from rlfleet.weightsync._refit_calls import RefitCalls, transport_state
from rlfleet.weightsync._refit_channel import RefitChannel, import_zmq
from rlfleet.weightsync._rendezvous import (
    Roster,
    connect_store,
    host_store,
    init_process_group_bounded,
    join_generation,
    new_group_bounded,
    reset_group_numbering,
)
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
from rlfleet.weightsync._reshard_calls import ReshardCalls
from rlfleet.weightsync._serving import ServingLock
from rlfleet.weightsync._sharded import ShardedBuffer, balanced_ranges
from rlfleet.weightsync._shared_buffer import SharedBuffer, SharedBufferReader
from rlfleet.weightsync._shares import SharesReceiver, TimedConsumer
from rlfleet.weightsync._shm import (
    SharedSegment,
    cleanup_stale_segments,
    install_termination_cleanup,
    process_alive,
)
from rlfleet.weightsync._shm_ring import ShmRingReceiver, ShmRingSender
from rlfleet.weightsync._strategy import WEIGHT_BUFFER_STRATEGIES, WeightBufferStrategy, check_strategy
from rlfleet.weightsync._stream import WeightStream
from rlfleet.weightsync._sync_watch import (
    WIRE_TIMEOUT_S,
    SyncWatch,
    WatchedBroadcastReceiver,
    WatchedBroadcastSender,
    WatchedDeadline,
    WatchedP2PWire,
    WatchedWire,
)
from rlfleet.weightsync._transforms import (
    LLAMA_STACKED_PARAMS,
    Cast,
    Drop,
    Fuse,
    Rename,
    TransformChain,
    WeightTransform,
    apply_transforms,
    plan_transforms,
)
from rlfleet.weightsync._wire_base import BucketTarget, SyncStats, TensorTarget
from rlfleet.weightsync._worker import WorkerCalls
from rlfleet.weightsync._worker_base import WorkerHost
from rlfleet.weightsync._worker_calls import WeightCalls
from rlfleet.weightsync._worker_comm import (
    CommGroupCalls,
    ParallelMode,
    WorkerComm,
    member_group,
)
from rlfleet.weightsync._worker_device import (
    Profiler,
    Timings,
    device_id,
    device_info,
    free_memory,
    host_memory,
    reset_peak_memory,
)
from rlfleet.weightsync._worker_host import BufferSettings, WorkerSettings
from rlfleet.weightsync._worker_offload import Offload
from rlfleet.weightsync._worker_reference import ReferenceCalls, reference_logprobs
from rlfleet.weightsync._worker_resources import DeviceCalls, OffloadCalls
from rlfleet.weightsync._worker_state import StateCalls

__all__ = [
    "ALIGNMENT",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_RESHARD_BUCKET_BYTES",
    "DEFAULT_RESHARD_DIRECT_MIN",
    "DEFAULT_SERVING_TIMEOUT_S",
    "DEFAULT_SYNC_TIMEOUT_S",
    "DTYPES",
    "LLAMA_STACKED_PARAMS",
    "WEIGHT_BUFFER_STRATEGIES",
    "WIRE_TIMEOUT_S",
    "Assembly",
    "AssemblyPart",
    "BroadcastReceiver",
    "BroadcastSender",
    "BucketConsumer",
    "BucketSpec",
    "BucketTarget",
    "BufferBase",
    "BufferSettings",
    "Cast",
    "Checkpoints",
    "ChecksumMismatchError",
    "CommGroupCalls",
    "CommGroupError",
    "ControlBlock",
    "CudaIpcReceiver",
    "CudaIpcSender",
    "Deadline",
    "DeferredCommit",
    "DeviceCalls",
    "DirectBuffer",
    "DirectEndpoint",
    "DiscardingConsumer",
    "DoubleBuffer",
    "DoubleEndpoint",
    "Drop",
    "EngineRefit",
    "Fuse",
    "IncompleteSyncError",
    "IpcChannelReader",
    "IpcChannelWriter",
    "Layout",
    "LayoutMismatchError",
    "LoadWeights",
    "LoadWeightsConsumer",
    "MemberGroup",
    "MetadataError",
    "NcclP2PWire",
    "NcclReceiver",
    "NcclSender",
    "NcclWire",
    "Offload",
    "OffloadCalls",
    "OffloadStats",
    "P2PWire",
    "ParallelMode",
    "PartialLoadError",
    "PeerGroup",
    "PeerLostError",
    "Profiler",
    "RankProgram",
    "RecordingConsumer",
    "ReferenceCalls",
    "RefitCalls",
    "RefitChannel",
    "RefitChannelError",
    "Rename",
    "RendezvousTimeoutError",
    "ReshardCalls",
    "ReshardReceiver",
    "ReshardSender",
    "ReshardStats",
    "RolloutEngines",
    "Roster",
    "ServingLock",
    "ShardedBuffer",
    "ShardedEndpoint",
    "SharedBuffer",
    "SharedBufferReader",
    "SharedEndpoint",
    "SharedSegment",
    "SharesReceiver",
    "ShmRingReceiver",
    "ShmRingSender",
    "SlotsStillMappedError",
    "StateCalls",
    "SyncAbortedError",
    "SyncStats",
    "SyncTimeoutError",
    "SyncWatch",
    "TensorSpec",
    "TensorTarget",
    "TimedConsumer",
    "Timings",
    "TorchP2PWire",
    "Transfer",
    "TransformChain",
    "TransportReceiver",
    "UnsafeSegmentError",
    "VersionError",
    "Watchdog",
    "WatchedBroadcastReceiver",
    "WatchedBroadcastSender",
    "WatchedDeadline",
    "WatchedP2PWire",
    "WatchedWire",
    "WeightBufferStrategy",
    "WeightCalls",
    "WeightEndpoint",
    "WeightStream",
    "WeightSyncError",
    "WeightTransform",
    "WorkerCalls",
    "WorkerComm",
    "WorkerHost",
    "WorkerSettings",
    "WorkerWeights",
    "__version__",
    "adopt",
    "apply_transforms",
    "armed_watchdogs",
    "balanced_ranges",
    "bucket_checksum",
    "bucket_segments",
    "bucket_starts",
    "bucket_views",
    "caller_deadline",
    "check_strategy",
    "checksum",
    "cleanup_stale_segments",
    "commit_consumer",
    "compare_fingerprints",
    "connect_store",
    "copy_tensors",
    "create_endpoint",
    "current_deadline",
    "default_copy_threads",
    "device_id",
    "device_info",
    "dtype_from_name",
    "dtype_name",
    "feed",
    "fingerprint",
    "flat_block",
    "flat_views",
    "free_memory",
    "full_tensors",
    "host_memory",
    "host_store",
    "import_zmq",
    "init_process_group_bounded",
    "install_termination_cleanup",
    "is_offloaded",
    "join_generation",
    "layout_entries",
    "live_tensors",
    "measure_copy_terms",
    "member_group",
    "module_part_buffer",
    "new_group_bounded",
    "offload_module",
    "offload_optimizer",
    "pack_all",
    "pack_bucket",
    "plan_transforms",
    "probe_layout",
    "process_alive",
    "reference_logprobs",
    "reload_module",
    "reload_optimizer",
    "reset_group_numbering",
    "reset_peak_memory",
    "stand_down_armed_watchdogs",
    "transport_state",
    "typed_view",
    "unpack_bucket_into",
]
