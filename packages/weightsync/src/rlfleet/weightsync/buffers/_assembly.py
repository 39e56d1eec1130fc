"""One version assembled from several senders, each sending a disjoint share of the buckets.

When several trainers hold the full weights (data-parallel replicas), each sends a share of
the buckets in its own broadcast group (``BroadcastSender.send(..., buckets=share)``), and a
receiver runs one ``receive(assembly.part(sender), buckets=share)`` per sender, typically in
threads, into one `Assembly` over its real consumer (a weight buffer).

The two-phase commit spans the senders: a part's ``prepare_commit`` (called by its receive
just before the rank votes in that sender's group) waits until every part has all of its
buckets, then prepares the inner consumer once; so a receiver votes yes in any group only
when the whole version arrived, was verified and can be committed. A part that fails (its
sender died, a checksum, a missing bucket) fails the version in every part, and the receiver
votes no in every group: every receiver keeps the previous version. When the last part's
group has voted yes, the inner consumer commits.

Every share of one version carries that version: a part that announces another version than
the one pending (sender a sends v5, sender b v6) is refused with a `VersionError` naming both,
and the pending version fails in every part, so no receiver commits a mix and every sender is
told. A `SharesReceiver` makes one assembly per receive (``once=True``): there, every part
must announce the first part's version, and once that version could not begin the other parts
fail at once.

One window stays, as in any two-phase commit: if a sender dies after another sender's group
committed (every rank had voted yes there, so every bucket of every share had arrived and
was verified), the assembly commits rather than aborts, so that a receiver never drops a
version a sender was told it applied.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import torch

from rlfleet.weightsync._deadline import DEFAULT_SYNC_TIMEOUT_S, Deadline
from rlfleet.weightsync._errors import (
    IncompleteSyncError,
    MetadataError,
    SyncAbortedError,
    SyncTimeoutError,
    VersionError,
)
from rlfleet.weightsync.codec._delta_state import DeltaBase, base_pieces_of
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._core import consumer_error
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.protocol._wire_base import BucketTarget, TensorTarget

__all__ = ["Assembly", "AssemblyPart"]

_log = logging.getLogger(__name__)


def _check_shares(layout: Layout, shares: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Shares by sender, sorted; ValueError unless they are disjoint and cover the layout."""
    if not isinstance(shares, Mapping) or not shares:
        raise ValueError("an assembly needs a mapping of at least one sender to its share of buckets")
    count = len(layout.buckets)
    owner: dict[int, str] = {}
    out: dict[str, tuple[int, ...]] = {}
    for sender, share in shares.items():
        if not isinstance(sender, str) or not sender:
            raise ValueError(f"sender ids must be non-empty strings, got {sender!r}")
        if isinstance(share, (str, bytes)) or not isinstance(share, Sequence):
            raise ValueError(f"sender {sender!r}: its share must be a sequence of bucket indices")
        for index in share:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
                raise ValueError(
                    f"sender {sender!r}: {index!r} is not a bucket of the layout ({count} buckets)"
                )
            if index in owner:
                raise ValueError(f"bucket {index} is in the shares of both {owner[index]!r} and {sender!r}")
            owner[index] = sender
        out[sender] = tuple(sorted(share))
    uncovered = [i for i in range(count) if i not in owner]
    if uncovered:
        raise ValueError(f"the shares leave buckets {uncovered} to no sender")
    return out


