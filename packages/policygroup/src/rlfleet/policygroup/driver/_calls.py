"""The group's roster and its calls on workers (local objects or Ray actors): bounded, and
failures classified into the error that says it best: a dead trainer (`TrainWorkerDiedError`)
before anything its peers report because of it, a dead rollout worker (`WorkerDiedError`), a
call that did not finish (`TaskTimeoutError`), or the worker's own error.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ray

from rlfleet.policygroup._errors import (
    PolicyGroupError,
    TaskTimeoutError,
    TrainWorkerDiedError,
    WorkerDiedError,
)
from rlfleet.policygroup._policy import ROLE_NAMES, PolicyRole
from rlfleet.policygroup.driver._submitter import actor_key, is_remote
from rlfleet.weightsync import LayoutMismatchError

Policy = Any  # BasePolicy | ray.actor.ActorHandle
Outcome = tuple[Any, BaseException | None]  # (value, error) of one call


def cause(exc: BaseException) -> BaseException:
    """The worker's own exception inside a Ray task error."""
    inner = getattr(exc, "cause", None)
    return inner if isinstance(inner, BaseException) else exc


def is_dead(exc: BaseException | None) -> bool:
    """A dead (or restarted, hence emptied) worker, as opposed to a worker that raised."""
    if exc is None:
        return False
    if isinstance(getattr(exc, "cause", None), WorkerDiedError):  # restarted: the old process died
        return True
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


def died_itself(policy: Policy, exc: BaseException | None) -> bool:
    """A dead-actor error about `policy` itself, not one a task inherited from a dead dependency
    (a reader's `stage_from_segment` takes its node writer's call as an argument)."""
    if not is_dead(exc):
        return False
    dead = getattr(exc, "actor_id", None) or getattr(exc, "_actor_id", None)  # RayTaskError: _actor_id
    mine = getattr(policy, "_actor_id", None)
    if dead is None or mine is None:
        return True
    return bool((dead if isinstance(dead, str) else dead.hex()) == mine.hex())


def vagueness(exc: BaseException) -> int:
    """0 for a failure that names what is wrong (a receiver's layout error naming the parameter;
    its sender only learns "a receiver has a different layout"), else 1."""
    inner = cause(exc)
    return 0 if isinstance(inner, LayoutMismatchError) and inner.parameter else 1


@dataclass(frozen=True)
class _Local:
    """The outcome of a call on a local policy object, shaped like a finished remote call."""

    value: Any
    error: BaseException | None


def finished(value: Any) -> Any:
    """A value a local call already returned, as a call `Calls.gather` can wait for."""
    return value if isinstance(value, ray.ObjectRef) else _Local(value, None)


class Roster:
    """The trainers and rollout workers of a group, with their names."""

    def __init__(self, train: Sequence[Policy], evals: Sequence[Policy]) -> None:
        self.policy_list: dict[PolicyRole, list[Policy]] = {
            PolicyRole.TRAIN: list(train),
            PolicyRole.EVAL: list(evals),
        }

    @property
    def train_list(self) -> list[Policy]:
        return self.policy_list[PolicyRole.TRAIN]

    @property
    def eval_list(self) -> list[Policy]:
        return self.policy_list[PolicyRole.EVAL]

    wid = staticmethod(actor_key)  # a worker's identity: its actor id, or the local object's id

    def name(self, policy: Policy) -> str:
        for role, members in self.policy_list.items():
            for i, p in enumerate(members):
                if p is policy or self.wid(p) == self.wid(policy):
                    return f"{ROLE_NAMES[role]} {i}"
        return f"policy {self.wid(policy)}"

    def by_wid(self, wid: Hashable) -> Policy | None:
        return next((p for p in self.eval_list + self.train_list if self.wid(p) == wid), None)

    def is_trainer(self, policy: Policy) -> bool:
        return any(p is policy for p in self.train_list)


class Calls:
    """Calls on the roster's workers, each bounded; `on_peer_lost` names a dead trainer."""

    def __init__(self, roster: Roster, rpc_timeout_s: float, on_peer_lost: Callable[[], Any]) -> None:
        self.roster = roster
        self.rpc_timeout_s = rpc_timeout_s
        self.on_peer_lost = on_peer_lost

    @staticmethod
    def invoke(policy: Policy, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start `method` on `policy`: an ObjectRef for an actor, the finished call for an object."""
        if is_remote(policy):
            return getattr(policy, method).remote(*args, **kwargs)
        try:
            return _Local(getattr(policy, method)(*args, **kwargs), None)
        except Exception as exc:
            return _Local(None, exc)

    def gather(self, calls: Sequence[tuple[Policy, Any]], timeout: float, what: str) -> list[Outcome]:
        """Wait for every call up to `timeout`; (value, error) per call, never hangs."""
        results: list[Outcome] = [(None, None)] * len(calls)
        remote = [(i, c) for i, (_, c) in enumerate(calls) if isinstance(c, ray.ObjectRef)]
        if remote:
            refs = [c for _, c in remote]
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
            late = set(pending)
            for i, ref in remote:
                if ref in late:
                    name = self.roster.name(calls[i][0])
                    error = TaskTimeoutError(f"{what}: {name} did not finish within {timeout:.1f}s")
                    results[i] = (None, error)
                    continue
                try:
                    results[i] = (ray.get(ref, timeout=max(1.0, timeout)), None)
                except Exception as exc:
                    results[i] = (None, exc)
        for i, (_, c) in enumerate(calls):
            if isinstance(c, _Local):
                results[i] = (c.value, c.error)
        return results

    def call_all(
        self, policies: Sequence[Policy], method: str, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call `method` on every policy at once; raise for the first failure (naming the policy)."""
        calls = [(p, self.invoke(p, method, *args, **kwargs)) for p in policies]
        results = self.gather(calls, self.rpc_timeout_s if timeout is None else timeout, method)
        self.raise_failures([p for p, _ in calls], results, method)
        return [value for value, _ in results]

    def raise_failures(self, policies: Sequence[Policy], results: Sequence[Outcome], what: str) -> None:
        """Raise for the first failed call, a dead trainer first (its peers' errors follow from it)."""
        failed = [(p, err) for p, (_, err) in zip(policies, results, strict=True) if err is not None]
        if not failed:
            return
        for p, err in failed:
            if is_dead(err) and self.roster.is_trainer(p):
                self.raise_for(p, err, what)
        if any(is_remote(p) for p in self.roster.train_list) and not any(is_dead(e) for _, e in failed):
            self.on_peer_lost()  # a peer-lost error usually means a trainer died: name it
        self.raise_for(failed[0][0], failed[0][1], what)

    def raise_for(self, policy: Policy, error: BaseException, what: str) -> NoReturn:
        name = self.roster.name(policy)
        if is_dead(error):
            if self.roster.is_trainer(policy):
                raise TrainWorkerDiedError(
                    f"{what}: {name} died; its training state is lost: {error}"
                ) from None
            raise WorkerDiedError(f"{what}: {name} died: {error}") from None
        if isinstance(error, TaskTimeoutError):
            raise error
        raise PolicyGroupError(f"{what}: {name} failed: {cause(error)}") from cause(error)
