"""Where received bytes land: the direct and double buffers, the sharded buffer, the landing and
serving locks, several senders' shares assembled into one version, the consumers that adapt a
buffer (deferred commit, discard), and storage-level offload of a module or optimizer.
"""

from rlfleet.weightsync.buffers._assembly import Assembly, AssemblyPart
from rlfleet.weightsync.buffers._buffers import BufferBase, DirectBuffer, DoubleBuffer
from rlfleet.weightsync.buffers._consumers import (
    DeferredCommit,
    DiscardingConsumer,
    ExpectedVersion,
    module_part_buffer,
)
from rlfleet.weightsync.buffers._offload import (
    OffloadStats,
    is_offloaded,
    offload_module,
    offload_optimizer,
    reload_module,
    reload_optimizer,
)
from rlfleet.weightsync.buffers._recording import RecordingConsumer
from rlfleet.weightsync.buffers._serving import ServingLock
from rlfleet.weightsync.buffers._sharded import ShardedBuffer, balanced_ranges
from rlfleet.weightsync.buffers._shares import SharesReceiver, TimedConsumer

__all__ = [
    "Assembly",
    "AssemblyPart",
    "BufferBase",
    "DeferredCommit",
    "DirectBuffer",
    "DiscardingConsumer",
    "DoubleBuffer",
    "ExpectedVersion",
    "OffloadStats",
    "RecordingConsumer",
    "ServingLock",
    "ShardedBuffer",
    "SharesReceiver",
    "TimedConsumer",
    "balanced_ranges",
    "is_offloaded",
    "module_part_buffer",
    "offload_module",
    "offload_optimizer",
    "reload_module",
    "reload_optimizer",
]