class Assembly:
    """Several senders' shares of one version, committed into `inner` all together or not at all.

    `shares` maps a sender id to the bucket indices it sends; they must be disjoint and cover
    `inner`'s layout. `part(sender)` is the consumer that sender's receive feeds. The version
    commits when every part's group has voted yes; `commit(version)` (or `prepare_commit`)
    checks it explicitly and raises `IncompleteSyncError` naming the senders whose buckets are
    missing. An abort of any part aborts `inner`: the previous version stays applied. Parts
    announcing different versions fail the pending one (`VersionError`); ``once=True`` makes the
    assembly take a single version (one receive): every part must announce the first one's.
    """

    def __init__(
        self, inner: BucketConsumer, shares: Mapping[str, Sequence[int]], *, once: bool = False
    ) -> None:
        self.inner = inner
        self.layout: Layout = inner.layout
        self.shares = _check_shares(inner.layout, shares)
        self.once = once
        self._cond = threading.Condition()
        self._inner_lock = threading.RLock()  # every call into `inner`, one at a time
        self._pending: int | None = None
        self._failure: BaseException | None = None
        self._received: dict[str, set[int]] = {s: set() for s in self.shares}
        self._committed: set[str] = set()
        self._active: set[str] = set()  # parts in the pending version that have not ended
        self._ended: set[str] = set()  # parts that took part in it and ended (or never began)
        self._announced: tuple[str, int] | None = None  # once: the first part's version
        self._prepare_state = "no"  # "no" | "running" | "done"
        self._parts = {s: AssemblyPart(self, s) for s in self.shares}

    @property
    def version(self) -> int:
        """The version applied in `inner`."""
        return self.inner.version

    def part(self, sender: str) -> AssemblyPart:
        """The consumer for `sender`'s share (the same object on every call)."""
        try:
            return self._parts[sender]
        except KeyError:
            raise ValueError(
                f"sender {sender!r} has no share in this assembly ({sorted(self._parts)})"
            ) from None

    # -- what the parts call ---------------------------------------------------------------
    def _begin(self, sender: str, version: int) -> None:
        with self._cond:
            self._check_once(sender, version)
            if self._pending is not None and not self._new_round(sender, version):
                if self._failure is not None:
                    raise SyncAbortedError(
                        f"version {version} already failed in another part: {self._failure}"
                    )
                self._active.add(sender)
                return
            if self._pending is not None and self._failure is None:
                _log.warning(
                    "assembly: version %d begins while %d was pending; dropping it", version, self._pending
                )
                self._abort_inner(
                    SyncAbortedError(f"version {version} began before {self._pending} completed")
                )
            self._received = {s: set() for s in self.shares}
            self._committed, self._prepare_state = set(), "no"
            self._pending, self._failure = version, None
            self._active, self._ended = set(), {sender}
            try:
                with self._inner_lock:
                    self.inner.begin(version)
            except BaseException as exc:  # the other parts of this version fail at once
                self._failure = exc
                raise
            self._ended.discard(sender)
            self._active.add(sender)

    def _new_round(self, sender: str, version: int) -> bool:
        """Whether `sender`'s part starts a new version rather than joining the pending one.

        A sender takes part in a version once: one that took part and ended has moved on (a new
        version, once no other part is still in the pending one). A part joining announces the
        pending version, or starts the next one when the pending one failed and no part is left
        in it; any other version is a mismatch: VersionError, and the pending version fails.
        """
        others = sorted(self._active - {sender})
        if sender in self._active and version == self._pending and self._failure is not None:
            return False  # the same part again, before it ended: the failed version stays failed
        if sender in self._active or sender in self._ended:
            if others:
                raise self._mismatch(sender, version, others[0])
            return True
        if version == self._pending:
            return False
        if self._failure is not None and not others:
            return True
        someone = [*others, *sorted(self._ended - {sender})] or ["(another part)"]
        raise self._mismatch(sender, version, someone[0])

    def _check_once(self, sender: str, version: int) -> None:
        """`once`: every part announces the version the first part announced."""
        if not self.once:
            return
        if self._announced is None:
            self._announced = (sender, version)
        elif self._announced[1] != version:
            raise self._mismatch(sender, version, *self._announced)

    def _mismatch(self, sender: str, version: int, other: str, theirs: int | None = None) -> VersionError:
        """The pending version fails: `sender` announces `version`, `other` another one."""
        theirs = self._pending if theirs is None else theirs
        error = VersionError(
            f"sender {sender!r} announces version {version} while sender {other!r}'s share is of "
            f"version {theirs}: every share of one version must carry that version; neither is applied"
        )
        self._fail(error)
        return error

    def _check_pending(self, sender: str, version: int | None = None) -> int:
        if self._pending is None or (version is not None and version != self._pending):
            raise VersionError(
                f"sender {sender!r}: version {version}, but the assembly's pending version is {self._pending}"
            )
        if self._failure is not None:
            raise SyncAbortedError(f"version {self._pending} cannot be assembled: {self._failure}")
        return self._pending

    def _consume(self, sender: str, index: int, data: torch.Tensor) -> None:
        with self._cond:
            self._check_pending(sender)
            if sender not in self._active:
                raise SyncAbortedError(
                    f"bucket {index} from sender {sender!r}, whose part did not begin version {self._pending}"
                )
            if index not in self.shares[sender]:
                raise MetadataError(
                    f"bucket {index!r} is not in sender {sender!r}'s share {list(self.shares[sender])}"
                )
            if index in self._received[sender]:
                raise MetadataError(f"bucket {index} arrived twice from sender {sender!r}")
        with self._inner_lock:
            self.inner.consume(index, data)
        with self._cond:
            self._received[sender].add(index)
            self._cond.notify_all()

    def _missing(self) -> dict[str, list[int]]:
        return {
            s: [i for i in share if i not in self._received[s]]
            for s, share in self.shares.items()
            if any(i not in self._received[s] for i in share)
        }

    def _incomplete(self, version: int) -> IncompleteSyncError:
        words = "; ".join(f"sender {s!r} is missing buckets {m}" for s, m in sorted(self._missing().items()))
        return IncompleteSyncError(f"version {version} is incomplete: {words}")

    def _prepare_part(self, sender: str, version: int, deadline: Deadline) -> None:
        """Wait until every part has all its buckets, then prepare `inner` once."""
        with self._cond:
            self._check_pending(sender, version)
            if self._received[sender] != set(self.shares[sender]):
                error = self._incomplete(version)
                self._fail(error)
                raise error
            try:
                deadline.wait(
                    self._cond, "assembly", lambda: self._failure is not None or not self._missing()
                )
            except SyncTimeoutError:
                error = self._incomplete(version)
                self._fail(error)
                raise error from None
            self._check_pending(sender, version)
        self._prepare_inner(version, deadline)

    def _prepare_inner(self, version: int, deadline: Deadline) -> None:
        with self._cond:
            while self._prepare_state == "running":
                deadline.wait(self._cond, "the assembly's prepare in another part")
            self._check_pending("", version)
            if self._prepare_state == "done":
                return
            self._prepare_state = "running"
        error: BaseException | None = None
        hook = getattr(self.inner, "prepare_commit", None)
        try:
            if hook is not None:
                with self._inner_lock:
                    hook(version, deadline)
        except Exception as exc:
            error = consumer_error(
                exc, f"version {version}: the assembled consumer could not prepare its commit"
            )
        with self._cond:
            self._prepare_state = "no" if error is not None else "done"
            if error is not None:
                self._fail(error)
            self._cond.notify_all()
        if error is not None:
            raise error

    def _commit_part(self, sender: str, version: int) -> None:
        with self._cond:
            self._check_pending(sender, version)
            self._committed.add(sender)
            if self._committed != set(self.shares):
                return
        self.commit(version)

    def _abort_part(self, sender: str, error: BaseException) -> None:
        with self._cond:
            if self._pending is None:
                return
            if sender in self._active:
                self._active.discard(sender)
                self._ended.add(sender)
            if self._committed and self._prepare_state == "done" and not self._missing():
                version = self._pending
                _log.warning(
                    "assembly: sender %r failed after the group of %s committed version %d; every bucket had "
                    "arrived and was verified: committing it (%s)",
                    sender,
                    sorted(self._committed),
                    version,
                    error,
                )
            else:
                self._fail(
                    SyncAbortedError(f"sender {sender!r}'s part failed: {type(error).__name__}: {error}")
                )
                return
        self.commit(version)

    def _fail(self, error: BaseException) -> None:
        """The pending version failed: every part now refuses it, and `inner` drops it."""
        with self._cond:
            if self._failure is None and self._pending is not None:
                self._failure = error
                self._abort_inner(error)
            self._cond.notify_all()

    def _abort_inner(self, error: BaseException) -> None:
        with self._inner_lock:
            try:
                self.inner.abort(error)
            except Exception:
                _log.exception("assembly: inner.abort failed")

    # -- the assembly as a whole -----------------------------------------------------------
    def prepare_commit(
        self, version: int, deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S
    ) -> None:
        """Prepare `inner` for `version`; IncompleteSyncError naming the senders whose buckets are missing."""
        with self._cond:
            self._check_pending("(assembly)", version)
            if self._missing():
                error = self._incomplete(version)
                self._fail(error)
                raise error
        self._prepare_inner(version, Deadline.coerce(deadline))

    def commit(self, version: int) -> None:
        """Commit `version` in `inner` (a no-op once applied); IncompleteSyncError if a share is missing."""
        with self._cond:
            if self._pending is None and self.inner.version == version:
                return
            self._check_pending("(assembly)", version)
            if self._missing():
                error = self._incomplete(version)
                self._fail(error)
                raise error
        self._prepare_inner(version, Deadline(DEFAULT_SYNC_TIMEOUT_S))
        with self._cond, self._inner_lock:
            self._check_pending("(assembly)", version)
            self.inner.commit(version)
            self._pending = None
            self._active, self._ended = set(), set()
            self._cond.notify_all()

    def abort(self, error: BaseException) -> None:
        """Drop the pending version in every part and in `inner`."""
        self._fail(error)


