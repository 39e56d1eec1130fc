"""The soak's faults (see `soak.py`): eval kills inside a sync, trainer faults and the trainer's
recovery, and the exact check of every eval policy's weights after each sync.

Trainer faults (every 50 cycles, 8 in `--quick`; Ray restarts the trainer, the group is rebuilt
over it and the next sync brings every eval policy to its weights):
- "Shared" phase, writer SIGKILLed while publishing into the newest slot: the trainer, writer
  of node0's buffer, publishes one more version that its readers (bound to the previous one)
  do not take, so the newest committed version is unread, then starts the next and is
  SIGKILLed mid-publish; the buffer must still hold the unread version (else a version is lost);
- other phases, SIGTERM of the trainer at a random moment of a sync: its segments must be gone
  once it is.
The third class, a commit that fails after the vote, arms an eval (`soak.py`'s fault points):
its buffer refuses in `prepare_commit` (called before the vote for a buffer a transport commits;
at the swap for a rolling update's staged version), and the next sync must go through.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _soak_policy import KILLABLE, RPC_TIMEOUT_S, SYNC_TIMEOUT_S, TRAINER_FAULTS, log

from rlfleet.policygroup import PolicyGroup, PolicyGroupError
from rlfleet.weightsync import SharedSegment, WeightSyncError
from rlfleet.weightsync.shm._shared_format import SlotTable
from rlfleet.weightsync.shm._shm import segment_creator

CLEAR_ERRORS: tuple[type[BaseException], ...] = (PolicyGroupError, WeightSyncError)


class Hung(Exception):
    """A call passed its deadline without raising a clear error."""


def node_buffer_table(name: str) -> tuple[SharedSegment, SlotTable]:
    """A read-only mapping of node buffer `name`'s slot table (valid after the name is unlinked:
    whoever reclaims a dead writer's segment, the mapping keeps what it held)."""
    segment = SharedSegment.attach(name, readonly=True, map_whole=False)
    try:
        table, _, _ = SlotTable.of(segment)
    except BaseException:
        segment.close()
        raise
    return segment, table


