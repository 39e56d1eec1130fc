"""Two general `BucketConsumer` adapters a receiver uses around its own buffer.

- `DiscardingConsumer`: takes part in a sync of a version the receiver already holds and drops
  the bytes. A collective transport needs every member, so a receiver that got a version on an
  earlier, partly failed try still joins the retry without applying anything twice.
- `DeferredCommit`: stages through an inner buffer and leaves the inner commit for later. A
  transport commits every receiver when the transfer ends; a rolling update wants the transfer
  finished everywhere first and each receiver's swap later, while that receiver is drained.
  Its base for a delta is the inner buffer's applied version (passed through, as below).
- `ExpectedVersion`: takes only the version the receiver asked for. A transport's sender
  announces the version; a receiver asked for another one refuses it at `begin`, before any
  byte lands, instead of applying it and noticing afterwards. It passes a delta's base through
  (`copy_base`, `takes_deltas`) when its inner consumer has one.
- `module_part_buffer`: a Double buffer over the part of a module a layout names (one rank's
  shards of a resharded model), resuming at the module's version.
"""

from __future__ import annotations

import threading

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import IncompleteSyncError, LayoutMismatchError, VersionError
from rlfleet.weightsync.buffers._buffers import DEFAULT_COMMIT_TIMEOUT_S, DoubleBuffer, ServingLock
from rlfleet.weightsync.codec._delta_state import DeltaBase, base_pieces_of
from rlfleet.weightsync.layout._block import live_tensors
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._protocol import BucketConsumer

__all__ = ["DeferredCommit", "DiscardingConsumer", "ExpectedVersion", "module_part_buffer", "takes_deltas"]


def takes_deltas(consumer: object) -> bool:
    """Whether `consumer` (an adapter's inner one) can rebuild a delta: a wrapper says so only
    when what it wraps can, so a sender's delta is offered through adapters and refused by
    those that cannot provide a base."""
    return isinstance(consumer, DeltaBase) and bool(getattr(consumer, "takes_deltas", True))


class DiscardingConsumer:
    """A consumer of `layout` that accepts `version` (it reports ``version - 1`` as applied) and
    drops every byte; its commit changes nothing."""

    def __init__(self, layout: Layout, version: int) -> None:
        self.layout = layout
        self.version = version - 1

    def begin(self, version: int) -> None:
        pass

    def consume(self, index: int, data: torch.Tensor) -> None:
        pass

    def commit(self, version: int) -> None:
        pass

    def abort(self, error: BaseException) -> None:
        pass


class DeferredCommit:
    """Stages a version in `inner`; the transport's commit only records that it is complete.

    `staged` is the version a transport committed (None while one is pending or after an
    abort). The owner makes it live later with ``inner.commit(staged)`` (after
    ``inner.prepare_commit`` when the inner buffer has it). Landing zones of the inner buffer
    (`bucket_target`, `tensor_target`) are passed through, so a transport writes straight into
    the inner staging. `prepare_commit` checks that every bucket arrived, so a receiver votes
    failure on an incomplete version instead of staging it; it acquires nothing of the inner
    buffer, whose commit comes later.
    """

    def __init__(self, inner: BucketConsumer) -> None:
        self.inner = inner
        self.staged: int | None = None
        self._pending: int | None = None
        self._arrived: set[int] = set()
        self._lock = threading.Lock()

    @property
    def layout(self) -> Layout:
        return self.inner.layout

    @property
    def version(self) -> int:
        return self.inner.version

    def begin(self, version: int) -> None:
        with self._lock:
            self.staged, self._pending, self._arrived = None, None, set()
        self.inner.begin(version)
        self._pending = version

    def consume(self, index: int, data: torch.Tensor) -> None:
        self.inner.consume(index, data)
        with self._lock:
            self._arrived.add(index)

    def bucket_target(self, index: int) -> torch.Tensor | None:
        target = getattr(self.inner, "bucket_target", None)
        return None if target is None else target(index)

    def tensor_target(self, name: str) -> torch.Tensor | None:
        target = getattr(self.inner, "tensor_target", None)
        return None if target is None else target(name)

    @property
    def takes_deltas(self) -> bool:
        """Whether `inner` can rebuild a delta on its applied version (`codec.DeltaBase`)."""
        return takes_deltas(self.inner)

    def copy_base(self, index: int, out: torch.Tensor) -> bool:
        return isinstance(self.inner, DeltaBase) and self.inner.copy_base(index, out)

    def base_pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        return base_pieces_of(self.inner, index)

    def prepare_commit(self, version: int, deadline: Deadline | None = None) -> None:
        """Raise unless `version` is pending and every bucket of it arrived."""
        with self._lock:
            if self._pending != version:
                raise VersionError(f"commit of version {version}, but the pending version is {self._pending}")
            missing = [b.index for b in self.layout.buckets if b.index not in self._arrived]
        if missing:
            raise IncompleteSyncError(
                f"version {version} is missing {len(missing)} of {len(self.layout.buckets)} buckets "
                f"(first: bucket {missing[0]})"
            )

    def commit(self, version: int) -> None:
        try:
            self.prepare_commit(version)
        except BaseException as exc:
            self.abort(exc)
            raise
        with self._lock:
            self.staged, self._pending = version, None

    def abort(self, error: BaseException) -> None:
        with self._lock:
            self.staged, self._pending, self._arrived = None, None, set()
        self.inner.abort(error)