class AssemblyPart:
    """The `BucketConsumer` of one sender's share: it takes only that share's buckets, and its
    commit only marks the share complete (the assembly commits `inner` once every share is)."""

    def __init__(self, assembly: Assembly, sender: str) -> None:
        self.assembly = assembly
        self.sender = sender
        self.share = assembly.shares[sender]
        self.layout: Layout = assembly.layout

    @property
    def version(self) -> int:
        return self.assembly.version

    def begin(self, version: int) -> None:
        self.assembly._begin(self.sender, version)

    def consume(self, index: int, data: torch.Tensor) -> None:
        self.assembly._consume(self.sender, index, data)

    def bucket_target(self, index: int) -> torch.Tensor | None:
        inner = self.assembly.inner
        if index not in self.share or not isinstance(inner, BucketTarget):
            return None
        with self.assembly._inner_lock:
            return inner.bucket_target(index)

    def tensor_target(self, name: str) -> torch.Tensor | None:
        inner = self.assembly.inner
        if name not in self.layout or self.layout[name].bucket not in self.share:
            return None
        if not isinstance(inner, TensorTarget):
            return None
        with self.assembly._inner_lock:
            return inner.tensor_target(name)

    @property
    def takes_deltas(self) -> bool:
        """Whether `inner` can rebuild a delta of this share on its applied version."""
        inner = self.assembly.inner
        return isinstance(inner, DeltaBase) and bool(getattr(inner, "takes_deltas", True))

    def copy_base(self, index: int, out: torch.Tensor) -> bool:
        """Bucket `index` (of this share) of the applied version: a delta's base."""
        inner = self.assembly.inner
        if index not in self.share or not isinstance(inner, DeltaBase):
            return False
        with self.assembly._inner_lock:
            return inner.copy_base(index, out)

    def base_pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        """`copy_base`'s bytes without the copy, when the inner consumer offers them."""
        if index not in self.share:
            return None
        with self.assembly._inner_lock:
            return base_pieces_of(self.assembly.inner, index)

    def prepare_commit(
        self, version: int, deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S
    ) -> None:
        self.assembly._prepare_part(self.sender, version, Deadline.coerce(deadline))

    def commit(self, version: int) -> None:
        self.assembly._commit_part(self.sender, version)

    def abort(self, error: BaseException) -> None:
        self.assembly._abort_part(self.sender, error)

    def __repr__(self) -> str:
        return f"AssemblyPart({self.sender!r}, buckets={list(self.share)})"
