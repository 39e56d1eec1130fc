"""Errors the policy group raises; each names the worker, rank or step at fault.

A worker's own components are weightsync's, and so are their errors: `CommGroupError` (a
communication group could not be formed) and `RefitChannelError` are `WeightSyncError`s,
re-exported by this package.
"""

from __future__ import annotations


class PolicyGroupError(RuntimeError):
    """Base class of every error raised by rlfleet.policygroup."""


class WorkerDiedError(PolicyGroupError):
    """A policy actor died (or stopped answering) while the group needed it."""

    def __init__(self, message: str, role: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.role = role
        self.index = index


class TrainWorkerDiedError(WorkerDiedError):
    """A trainer died: training state is lost, the group cannot go on silently."""


class TaskTimeoutError(PolicyGroupError, TimeoutError):
    """A call on a policy did not finish within its deadline."""
