"""The broadcast sync protocol, written once over an abstract collective "wire".

`torch.distributed` (gloo or nccl, `_dist.py`) and NCCL through cupy (`_nccl.py`) only supply a
`Wire`: an async broadcast and an async sum all-reduce whose handles wait with a deadline.
Everything else (header, negotiation, per-bucket control words, the double-buffered bucket
pipeline, checksums, the two-phase commit and the abort paths) lives here and in
`_wire_receiver.py`, on the protocol core (`_core.py`) that the reshard protocol shares, so
every transport behaves the same and the protocol logic is covered by CPU tests.

One sync of version ``v``, every member of the group in the same order of collectives:

1. header (`_frames.Header`): a fixed-size JSON broadcast from the sender (version, layout
   digest, bucket count, the sender's share of the buckets, checksum flag, size of its layout
   JSON, the direct-send threshold, or an abort reason if its state dict does not fit its
   layout);
2. negotiation: a sum all-reduce of one status code per rank (digest and share check,
   ``consumer.begin``); if a receiver's layout differs, the sender's layout JSON follows in one
   more broadcast so that receiver can name the first differing parameter; any non-zero code
   ends the sync on every rank, with nothing applied;
3. buckets: for each bucket of the share a fixed-size control word (bucket index, wire bytes,
   crc32 or an abort reason), then its segments: runs of small tensors packed in a bucket
   buffer, large tensors sent straight from their own storage. The sender packs bucket ``k+1``
   while bucket ``k`` is on the wire (two bucket buffers); a receiver consumes bucket ``k``
   while ``k+1`` arrives, or lands it straight in the consumer's storage (`BucketTarget`);
4. commit: each receiver calls ``consumer.prepare_commit`` (what the commit needs: locks,
   slots), then a second status all-reduce; every receiver commits only if every rank
   reported success, so a version lands on all receivers or none, and a commit cannot fail
   after the vote. A receiver that cannot prepare votes no, and the sender's error names it.

Several senders: each sends a disjoint share (``buckets=``) in its own group, and a receiver
assembles them into one version with `Assembly` (`_assembly.py`).
"""

from __future__ import annotations

from rlfleet.weightsync.protocol._frames import (
    CONTROL_BYTES,
    DEFAULT_DIRECT_MIN_BYTES,
    HEADER_BYTES,
    Control,
    Header,
    Segment,
    bucket_segments,
)
from rlfleet.weightsync.protocol._wire_base import BucketTarget, SyncStats, TensorTarget, Wire
from rlfleet.weightsync.protocol._wire_receiver import ProtocolReceiver
from rlfleet.weightsync.protocol._wire_sender import ProtocolSender

__all__ = [
    "CONTROL_BYTES",
    "DEFAULT_DIRECT_MIN_BYTES",
    "HEADER_BYTES",
    "BucketTarget",
    "Control",
    "Header",
    "ProtocolReceiver",
    "ProtocolSender",
    "Segment",
    "SyncStats",
    "TensorTarget",
    "Wire",
    "bucket_segments",
]
