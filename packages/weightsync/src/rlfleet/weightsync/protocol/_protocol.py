"""The one protocol every transport and every weight buffer speaks.

A sync of version ``v`` is: ``begin(v, layout)``, then each bucket once (any order) through
``consume(index, data)``, then ``commit(v)``; or ``abort(error)`` at any point. Transports
(shared memory, torch.distributed, CUDA IPC, NCCL) move bucket bytes and call a
`BucketConsumer`; weight buffers (None, Double, Shared, Sharded) are consumers and decide where
the bytes land and how version ``v`` becomes visible. Until ``commit`` succeeds, the
previously applied version stays intact and usable.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from rlfleet.weightsync.layout._layout import Layout


@runtime_checkable
class BucketConsumer(Protocol):
    """Receiving end of a sync session (implemented by weight buffers)."""

    @property
    def layout(self) -> Layout:
        """The layout this consumer expects; transports check the sender's digest against it."""
        ...

    def begin(self, version: int) -> None:
        """Start receiving `version`; raises VersionError if it is not newer than the applied one."""
        ...

    def consume(self, index: int, data: torch.Tensor) -> None:
        """Take bucket `index` (flat uint8, the bucket's nbytes); `data` is only valid during the call."""
        ...

    def commit(self, version: int) -> None:
        """Make `version` visible atomically; raises IncompleteSyncError if a bucket is missing."""
        ...

    def abort(self, error: BaseException) -> None:
        """Drop everything received for the pending version; the applied version is untouched."""
        ...

    @property
    def version(self) -> int:
        """The applied (visible) version; -1 before the first commit."""
        ...
