"""Non-blocking syncs of a group (`PolicyGroup.sync_weights(block=False)`): the trainers'
snapshot now, the steps and the rolling apply in the background, the newest version first.

A call reserves the next version and tells each trainer that sends in the current plan to take
its snapshot (``sync_snapshot``: the node writer's publish into the node buffer's free slot, a
private copy for a broadcast or CUDA IPC sender); it returns once every trainer queued it, so a
`train` call that follows cannot update the weights before the snapshot is taken (the trainer's
optimizer waits for it). weightsync's `SendPipeline` then runs one sync at a time on a thread of
the driver; a version still waiting when a newer one is snapshotted is skipped (the report of
the version sent lists it). A failure that no caller collected with ``result()`` is raised by
the next sync call of the group.
"""

from __future__ import annotations

import dataclasses
import threading
import time
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

    @property
    def busy(self) -> bool:
        return self.pipeline.busy

    def settle(self, timeout_s: float) -> None:
        """Before a blocking sync: an uncollected failure is raised, then the background drains."""
        self.pipeline.raise_failed()
        self.pipeline.drain(Deadline(timeout_s))

    def senders(self) -> list[tuple[Policy, tuple[str, ...]]]:
        """The trainers the current plan reads weights from, with the snapshot each takes."""
        plan = self.sync.plan
        if plan is None:
            with self.lock:
                plan = self.sync.replan()
        if plan is None:
            raise PolicyGroupError("sync_weights: call init_placement_info() and init_weight_buffer() first")
        by_pid, roster = self.sync.processes.by_pid(), self.sync.roster
        kinds: dict[str, set[str]] = {}
        for call in placement.schedule_calls(plan):
            policy = by_pid.get(call.pid)
            if call.kind in SNAPSHOT_OF and policy is not None and roster.is_trainer(policy):
                kinds.setdefault(call.pid, set()).add(SNAPSHOT_OF[call.kind])
        return [(by_pid[pid], tuple(sorted(k))) for pid, k in sorted(kinds.items())]

    def submit(self) -> PublishHandle[SyncReport | None]:
        """Reserve the next version, have the sending trainers queue its snapshot, and return."""
        config = self.sync.config
        with self._submit:
            self.pipeline.raise_failed()
            version = self.sync.next_version()
            self.sync.reserved = version
            deadline_at = time.time() + config.sync_timeout_s
            senders = self.senders() if self.sync.roster.eval_list else []

            def start(slot: int) -> None:  # each sender has it queued before we return
                args = [(p, (version, slot, list(k), deadline_at)) for p, k in senders]
                self._all("sync_snapshot", args, f"snapshot of v{version}", config.rpc_timeout_s)

            def snapshot(_slot: int) -> None:
                left = max(0.0, deadline_at - time.time())
                args = [(p, (version, left)) for p, _ in senders]
                self._all("wait_snapshot", args, f"snapshot of v{version}", left + 5.0)

            self._asked.append(version)
            return self.pipeline.submit(
                version, Deadline(config.sync_timeout_s), snapshot, lambda _slot: self._send(version), start
            )

    def _all(
        self, method: str, args: list[tuple[Policy, tuple[Any, ...]]], what: str, timeout: float
    ) -> None:
        """`method` on every policy at once, each with its arguments; raise for a failure."""
        calls = [(p, self.calls.invoke(p, method, *a)) for p, a in args]
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
