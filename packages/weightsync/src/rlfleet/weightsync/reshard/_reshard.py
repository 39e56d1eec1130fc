"""Reshard execution: each generation rank receives exactly its own shard, point to point.

A reshard plan (``rlfleet.placement.plan_reshard``) says which training rank sends which slice
to which generation ranks; each process executes its `RankProgram` (the plan's
``rank_program(side, rank)``, plain JSON). The session has the broadcast path's guarantees:
versioned, atomic, deadline-bounded; a version lands on every generation rank or on none.

One sync of version ``v``, over one or more process groups (one per training pipeline stage,
as NeMo RL's ``nccl_reshard`` forms them, or one for everybody):

1. header: the lowest training rank of each group sends a fixed-size JSON frame (version,
   plan digest, extras such as kv-cache scales, or an abort reason) to every generation rank
   of the group; a generation rank checks that all headers agree and calls ``consumer.begin``;
2. negotiation: a sum all-reduce per group of (status, version, plan digest) per member; a
   group where anything disagrees moves no data;
3. data: point-to-point messages, bucketed per (sender, receiver) pair: slices smaller than
   ``direct_min`` are packed into buckets of at most ``bucket_bytes`` (ordered by element size,
   so every slice sits aligned with no padding); larger ones travel alone, straight from the
   sender's storage and into the receiver's staging when the slice is contiguous. Every rank
   posts its messages in one global order (message index within its pair, sender, receiver)
   with at most ``max_in_flight`` outstanding, which cannot deadlock: the globally oldest
   message is always posted on both ends. Receivers land everything in staging (the
   consumer's own storage when it offers `BucketTarget`, else a staging buffer), never in the
   live weights; a sender that fails to read a slice keeps sending zeros so every pair stays in
   step, and reports the failure in the commit;
4. commit: each generation rank lets its consumer prepare the commit (``prepare_commit``:
   locks, slots), then a status all-reduce per group, then a decision all-reduce per group in
   which every generation rank (each sees every group) votes; all generation ranks reach the
   same decision and commit, or all abort.

Every wait takes the sync's deadline. A timeout is a `SyncTimeoutError`, a peer that vanished a
`PeerLostError`; either leaves the group mid-protocol (`broken`), the consumer is aborted and
the applied version stays intact. Clean failures (a stale version, a layout mismatch, a sender
that could not read a tensor, a consumer error, a consumer that cannot prepare its commit)
leave the group usable.

Transports are `P2PWire` objects: `TorchP2PWire` over a torch.distributed process group (gloo
on CPU, nccl on GPU) and `NcclP2PWire` over a cupy NCCL communicator (cupy imported lazily).
With ``delta="auto"`` a pair whose two ends hold the same base version moves the delta of its
messages instead of their bytes, rebuilt and digest-checked in staging before step 4
(`_reshard_delta`).

The pieces: `_reshard_program` (what a rank executes), `_reshard_groups` (wires and groups),
`_reshard_session` (header, rounds), `_reshard_delta` (deltas per pair), `_reshard_sender` and
`_reshard_receiver`; status codes, frames and the session's broken/in-step state are the
protocol core (`_core`) shared with the broadcast protocol.
"""

from __future__ import annotations

from rlfleet.weightsync.reshard._reshard_groups import NcclP2PWire, P2PWire, PeerGroup, TorchP2PWire
from rlfleet.weightsync.reshard._reshard_program import GEN, TRAIN, RankProgram, ReshardMessage, Transfer
from rlfleet.weightsync.reshard._reshard_receiver import ReshardReceiver
from rlfleet.weightsync.reshard._reshard_sender import ReshardSender
from rlfleet.weightsync.reshard._reshard_session import (
    DEFAULT_RESHARD_BUCKET_BYTES,
    DEFAULT_RESHARD_DIRECT_MIN,
    ReshardStats,
)
from rlfleet.weightsync.reshard._reshard_session import decode_header as _decode_header

__all__ = [
    "DEFAULT_RESHARD_BUCKET_BYTES",
    "DEFAULT_RESHARD_DIRECT_MIN",
    "GEN",
    "TRAIN",
    "NcclP2PWire",
    "P2PWire",
    "PeerGroup",
    "RankProgram",
    "ReshardMessage",
    "ReshardReceiver",
    "ReshardSender",
    "ReshardStats",
    "TorchP2PWire",
    "Transfer",
    "_decode_header",
]
