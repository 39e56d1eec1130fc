"""The serving lock: requests see all of version v or all of v+1, never a mix.

A forward pass holds the lock shared (`ServingLock.shared`, or a buffer's ``serving()``); a
commit holds it exclusive while it flips the live tensors. A buffer takes the exclusive hold in
``prepare_commit``, before its receiver votes: a commit then cannot time out behind a stuck
request after every rank agreed on it, and a request stuck past the deadline fails the vote
instead (the sender's error names the rank, every receiver keeps v).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from rlfleet.weightsync._deadline import DEFAULT_SERVING_TIMEOUT_S, Deadline

__all__ = ["ServingLock", "ServingMixin"]


class ServingLock:
    """Many servers at once, or one committer: a writer-preferring readers/writer lock.

    The serving path wraps each forward pass in `shared()`; a commit takes `exclusive()`, so a
    request sees all of v or all of v+1. Do not nest `shared()` in one thread while a commit
    may be waiting (writer preference would make the inner call wait for the commit). Waits
    take a deadline, `DEFAULT_SERVING_TIMEOUT_S` by default. The exclusive hold is not tied to
    a thread: a commit prepared by one thread may be finished or aborted by another.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.contextmanager
    def shared(self, deadline: Deadline | float | None = DEFAULT_SERVING_TIMEOUT_S) -> Iterator[None]:
        deadline = Deadline.coerce(deadline)
        with self._cond:
            deadline.wait(
                self._cond,
                "waiting for a weight commit to finish",
                lambda: not (self._writer or self._waiting_writers),
            )
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, deadline: Deadline | float | None = DEFAULT_SERVING_TIMEOUT_S) -> Iterator[None]:
        self.acquire_exclusive(deadline)
        try:
            yield
        finally:
            self.release_exclusive()

    def acquire_exclusive(self, deadline: Deadline | float | None = DEFAULT_SERVING_TIMEOUT_S) -> None:
        """Wait for in-flight requests to finish and hold the lock (SyncTimeoutError at the deadline)."""
        deadline = Deadline.coerce(deadline)
        with self._cond:
            self._waiting_writers += 1
            try:
                deadline.wait(
                    self._cond,
                    "waiting for in-flight requests before a weight commit",
                    lambda: not (self._writer or self._readers),
                )
            finally:
                self._waiting_writers -= 1
                if not self._waiting_writers:
                    self._cond.notify_all()  # requests held back by this writer may go on
            self._writer = True

    def release_exclusive(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("release_exclusive without a held exclusive lock")
            self._writer = False
            self._cond.notify_all()


class ServingMixin:
    """``serving()`` for a buffer, and the exclusive hold its commit takes (in prepare or commit)."""

    serving_lock: ServingLock
    commit_timeout_s: float | None
    _held = False

    @contextlib.contextmanager
    def serving(self, deadline: Deadline | float | None = DEFAULT_SERVING_TIMEOUT_S) -> Iterator[None]:
        """Hold around a forward pass: a commit waits for it, and it never sees half a version."""
        with self.serving_lock.shared(deadline):
            yield

    def _hold(self, deadline: Deadline) -> None:
        """Take the exclusive lock for a commit, within `commit_timeout_s` and `deadline`."""
        if not self._held:
            self.serving_lock.acquire_exclusive(deadline.child(self.commit_timeout_s))
            self._held = True

    def _let_go(self) -> None:
        if self._held:
            self._held = False
            self.serving_lock.release_exclusive()

    def _prepare(self, version: int, deadline: Deadline) -> None:
        """`BufferBase` hook: the serving lock is what a commit needs."""
        self._hold(deadline)

    def _unprepare(self) -> None:
        self._let_go()

    @contextlib.contextmanager
    def _committing(self) -> Iterator[None]:
        """The exclusive lock around a commit: the one prepare took, else taken now."""
        self._hold(Deadline(None))
        try:
            yield
        finally:
            self._let_go()
