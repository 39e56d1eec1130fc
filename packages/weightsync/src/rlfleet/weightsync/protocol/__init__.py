"""The protocol every transport speaks: the `BucketConsumer` a receiver drives, the session core
(header, negotiation, buckets, commit), wire frames, the wire sender/receiver engine, and
`WeightStream` / `feed` (a stream of (name, tensor) in place of a state dict), and non-blocking
sends (`PublishHandle`, `WeightSnapshot`, `SendPipeline`: a snapshot now, the bytes later).
"""

from rlfleet.weightsync.protocol._background import PublishHandle, SendPipeline, WeightSnapshot
from rlfleet.weightsync.protocol._feed import feed, full_tensors, layout_entries
from rlfleet.weightsync.protocol._frames import bucket_segments
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.protocol._stream import WeightStream
from rlfleet.weightsync.protocol._wire_base import BucketTarget, SyncStats, TensorTarget

__all__ = [
    "BucketConsumer",
    "BucketTarget",
    "PublishHandle",
    "SendPipeline",
    "SyncStats",
    "TensorTarget",
    "WeightSnapshot",
    "WeightStream",
    "bucket_segments",
    "feed",
    "full_tensors",
    "layout_entries",
]
