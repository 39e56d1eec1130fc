"""rlfleet.weightsync: Bucketed, versioned, atomic weight sync from trainers to rollout workers over shared memory, gloo, CUDA IPC and NCCL."""

from rlfleet.weightsync.__about__ import __version__

__all__ = ["__version__"]
