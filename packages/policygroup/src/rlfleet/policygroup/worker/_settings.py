"""The settings the worker mixins read from their host's `config` (`WorkerHost` declares the rest).

The host class is any worker object that holds a model and these settings (policygroup's
`BasePolicy` with its `PolicyConfig`). Read-only protocols, so a config whose fields are
narrower (a `Literal` strategy name) still fits.
"""

from __future__ import annotations

from typing import Protocol


class BufferSettings(Protocol):
    """How versions are cut and received: bucket size and the default receive strategy."""

    @property
    def bucket_bytes(self) -> int: ...

    @property
    def buffer_strategy(self) -> str: ...


class WorkerSettings(Protocol):
    """The deadlines a worker's calls default to, and its weight-buffer settings."""

    @property
    def group_timeout_s(self) -> float: ...

    @property
    def sync_timeout_s(self) -> float: ...

    @property
    def drain_timeout_s(self) -> float: ...

    @property
    def weight_buffer(self) -> BufferSettings: ...
