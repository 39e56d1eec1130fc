"""Errors the policy group raises; each names the worker, rank or step at fault."""

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


class CommGroupError(PolicyGroupError):
    """A communication group could not be formed (a rank did not join in time, or failed)."""

    def __init__(self, message: str, missing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


class TaskTimeoutError(PolicyGroupError, TimeoutError):
    """A call on a policy did not finish within its deadline."""


class RefitChannelError(PolicyGroupError):
    """The refit control channel refused a message (not one JSON object) or is closed."""
