"""A trainer's snapshots for non-blocking syncs: what is sent is the weights of one instant.

`PolicyGroup.sync_weights(block=False)` asks each trainer that sends (`WeightCalls.sync_snapshot`)
for a snapshot of the version: the copy into the node buffer's free slot for the node's writer
(its publish), a private flat copy (weightsync's `WeightSnapshot`, two slots: one a running send
reads, one for the next version) for a broadcast or CUDA IPC sender. The call returns once the
snapshot is queued; a thread takes it, in the order asked, while the trainer goes on with its
next forward and backward. Only a parameter update must wait: `fence` (an optimizer step
pre-hook `BasePolicy` installs) waits for every queued snapshot, so mutating the weights after
it never changes the version sent. The sync's steps read the copy of their version
(`copy_for`); one that was asked for and failed or was overwritten is an error, never the
live weights.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlfleet.weightsync import Deadline, Layout, WeightSnapshot, WeightSyncError

__all__ = ["SNAPSHOT_KINDS", "TrainerSnapshots"]

#: What a trainer's snapshot is: "publish" (into its node buffer: the node writer's copy) and/or
#: "copy" (a private copy a broadcast or CUDA IPC send reads).
SNAPSHOT_KINDS = ("publish", "copy")


@dataclass
class _Job:
    version: int
    slot: int
    kinds: tuple[str, ...]
    deadline: Deadline
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class TrainerSnapshots:
    """Queued snapshots of one trainer, taken by one thread in order; `fence` waits for them."""

    def __init__(self, who: Callable[[], str]) -> None:
        self.who = who
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._jobs: dict[int, _Job] = {}  # version -> its snapshot (the last one of each slot)
        self._worker: threading.Thread | None = None
        self._copies: WeightSnapshot | None = None
        # per asker (a group's token: a trainer actor outlives a group, and the next group counts
        # from 0 again): snapshot requests that arrived, and those the asker says it sent
        self._received: dict[str, int] = {}
        self._expected: dict[str, int] = {}

    def start(
        self,
        version: int,
        slot: int,
        kinds: tuple[str, ...],
        deadline: Deadline,
        model: Callable[[], torch.nn.Module],
        publish: Callable[[int, float], object],
        asker: str = "",
    ) -> None:
        """Queue the snapshot of `version` that `asker` asked for (returns at once; the fence sees
        it from now on)."""
        with self._cond:  # arrived, even if refused below: the fence must not wait for it
            self._received[asker] = self._received.get(asker, 0) + 1
            self._cond.notify_all()
        bad = sorted(set(kinds) - set(SNAPSHOT_KINDS))
        if bad or not kinds:
            raise ValueError(f"{self.who()}: snapshot kinds must be some of {SNAPSHOT_KINDS}, got {kinds!r}")
        if slot not in (0, 1):
            raise ValueError(f"{self.who()}: snapshot slot must be 0 or 1, got {slot!r}")
        job = _Job(int(version), slot, tuple(kinds), deadline)
        with self._cond:
            # the copy in this slot is overwritten now: it can no longer be sent. Only that one:
            # the group's pipeline gives every version that comes while one is being sent the
            # other slot, so the running send's copy stays whatever their number (one job a slot)
            for v in [v for v, j in self._jobs.items() if j.slot == slot]:
                del self._jobs[v]
            self._jobs[job.version] = job
            self._queue.append(job)
            if self._worker is None:
                name = f"{self.who()}-snapshots"
                self._worker = threading.Thread(
                    target=self._run, args=(model, publish), name=name, daemon=True
                )
                self._worker.start()

    def _run(self, model: Callable[[], torch.nn.Module], publish: Callable[[int, float], object]) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._worker = None
                    self._cond.notify_all()
                    return
                job = self._queue[0]
            try:
                self._take(job, model(), publish)
            except BaseException as exc:
                job.error = exc
            with self._cond:
                self._queue.popleft()
                job.done.set()
                self._cond.notify_all()

    def _take(self, job: _Job, module: torch.nn.Module, publish: Callable[[int, float], object]) -> None:
        job.deadline.check(f"{self.who()}: snapshot of v{job.version}")
        if "copy" in job.kinds:
            if self._copies is None:
                self._copies = WeightSnapshot(Layout.from_state_dict(module.state_dict()))
            with torch.no_grad():
                self._copies.take(job.slot, module.state_dict(), deadline=job.deadline)
        if "publish" in job.kinds:  # the node writer's snapshot is its publish (a free slot)
            publish(job.version, job.deadline.remaining_or(1e9))

    # -- the sync's side -----------------------------------------------------------------
    def wait(self, version: int, deadline: Deadline) -> bool:
        """Wait for the snapshot of `version` and raise its error; False if none was asked for."""
        with self._cond:
            job = self._jobs.get(version)
        if job is None:
            return False
        deadline.wait(job.done, f"{self.who()}: waiting for the snapshot of v{version}")
        if job.error is not None:
            raise WeightSyncError(
                f"{self.who()}: the snapshot of v{version} failed: {job.error}"
            ) from job.error
        return True

    def copy_for(self, version: int, deadline: Deadline) -> dict[str, torch.Tensor] | None:
        """The private copy a send of `version` reads; None when no snapshot of it was asked
        for (a blocking sync: the live weights are that version)."""
        with self._cond:
            job = self._jobs.get(version)
            newer = [v for v in self._jobs if v > version]
        if job is None:
            if newer:  # a non-blocking sync asked for it, and a newer snapshot took its slot
                raise WeightSyncError(
                    f"{self.who()}: the snapshot of v{version} was overwritten by v{max(newer)}: it is "
                    "no longer sendable"
                )
            return None
        self.require(version, "copy")
        self.wait(version, deadline)
        assert self._copies is not None
        return self._copies.state_dict(job.slot)

    def require(self, version: int, kind: str) -> bool:
        """True if a snapshot of `version` was asked for and is of `kind`; False if none was;
        an error if it is of another kind (the sync plan changed since it was taken)."""
        with self._cond:
            job = self._jobs.get(version)
        if job is None:
            return False
        if kind not in job.kinds:
            raise WeightSyncError(
                f"{self.who()}: the snapshot of v{version} is {'/'.join(job.kinds)}, and the sync now "
                f"needs a {kind} (the sync plan changed since it was taken): sync again"
            )
        return True

    def expect(self, asked: int, asker: str = "") -> None:
        """`asker` asked `asked` snapshots so far: the fence also waits for those not arrived."""
        with self._cond:
            self._expected[asker] = max(self._expected.get(asker, 0), asked)

    def _missing(self) -> int:
        """Snapshots asked for that have not arrived (caller holds the lock)."""
        return sum(max(0, n - self._received.get(a, 0)) for a, n in self._expected.items())

    def fence(self, deadline: Deadline) -> None:
        """Wait until every snapshot asked for arrived and was taken (before changing the weights)."""
        with self._cond:
            expected = sum(self._expected.values())
            deadline.wait(
                self._cond,
                f"{self.who()}: waiting for weight snapshots ({expected - self._missing()} of "
                f"{expected} arrived)",
                lambda: not self._queue and not self._missing(),
            )

    @property
    def pending(self) -> int:
        """Snapshots queued or asked for and not arrived yet."""
        with self._cond:
            return len(self._queue) + self._missing()

    def release(self) -> None:
        with self._cond:
            self._jobs.clear()
            if self._copies is not None and not self._queue:
                self._copies.release()
