"""One version received from several senders, and where a receive spends its time.

`SharesReceiver` is a transport receiver (``receive(consumer, deadline)``, what an endpoint
takes) over one broadcast receiver per sender with that sender's share of the buckets. One part
is received in the caller's thread; several run in threads of their own into an `Assembly`, so
the version commits only when every bucket from every sender arrived and was verified, and a
sender that fails leaves the previous version applied (unless it failed after another
sender's group committed: every bucket had arrived and was verified, so the version is
committed and the receive succeeds, as `Assembly` documents). `TimedConsumer`
wraps the endpoint's consumer and records the receiver's own phases: begin (a node buffer's
writer waits there for its readers), the buckets it consumed (land) and its commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["SharesReceiver", "TimedConsumer"]

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import SyncAbortedError
from rlfleet.weightsync.buffers._assembly import Assembly
from rlfleet.weightsync.buffers._consumers import takes_deltas
from rlfleet.weightsync.codec._delta_state import DeltaBase, base_pieces_of
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._protocol import BucketConsumer


def _landing(inner: BucketConsumer, hook: str, key: object) -> torch.Tensor | None:
    """Where `inner` wants the transport to land `key` (its landing hook), if it has one."""
    target = getattr(inner, hook, None)
    if target is None:
        return None
    landed: torch.Tensor | None = target(key)
    return landed


class TimedConsumer:
    """A `BucketConsumer` around `inner` that records the seconds spent in each of its calls."""

    def __init__(self, inner: BucketConsumer) -> None:
        self.inner = inner
        self.layout: Layout = inner.layout
        self.begin_s = self.commit_s = 0.0
        self.consume_s: dict[int, float] = {}  # bucket -> seconds in its consume
        self.committed: int | None = None  # the version `inner` committed
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.inner.version

    def begin(self, version: int) -> None:
        start = time.perf_counter()
        try:
            self.inner.begin(version)
        finally:
            self.begin_s += time.perf_counter() - start

    def consume(self, index: int, data: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            self.inner.consume(index, data)
        finally:
            with self._lock:
                self.consume_s[index] = self.consume_s.get(index, 0.0) + time.perf_counter() - start

    def bucket_target(self, index: int) -> torch.Tensor | None:
        return _landing(self.inner, "bucket_target", index)

    def tensor_target(self, name: str) -> torch.Tensor | None:
        return _landing(self.inner, "tensor_target", name)

    @property
    def takes_deltas(self) -> bool:
        """Whether `inner` can rebuild a delta on its applied version (`codec.DeltaBase`)."""
        return takes_deltas(self.inner)

    def copy_base(self, index: int, out: torch.Tensor) -> bool:
        return isinstance(self.inner, DeltaBase) and self.inner.copy_base(index, out)

    def base_pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        return base_pieces_of(self.inner, index)

    def prepare_commit(self, version: int, deadline: Deadline) -> None:
        prepare = getattr(self.inner, "prepare_commit", None)
        if prepare is None:
            return
        start = time.perf_counter()
        try:
            prepare(version, deadline)
        finally:
            self.commit_s += time.perf_counter() - start

    def commit(self, version: int) -> None:
        start = time.perf_counter()
        try:
            self.inner.commit(version)
            self.committed = version
        finally:
            self.commit_s += time.perf_counter() - start

    def abort(self, error: BaseException) -> None:
        self.inner.abort(error)


_log = logging.getLogger(__name__)

Part = tuple[str, Any, Sequence[int] | None]  # (sender id, its BroadcastReceiver, its buckets)


class SharesReceiver:
    """Receives one version from every sender of `parts` into one consumer (a transport)."""

    def __init__(self, parts: Sequence[Part]) -> None:
        if not parts:
            raise ValueError("a receive needs at least one sender")
        self.parts = list(parts)
        self.timed: TimedConsumer | None = None
        self.spans: dict[str, tuple[float, float]] = {}

    def receive(self, consumer: BucketConsumer, deadline: Deadline | float | None = None) -> int:
        deadline = Deadline.coerce(deadline)
        self.timed = timed = TimedConsumer(consumer)
        if len(self.parts) == 1:
            sender, receiver, buckets = self.parts[0]
            return self._one(sender, receiver, timed, buckets, deadline)
        shares = {s: list(b) if b is not None else [] for s, _, b in self.parts}
        assembly = Assembly(timed, shares, once=True)  # one receive, one version from every sender
        errors: list[BaseException] = []
        versions: list[int] = []

        def run(sender: str, receiver: Any, buckets: Sequence[int] | None) -> None:
            try:
                versions.append(self._one(sender, receiver, assembly.part(sender), buckets, deadline))
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=part, name=f"rlfleet-recv-{part[0]}", daemon=True)
            for part in self.parts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # each receive ends by the deadline
        if errors and timed.committed is None:  # the cause first: a part failed because another did
            raise min(errors, key=lambda e: isinstance(e, SyncAbortedError))
        if errors:  # every bucket of every share had arrived and was verified, a group had committed
            _log.warning(
                "version %s committed although a sender failed after its vote: %s", timed.committed, errors
            )
        return versions[0] if versions else int(timed.committed or 0)

    def _one(
        self, sender: str, receiver: Any, consumer: Any, buckets: Sequence[int] | None, deadline: Deadline
    ) -> int:
        start = time.time()
        try:
            result = receiver.receive(consumer, deadline, buckets=None if buckets is None else list(buckets))
        finally:
            self.spans[sender] = (start, time.time())
        return int(result if isinstance(result, int) else result.version)

    def phases(self) -> dict[str, float]:
        """The receiver's own phases over the whole version."""
        t = self.timed
        if t is None:
            return {}
        return {"wait_readers": t.begin_s, "land": sum(t.consume_s.values()), "commit": t.commit_s}

    def part_phases(self) -> dict[str, dict[str, float]]:
        """Per sender: its part's span (t0, t1) and the land of its buckets."""
        t = self.timed
        out: dict[str, dict[str, float]] = {}
        for sender, _, buckets in self.parts:
            t0, t1 = self.spans.get(sender, (0.0, 0.0))
            land = 0.0
            if t is not None:
                land = sum(v for k, v in t.consume_s.items() if buckets is None or k in buckets)
            out[sender] = {"t0": t0, "t1": t1, "land": land, "commit": 0.0 if t is None else t.commit_s}
        return out
