"""Membership: workers join or leave a role, trainers and rollout workers trade places, and a
dead rollout worker is dropped.

A converted worker keeps its weights; a rollout worker that becomes a trainer first takes the
training state (model and optimizer) of trainer 0, so data-parallel training stays in step.
Afterwards the group is rebuilt (placement, buffers, groups) and synced once, so every rollout
worker serves the trainers' weights again. A dead rollout worker leaves the roster, routing,
placement and the sync's steps; a dead trainer is an error (its training state is lost).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from rlfleet.policygroup._calls import Calls, Policy, is_dead
from rlfleet.policygroup._errors import PolicyGroupError, TrainWorkerDiedError
from rlfleet.policygroup._rollout import Rollouts
from rlfleet.policygroup._submitter import TaskSubmitter, is_remote
from rlfleet.policygroup._sync import WeightSync
from rlfleet.policygroup._worker import ROLE_NAMES, PolicyRole

logger = logging.getLogger(__name__)


class Membership:
    """push / pop / convert / drop for a group; `rebuild` rebuilds and syncs it after a conversion."""

    def __init__(
        self,
        calls: Calls,
        rollouts: Rollouts,
        sync: WeightSync,
        submitters: Mapping[PolicyRole, TaskSubmitter],
        lock: threading.RLock,
        rebuild: Callable[[], None],
    ) -> None:
        self.calls, self.roster, self.rollouts, self.sync = calls, calls.roster, rollouts, sync
        self.processes = sync.processes
        self.node_of = sync.processes.node_of
        self.submitters = submitters
        self.lock = lock
        self.rebuild = rebuild

    def push(self, policy: Policy, role: PolicyRole) -> None:
        """Add a worker to a role (call the init_* steps again to connect it)."""
        role = PolicyRole(role)
        self.roster.policy_list[role].append(policy)
        if role == PolicyRole.EVAL:
            self.rollouts.add(policy, self.node_of)

    def pop(self, role: PolicyRole) -> Policy:
        role = PolicyRole(role)
        policy = self.roster.policy_list[role].pop()
        if role == PolicyRole.EVAL:
            self.rollouts.remove(policy)
        return policy

    def _last(self, role: PolicyRole, num: int, what: str) -> list[Policy]:
        """The last `num` workers of `role` (at least one must stay)."""
        members = self.roster.policy_list[role]
        if not 0 < num < len(members):
            raise ValueError(
                f"{what}({num}): have {len(members)} {ROLE_NAMES[role]}s, at least one must stay"
            )
        return members[-num:]

    def _take(self, role: PolicyRole, moved: list[Policy]) -> list[Policy]:
        """Take `moved` (the role's last workers) out of `role`."""
        self.roster.policy_list[role] = self.roster.policy_list[role][: -len(moved)]
        for p in moved:
            self.submitters[role].forget(p)
        return moved

    def train_to_eval(self, num: int) -> None:
        """Turn the last `num` trainers into rollout workers."""
        moved = self._take(PolicyRole.TRAIN, self._last(PolicyRole.TRAIN, num, "convert_train_to_eval"))
        base = len(self.roster.eval_list)
        self.calls.call_all(moved, "finalize_async_save")
        for i, p in enumerate(moved):
            self.calls.call_all([p], "set_role", PolicyRole.EVAL.value, base + i)
            self.roster.eval_list.append(p)
            self.calls.call_all([p], "init_eval", None, None)
            self.rollouts.add(p, self.node_of)
        self.rebuild()

    def eval_to_train(self, num: int) -> None:
        """Turn the last `num` rollout workers into trainers, in step with trainer 0."""
        moved = self._last(PolicyRole.EVAL, num, "convert_eval_to_train")
        if not self.roster.train_list:
            raise PolicyGroupError("convert_eval_to_train: no trainer to copy the training state from")
        self.rollouts.drain(moved)
        self._take(PolicyRole.EVAL, moved)
        for p in moved:
            self.rollouts.remove(p)
        state = self.calls.call_all(self.roster.train_list[:1], "get_training_state")[0]
        base = len(self.roster.train_list)
        for i, p in enumerate(moved):
            self.calls.call_all([p], "set_role", PolicyRole.TRAIN.value, base + i)
            self.calls.call_all([p], "init_train", state.get("train_config"), None)
            self.calls.call_all([p], "load_training_state", state)  # model and optimizer in step
            self.roster.train_list.append(p)
        self.rebuild()

    # -- faults -------------------------------------------------------------------------
    def check_liveness(self, timeout: float = 10.0) -> list[str]:
        """Ping every worker; drop dead rollout workers (returned by name); a dead trainer raises."""
        everyone = self.roster.train_list + self.roster.eval_list
        calls = [(p, self.calls.invoke(p, "is_alive")) for p in everyone]
        dropped = []
        for (p, _), (_, err) in zip(calls, self.calls.gather(calls, timeout, "is_alive"), strict=True):
            if is_dead(err):
                if self.roster.is_trainer(p):
                    raise TrainWorkerDiedError(f"{self.roster.name(p)} died: {err}")
                dropped.append(self.roster.name(p))
                self.drop(p, str(err))
        return dropped

    def refresh(self) -> list[str]:
        """Drop rollout workers a task found dead, then any other dead one (Ray actors only)."""
        self.purge_dead()
        return self.check_liveness() if any(is_remote(p) for p in self.roster.eval_list) else []

    def purge_dead(self) -> None:
        if not self.rollouts.dead:
            return
        with self.lock:
            for p in list(self.roster.eval_list):
                if self.roster.wid(p) in self.rollouts.dead:
                    self.drop(p, "its task failed with an actor error")
            self.rollouts.dead.clear()

    def drop(self, policy: Policy, why: str) -> None:
        """Take a rollout worker out of the roster, routing, placement and the sync's steps."""
        with self.lock:
            logger.warning("[PolicyGroup] dropping %s: %s", self.roster.name(policy), why)
            self.roster.policy_list[PolicyRole.EVAL] = [p for p in self.roster.eval_list if p is not policy]
            self.rollouts.remove(policy)
            self.submitters[PolicyRole.EVAL].forget(policy)
            self.processes.drop(policy)
            for entry in self.sync.node_buffers.values():
                entry["eval_policies"] = [p for p in entry["eval_policies"] if p is not policy]
            if self.processes.placement_info:
                strategy = self.sync.config.weight_buffer.buffer_strategy
                self.processes.plan_transfers(strategy)
                self.sync.plan()
                self.sync.dirty = strategy in ("Shared", "Sharded")