class Faults:
    """Fault injection and checks, mixed into `Soak` (which provides the cluster and the group)."""

    ray: Any
    rng: random.Random
    stats: Counter[str]
    hung: list[str]
    uids: list[str]
    actors: dict[str, Any]
    pids: dict[str, int]
    group: PolicyGroup | None
    points: tuple[str, ...]
    kill_every: int
    trainer_fault_every: int
    trainer_fault_at: int

    def bounded(self, what: str, seconds: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def alive_now(self, name: str, wait: float = 0.0) -> bool:
        raise NotImplementedError

    def refresh_pids(self) -> None:
        raise NotImplementedError

    def names_in_group(self) -> set[str]:
        raise NotImplementedError

    def build_group(self, phase: str) -> None:
        raise NotImplementedError

    def maybe_kill(self, cycle: int) -> threading.Timer | None:
        if cycle % self.kill_every != self.kill_every // 2:
            return None
        members = self.names_in_group()
        candidates = [n for n in KILLABLE if n in members]
        if len(members) < 3 or not candidates:
            return None
        victim = self.rng.choice(candidates)
        point = self.rng.choice(self.points)
        if point == "slow_request":  # not a kill: a request outlasts the rolling update's drain
            self.stats["slow_requests"] += 1
            self.actors[victim].arm.remote(point)
            return None
        self.stats["kills"] += 1
        self.stats[f"kills_at_{point}"] += 1
        if point != "timer":
            self.actors[victim].arm.remote(point)
            return None
        pid = self.pids.get(victim)
        if pid is None:
            return None
        timer = threading.Timer(self.rng.uniform(0.0, 0.3), lambda: os.kill(pid, signal.SIGKILL))
        timer.start()
        return timer

    def trainer_fault_due(self, cycle: int, strategy: str) -> str | None:
        """The trainer fault of this cycle, if one is due: with "Shared" the node's readers are
        bound to a slot, so the writer is killed publishing into the newest; otherwise SIGTERM."""
        if cycle == 0 or cycle % self.trainer_fault_every != self.trainer_fault_at:
            return None
        return TRAINER_FAULTS[0] if strategy == "Shared" else TRAINER_FAULTS[1]

    def segments_of(self, pid: int) -> list[str]:
        """This run's segments created by process `pid`."""
        return [
            p.name
            for p in Path("/dev/shm").iterdir()
            if (segment_creator(p.name) or (0, 0))[0] == pid and p.name.startswith(tuple(self.uids))
        ]

    def sigterm_trainer(self) -> tuple[threading.Timer, int] | None:
        """SIGTERM the trainer at a random moment of the coming sync."""
        pid = self.pids.get("train0")
        if pid is None:
            return None
        self.stats["trainer_faults_sigterm"] += 1
        self.stats["sigterm_segments_held"] += len(self.segments_of(pid))
        timer = threading.Timer(self.rng.uniform(0.0, 0.3), os.kill, (pid, signal.SIGTERM))
        timer.start()
        return timer, pid

    def after_sigterm(self, pid: int) -> None:
        """Once the SIGTERMed trainer is gone, none of its segments may be left."""
        end = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < end:
            time.sleep(0.05)
        gone = not os.path.exists(f"/proc/{pid}")
        left = self.segments_of(pid)
        log(f"trainer (pid {pid}) SIGTERMed: {'gone' if gone else 'STILL RUNNING'}, segments left: {left}")
        self.stats["sigterm_leaked_segments"] += len(left)

    def node_buffer_of_trainer(self) -> str | None:
        """The name of the node buffer the trainer writes in the current group (node0's)."""
        group = self.group
        assert group is not None
        for entry in group.shared_weight_buffer_map.values():
            if entry["writer"] is self.actors["train0"]:
                return str(entry["shared_weight_buffer"]["name"])
        return None

    def kill_writer_mid_publish(self) -> None:
        """The trainer publishes a version its readers leave unread, then dies publishing the
        next; the node buffer must still hold the unread one."""
        group = self.group
        assert group is not None
        name = self.node_buffer_of_trainer()
        if name is None:
            return
        unread = group.weight_version + 1
        self.stats["trainer_faults_writer_publish"] += 1
        segment, table = node_buffer_table(name)
        try:
            ref = self.actors["train0"].publish_into_newest_then_die.remote(unread, unread + 1)
            with contextlib.suppress(self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
                self.ray.get(ref, timeout=RPC_TIMEOUT_S + 4 * SYNC_TIMEOUT_S)
            newest = table.newest_version()
        finally:
            table.detach()
            segment.close()
        log(f"writer killed publishing v{unread + 1}: node buffer holds v{newest} (v{unread} unread before)")
        if newest != unread:
            self.stats["versions_lost"] += 1

    def recover_trainer(self, phase: str) -> None:
        """Wait for Ray to restart the trainer, then rebuild the group over it."""
        old = self.group
        assert old is not None
        end = time.monotonic() + 120
        while not self.alive_now("train0", wait=5.0):
            if time.monotonic() > end:
                self.hung.append("trainer restart (> 120s)")
                raise Hung("trainer restart")
        self.refresh_pids()
        with contextlib.suppress(Hung, *CLEAR_ERRORS, self.ray.exceptions.RayError):
            self.bounded("shutdown after a trainer fault", 60, old.shutdown)
        before = old.weight_version
        self.build_group(phase)
        assert self.group is not None
        log(f"trainer back, group rebuilt at v{self.group.weight_version} (was v{before})")
        if self.group.weight_version < before:
            self.stats["versions_lost"] += 1
        self.stats["trainer_recoveries"] += 1

    def verify(self, cycle: int) -> None:
        group = self.group
        assert group is not None
        for _ in range(3):
            try:
                ok = self.bounded("verify", 2 * RPC_TIMEOUT_S, self._verify_once, group)
            except CLEAR_ERRORS:  # a worker died after the sync (timer kill): drop it, check the rest
                self.bounded("check_liveness", RPC_TIMEOUT_S, group.check_liveness)
                continue
            restarted = [] if ok else self.restarted()
            if restarted:  # killed after the sync and already back, with its initial weights
                for name in restarted:
                    group.remove(self.actors[name], "restarted after a kill; rejoins next cycle")
                continue
            self.stats["verifications"] += 1
            self.stats["verifications_passed"] += int(ok)
            if not ok:
                log(f"cycle {cycle}: VERIFICATION FAILED")
            return
        self.stats["verifications"] += 1
        log(f"cycle {cycle}: verification could not run")

    def restarted(self) -> list[str]:
        """Eval policies of the group whose process changed since their pids were last read."""
        before = dict(self.pids)
        self.refresh_pids()
        members = self.names_in_group()
        return [n for n in sorted(members) if n in before and self.pids.get(n) != before[n]]

    @staticmethod
    def _verify_once(group: PolicyGroup) -> bool:
        versions = group.eval_weight_versions()
        return bool(
            group.verify_eval_weight_checksums() and versions == [group.weight_version] * len(versions)
        )
