"""Shard-to-shard moves between a training and a generation layout: per-rank programs, P2P wires
(torch or NCCL) and the sender and receiver that run them.
"""

from rlfleet.weightsync.reshard._reshard import (
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

__all__ = [
    "DEFAULT_RESHARD_BUCKET_BYTES",
    "DEFAULT_RESHARD_DIRECT_MIN",
    "NcclP2PWire",
    "P2PWire",
    "PeerGroup",
    "RankProgram",
    "ReshardReceiver",
    "ReshardSender",
    "ReshardStats",
    "TorchP2PWire",
    "Transfer",
]
