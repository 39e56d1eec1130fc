"""Non-blocking syncs of a group (`PolicyGroup.sync_weights(block=False)`): the trainers'
snapshot now, the steps and the rolling apply in the background, the newest version first.

A call reserves the next version and tells each trainer that sends in the current plan to take
its snapshot (``sync_snapshot``: the node writer's publish into the node buffer's free slot, a
private copy for a broadcast or CUDA IPC sender), and returns without waiting for an answer.
The group counts the snapshots it asked of each trainer and its next `train` call says how many
(`asked`, with the group's token: a trainer actor may serve one group after another, each
counting from 0): the trainer's optimizer waits until that many of the group's arrived and were
taken, so an update never lands in a snapshot, whatever order Ray delivers the two calls in. weightsync's
`SendPipeline` then runs one sync at a time on a thread of the driver; a version still waiting
when a newer one is snapshotted is skipped (the report of the version sent lists it), unless a
node writer's snapshot already committed it to its node buffer: then each is synced in turn and
the node's readers skip ahead at their swap (they bind the newest version there). A failure
that no caller collected with ``result()`` is raised by the next sync call of the group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from rlfleet import placement
from rlfleet.placement import SyncReport
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.policygroup.driver._calls import Calls, Policy
from rlfleet.policygroup.sync._weight_sync import WeightSync
from rlfleet.weightsync import Deadline, PublishHandle, SendPipeline

#: A plan's call kinds that read a trainer's weights, and the snapshot each needs.
SNAPSHOT_OF = {"publish": "publish", "send": "copy", "ipc_send": "copy"}


class BackgroundSyncs:
    """The group's non-blocking syncs: `submit` returns a `PublishHandle` of the `SyncReport`."""

    def __init__(
        self, sync: WeightSync, calls: Calls, lock: threading.RLock, run: Callable[[int], Any]
    ) -> None:
        """`run(version)`: the group's blocking sync of `version` (steps, then rolling apply)."""
        self.sync, self.calls, self.lock, self.run = sync, calls, lock, run
        self.pipeline: SendPipeline[SyncReport | None] = SendPipeline("policy group sync")
        self._submit = threading.Lock()  # one version reserved and snapshotted at a time
        self._asked: list[int] = []  # versions snapshotted, not sent yet
        self._counts: dict[Any, int] = {}  # snapshots asked of each trainer (by worker id)
        # our token on the trainers: their counts of an earlier group's snapshots are not ours
        self.asker = uuid.uuid4().hex
        self._senders: tuple[Any, list[tuple[Policy, tuple[str, ...]]]] | None = None  # per plan

    @property
    def busy(self) -> bool:
        return self.pipeline.busy

    def quiesce(self, timeout_s: float) -> None:
        """Let the background syncs finish, their failures left to their handles (shutdown)."""
        with contextlib.suppress(TimeoutError):
            self.pipeline.drain(Deadline(timeout_s))

    def settle(self, timeout_s: float) -> None:
        """Before a blocking sync: an uncollected failure is raised, then the background drains."""
        self.pipeline.raise_failed()
        self.pipeline.drain(Deadline(timeout_s))

    def asked(self, policy: Policy) -> tuple[str, int] | None:
        """Our token and how many snapshots we asked of trainer `policy` (None: none, the
        blocking syncs only)."""
        with self._submit:
            count = self._counts.get(self.sync.roster.wid(policy))
        return None if count is None else (self.asker, count)

    def senders(self) -> list[tuple[Policy, tuple[str, ...]]]:
        """The trainers the current plan reads weights from, with the snapshot each takes."""
        plan = self.sync.plan
        if plan is None:
            with self.lock:
                plan = self.sync.replan()
        if plan is None:
            raise PolicyGroupError("sync_weights: call init_placement_info() and init_weight_buffer() first")
        if self._senders is not None and self._senders[0] is plan:
            return self._senders[1]
        by_pid, roster = self.sync.processes.by_pid(), self.sync.roster
        kinds: dict[str, set[str]] = {}
        for call in placement.schedule_calls(plan):
            policy = by_pid.get(call.pid)
            if call.kind in SNAPSHOT_OF and policy is not None and roster.is_trainer(policy):
                kinds.setdefault(call.pid, set()).add(SNAPSHOT_OF[call.kind])
        found = [(by_pid[pid], tuple(sorted(k))) for pid, k in sorted(kinds.items())]
        self._senders = (plan, found)
        return found

    def submit(self) -> PublishHandle[SyncReport | None]:
        """Reserve the next version, have the sending trainers queue its snapshot, and return."""
        config = self.sync.config
        with self._submit:
            self.pipeline.raise_failed()
            version = self.sync.next_version()
            self.sync.reserved = version
            deadline_at = time.time() + config.sync_timeout_s
            senders = self.senders() if self.sync.roster.eval_list else []

            asks: list[tuple[Policy, Any]] = []

            def start(slot: int) -> None:  # asked, not waited for: `train` passes the count on
                for p, kinds in senders:
                    ask = (version, slot, list(kinds), deadline_at, self.asker)
                    asks.append((p, self.calls.invoke(p, "sync_snapshot", *ask)))
                    wid = self.sync.roster.wid(p)
                    self._counts[wid] = self._counts.get(wid, 0) + 1

            def snapshot(_slot: int) -> None:
                left = max(0.0, deadline_at - time.time())
                self._check(asks, f"snapshot of v{version}", left + 5.0)
                waits = [(p, self.calls.invoke(p, "wait_snapshot", version, left)) for p, _ in senders]
                self._check(waits, f"snapshot of v{version}", left + 5.0)

            self._asked.append(version)
            # eager: the steps begin at once (liveness, wiring, the plan's calls overlap the
            # copy); a trainer's step reads its snapshot only once it is taken. A node writer's
            # snapshot commits the version in the node buffer: every such version is then applied
            # in turn (its readers take the newest there), or a writer could wait for a free slot
            # that only the apply of the very version it writes would free
            return self.pipeline.submit(
                version,
                Deadline(config.sync_timeout_s),
                snapshot,
                lambda _slot: self._send(version),
                start,
                eager=True,
                coalesce=not any("publish" in kinds for _, kinds in senders),
            )

    def _check(self, calls: list[tuple[Policy, Any]], what: str, timeout: float) -> None:
        """Wait for `calls` (bounded) and raise for a failure, a dead trainer first."""
        results = self.calls.gather(calls, timeout, what)
        self.calls.raise_failures([p for p, _ in calls], results, what)

    def _send(self, version: int) -> SyncReport | None:
        """The pipeline's send: the whole sync of `version`; its report lists what it skipped."""
        with self._submit:
            skipped = tuple(v for v in self._asked if v < version)
            self._asked = [v for v in self._asked if v > version]
        with self.lock:
            report: SyncReport | None = self.run(version)
            if report is not None and skipped:
                report = dataclasses.replace(report, skipped_versions=skipped)
                self.sync.report = report
                if self.sync.last is not None:
                    self.sync.last = dataclasses.replace(self.sync.last, report=report)
        return report
