"""Membership: workers join or leave a role, trainers and rollout workers trade places, and a
dead rollout worker is dropped (from the roster, routing and the sync's plan); a dead trainer
is an error, its training state is lost.

A rollout worker that becomes a trainer first takes trainer 0's model and optimizer, so
data-parallel training stays in step; after a conversion the group is rebuilt and synced once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from rlfleet.policygroup._errors import PolicyGroupError, TrainWorkerDiedError
from rlfleet.policygroup._policy import ROLE_NAMES, PolicyRole
from rlfleet.policygroup.driver._calls import Calls, Policy, is_dead
from rlfleet.policygroup.driver._rollout import Rollouts
from rlfleet.policygroup.driver._submitter import TaskSubmitter, is_remote
from rlfleet.policygroup.sync._weight_sync import WeightSync

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
        self.node_of = sync.processes.node_of
        self.submitters, self.lock, self.rebuild = submitters, lock, rebuild

    def push(self, policy: Policy, role: PolicyRole) -> None:
        role = PolicyRole(role)
        with self.lock:
            self.roster.policy_list[role].append(policy)
            if role == PolicyRole.EVAL:
                self.rollouts.add(policy, self.node_of)
            self.sync.plan = None  # re-made (with the newcomer located) when next needed

    def pop(self, role: PolicyRole) -> Policy:
        role = PolicyRole(role)
        with self.lock:
            policy = self.roster.policy_list[role][-1]
            if role == PolicyRole.EVAL:
                self.drop(policy, "popped")
            else:
                self._take(role, 1)
                self.sync.forget(policy)
        self.calls.gather([(policy, self.calls.invoke(policy, "release_weight_buffers"))], 30.0, "pop")
        return policy

    def _take(self, role: PolicyRole, num: int, what: str | None = None) -> list[Policy]:
        """Take the role's last `num` workers out of it (with `what`: at least one must stay)."""
        members = self.roster.policy_list[role]
        if what is not None and not 0 < num < len(members):
            raise ValueError(
                f"{what}({num}): have {len(members)} {ROLE_NAMES[role]}s, at least one must stay"
            )
        moved = members[-num:]
        self.roster.policy_list[role] = members[:-num]
        for p in moved:
            self.submitters[role].forget(p)
        return moved

    def train_to_eval(self, num: int) -> None:
        moved = self._take(PolicyRole.TRAIN, num, "convert_train_to_eval")
        base = len(self.roster.eval_list)
        self.calls.call_all(moved, "finalize_async_save")
        for i, p in enumerate(moved):
            self.calls.call_all([p], "set_role", PolicyRole.EVAL.value, base + i)
            self.roster.eval_list.append(p)
            self.calls.call_all([p], "init_eval", None, None)
            self.rollouts.add(p, self.node_of)
        self.rebuild()

    def eval_to_train(self, num: int) -> None:
        if not self.roster.train_list:
            raise PolicyGroupError("convert_eval_to_train: no trainer to copy the training state from")
        members = self.roster.eval_list
        if 0 < num < len(members):
            self.rollouts.drain(members[-num:])
        moved = self._take(PolicyRole.EVAL, num, "convert_eval_to_train")
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
        """Drop rollout workers a task found dead, then any other dead one (Ray actors only);
        returns the names of those dropped."""
        dropped = self.purge_dead()
        if any(is_remote(p) for p in self.roster.eval_list):
            dropped += self.check_liveness()
        return dropped

    def purge_dead(self) -> list[str]:
        """Drop the rollout workers a task found dead; returns their names."""
        if not self.rollouts.dead:
            return []
        dropped = []
        with self.lock:
            for p in list(self.roster.eval_list):
                if self.roster.wid(p) in self.rollouts.dead:
                    dropped.append(self.roster.name(p))
                    self.drop(p, "its task failed with an actor error")
            self.rollouts.dead.clear()
        return dropped

    def drop(self, policy: Policy, why: str) -> None:
        """Take a rollout worker out of the roster, routing and the sync plan."""
        with self.lock:
            level = logging.INFO if why == "popped" else logging.WARNING
            logger.log(level, "[PolicyGroup] dropping %s: %s", self.roster.name(policy), why)
            self.roster.policy_list[PolicyRole.EVAL] = [p for p in self.roster.eval_list if p is not policy]
            self.rollouts.remove(policy)
            self.submitters[PolicyRole.EVAL].forget(policy)
            self.sync.forget(policy)  # re-planned; the next send rebuilds what changed
