"""Errors a weight sync can end in.

Every failure is a `WeightSyncError`; the subclass says what went wrong so a caller can
decide whether to retry. A receiver that rlfleet applies (a buffer, an endpoint, the node
buffer) keeps its previous version whatever the error; an engine fed as buckets land
(`LoadWeightsConsumer(mode="stream")`) cannot roll back, and says so with `PartialLoadError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence


class WeightSyncError(RuntimeError):
    """Base class: the sync did not complete. rlfleet's own receivers applied nothing new; an
    engine that took part of the version is named by a `PartialLoadError`."""


class LayoutMismatchError(WeightSyncError):
    """Sender and receiver disagree about a parameter (name, shape or dtype).

    `parameter` is the name of the first parameter that differs, as data (never parsed back
    out of the message), or None when no single parameter is to blame.
    """

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class MetadataError(WeightSyncError, ValueError):
    """Metadata received from a peer is malformed, oversized or inconsistent."""


class ChecksumMismatchError(WeightSyncError):
    """A bucket's bytes do not match the checksum its sender computed."""

    def __init__(self, message: str, bucket: int | None = None) -> None:
        super().__init__(message)
        self.bucket = bucket


class IncompleteSyncError(WeightSyncError):
    """Commit was requested before every bucket of the version arrived."""


class SyncTimeoutError(WeightSyncError, TimeoutError):
    """A blocking step passed its deadline."""


class SyncAbortedError(WeightSyncError):
    """The sync was aborted (by a watchdog, by the sender, or by the caller)."""


class PeerLostError(WeightSyncError):
    """A peer process of the sync died or disconnected."""


class VersionError(WeightSyncError):
    """A version arrived out of order (not newer than the applied one)."""


class PartialLoadError(WeightSyncError):
    """An engine's ``load_weights`` took part of a version that then failed: it cannot roll back.

    `mode` says how the receiver fed the engine ("staged": at commit, after every bucket arrived;
    "stream": as buckets landed). The engine holds a mix of the applied version and the failed
    one until a complete version is loaded (resend one, or reload from a checkpoint).
    """

    def __init__(self, message: str, *, version: int, mode: str) -> None:
        super().__init__(message)
        self.version = version
        self.mode = mode


class SlotsStillMappedError(WeightSyncError):
    """A CUDA IPC sender closed while live readers still mapped its GPU slots.

    Freeing GPU memory that another process still maps is undefined in CUDA, so the slots are
    kept until those readers (`readers`) unmapped them or died, then freed by the sender's
    `free_slots()` or the process's next IPC sender.
    """

    def __init__(self, message: str, readers: list[int]) -> None:
        super().__init__(message)
        self.readers = list(readers)


class UnsafeSegmentError(WeightSyncError, PermissionError):
    """A shared-memory segment is not private to this user (another owner, or a mode other than
    0600): anyone could have made or changed it, so it is not mapped."""


class RendezvousTimeoutError(SyncTimeoutError):
    """Some ranks did not join a group in time; `missing_ranks` names them (as `CommGroupError`)."""

    def __init__(self, message: str, missing_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)

    @property
    def missing(self) -> list[int]:
        """Deprecated: `missing_ranks` (one name for both errors)."""
        warnings.warn("RendezvousTimeoutError.missing is now missing_ranks", DeprecationWarning, stacklevel=2)
        return list(self.missing_ranks)


class CommGroupError(WeightSyncError):
    """A communication group could not be formed (a rank did not join in time, or failed).

    `missing_ranks` names the ranks that did not join, as data.
    """

    def __init__(self, message: str, missing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


class RefitChannelError(WeightSyncError):
    """The refit control channel refused a message (not one JSON object) or is closed."""
