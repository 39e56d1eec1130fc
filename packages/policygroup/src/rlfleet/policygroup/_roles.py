"""Role changes: workers join or leave a role, and trainers and rollout workers trade places.

A converted worker keeps its weights; a rollout worker that becomes a trainer first takes the
training state (model and optimizer) of trainer 0, so data-parallel training stays in step.
Afterwards the group is rebuilt (placement, buffers, groups) and synced once, so every rollout
worker serves the trainers' weights again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

from rlfleet.policygroup._calls import Calls, Policy
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.policygroup._rollout import Rollouts
from rlfleet.policygroup._submitter import TaskSubmitter
from rlfleet.policygroup._worker import ROLE_NAMES, PolicyRole


class RoleChanges:
    """push / pop / convert for a group; `rebuild` rebuilds and syncs it afterwards."""

    def __init__(
        self,
        calls: Calls,
        rollouts: Rollouts,
        submitters: Mapping[PolicyRole, TaskSubmitter],
        node_of: Mapping[Hashable, Any],
        rebuild: Callable[[], None],
    ) -> None:
        self.calls, self.roster, self.rollouts = calls, calls.roster, rollouts
        self.submitters = submitters
        self.node_of = node_of
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