class ExpectedVersion:
    """`inner`, taking only `expected`: a sender announcing any other version is refused at
    `begin` (`VersionError`, before any byte lands; the transport then tells the sender), and
    everything else goes to `inner` (its landing zones and two-phase commit included)."""

    def __init__(self, inner: BucketConsumer, expected: int, who: str = "receiver") -> None:
        self.inner = inner
        self.expected = expected
        self.who = who

    @property
    def layout(self) -> Layout:
        return self.inner.layout

    @property
    def version(self) -> int:
        return self.inner.version

    def begin(self, version: int) -> None:
        if version != self.expected:
            raise VersionError(
                f"{self.who}: asked for version {self.expected}, the sender announces version {version}: "
                "refused before any byte landed"
            )
        self.inner.begin(version)

    def consume(self, index: int, data: torch.Tensor) -> None:
        self.inner.consume(index, data)

    def bucket_target(self, index: int) -> torch.Tensor | None:
        target = getattr(self.inner, "bucket_target", None)
        return None if target is None else target(index)

    def tensor_target(self, name: str) -> torch.Tensor | None:
        target = getattr(self.inner, "tensor_target", None)
        return None if target is None else target(name)

    @property
    def takes_deltas(self) -> bool:
        """Whether `inner` can rebuild a delta on its applied version (`codec.DeltaBase`)."""
        return takes_deltas(self.inner)

    def copy_base(self, index: int, out: torch.Tensor) -> bool:
        return isinstance(self.inner, DeltaBase) and self.inner.copy_base(index, out)

    def base_pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        return base_pieces_of(self.inner, index)

    def prepare_commit(self, version: int, deadline: Deadline | float | None = None) -> None:
        prepare = getattr(self.inner, "prepare_commit", None)
        if prepare is not None:
            prepare(version, deadline)

    def commit(self, version: int) -> None:
        self.inner.commit(version)

    def abort(self, error: BaseException) -> None:
        self.inner.abort(error)


class _ResumedBuffer(DoubleBuffer):
    """A copy-mode DoubleBuffer whose applied version starts at `version`, not -1."""

    def __init__(
        self, live: dict[str, torch.Tensor], layout: Layout, version: int, commit_timeout_s: float
    ) -> None:
        super().__init__(live, layout, mode="copy", commit_timeout_s=commit_timeout_s)
        self._version = version


def module_part_buffer(
    module: torch.nn.Module,
    layout: Layout,
    *,
    version: int,
    serving_lock: ServingLock | None = None,
    commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
    who: str = "receiver",
) -> DoubleBuffer:
    """A Double buffer ("copy" commit: views bound to the live tensors stay valid) over the
    tensors of `module` that `layout` names. Its applied version starts at `version`, so a
    stale version is refused even after a rebuild; its commit waits for `serving_lock`'s
    holders (the worker's requests). A missing or different tensor raises LayoutMismatchError
    naming it."""
    live = live_tensors(module)
    part = {spec.name: live[spec.name] for spec in layout.tensors if spec.name in live}
    try:
        layout.check_state_dict(part)
    except LayoutMismatchError as exc:
        raise LayoutMismatchError(f"{who}: {exc}", exc.parameter) from None
    buffer = _ResumedBuffer(part, layout, version, commit_timeout_s)
    if serving_lock is not None:
        buffer.serving_lock = serving_lock
    return buffer
