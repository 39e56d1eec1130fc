"""Errors the policy group raises; each names the worker, rank or step at fault.

The weight-moving parts are weightsync's, and so are their errors (`CommGroupError`,
`RefitChannelError` are `WeightSyncError`s, re-exported here). When the group itself forms
communication groups across its workers, a failure is a `CommGroupFormationError`: a
`PolicyGroupError` (and a `CommGroupError`, for callers that catch that) whose cause is the
worker's weightsync error.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlfleet.weightsync import CommGroupError


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


class CommGroupFormationError(PolicyGroupError, CommGroupError):
    """The group could not form a communication group across its workers; `missing_ranks` names
    the ranks that did not join (as data), `__cause__` is the worker's error when one failed."""

    def __init__(self, message: str, missing_ranks: Sequence[int] = ()) -> None:
        CommGroupError.__init__(self, message, tuple(missing_ranks))
