"""Weight syncs of a group: the plan placement makes (`plan`), what it needs on the workers
(`prepare_buffers`, `form_groups`), one run of it for a version (`send`, which returns a
`SyncOutcome` carrying the `SyncReport`), and the rolling apply (`apply`).

The plan is re-made whenever the group changes (a worker died, joined, was popped or
converted) and, before the next send, only what `SyncPlan.diff` says changed is rebuilt. One
deadline (``sync_timeout_s`` from the start of an attempt) bounds every step of it. A rollout
worker that died is dropped and the version is sent once more to the survivors (a second
attempt); a dead trainer is an error. A version number a failed send used is never used again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import rlfleet.policygroup.sync._run as run_steps
from rlfleet.placement import SyncPlan, SyncReport, nodes_to_rewire, predict_sync_wall
from rlfleet.policygroup._config import PolicyConfig
from rlfleet.policygroup._errors import PolicyGroupError, TrainWorkerDiedError
from rlfleet.policygroup.driver._calls import Calls, Policy, died_itself, is_dead, vagueness
from rlfleet.policygroup.driver._rollout import Rollouts
from rlfleet.policygroup.driver._submitter import is_remote
from rlfleet.policygroup.sync._plan import Processes, plan_for
from rlfleet.policygroup.sync._wiring import Wiring
from rlfleet.routing import DrainTimeoutError

if TYPE_CHECKING:
    from rlfleet.policygroup.driver._membership import Membership

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncOutcome:
    """What one `send` did: the version staged everywhere, the steps run, the seconds it took,
    the rollout workers dropped (dead) before it was sent again, and its `SyncReport`."""

    version: int
    steps: int
    seconds: float
    dropped: tuple[str, ...] = ()
    report: SyncReport | None = None


class WeightSync:
    """Plans, prepares, runs and applies weight syncs over the group's processes."""

    members: Membership  # set by the group: drops the rollout workers that died

    def __init__(
        self, calls: Calls, rollouts: Rollouts, processes: Processes, config: PolicyConfig, uid: str
    ) -> None:
        self.calls, self.roster, self.rollouts, self.processes = calls, calls.roster, rollouts, processes
        self.config = config
        self.wiring = Wiring(calls, processes, config, uid)
        self.strategy: str | None = None  # set by prepare_buffers
        self.plan: SyncPlan | None = None  # what the next send runs
        self.wired: SyncPlan | None = None  # what the workers are wired for
        self.layout: dict[str, Any] | None = None
        self.version = 0
        self.attempted = 0  # the highest version a send began
        self.reserved = 0  # the highest version a non-blocking sync snapshotted
        self.stall = 0.0  # this sync's longest serving stall of one rollout worker (seconds)
        self.staged: int | None = None
        #: rollout workers (with their gather group) whose requests outlasted the last rolling
        #: update's drain: they serve the version before `staged` until the next sync swaps them
        self.lagging: list[tuple[list[Policy], str | None]] = []
        self.last: SyncOutcome | None = None
        self.report: SyncReport | None = None
        self._steps_began = 0.0  # when the last attempt's steps began (time.time())

    @property
    def node_buffers(self) -> dict[Any, dict[str, Any]]:
        return self.wiring.node_buffers

    # -- the plan -------------------------------------------------------------------------
    def replan(self) -> SyncPlan | None:
        """The plan for the group as it is now (placement's; None before the trainers' layout is known)."""
        if self.layout is None or not self.roster.train_list:
            self.plan = None
            return None
        strategy = self.config.weight_buffer.buffer_strategy
        processes = self.processes.sync_processes(strategy)
        actors = all(is_remote(p) for p in self.roster.train_list + self.roster.eval_list)
        self.plan = plan_for(processes, self.layout, self.config, self.processes.colocated, actors)
        return self.plan

    def _rewire(self) -> None:
        """Before a send: rebuild what changed since the workers were wired, make missing groups."""
        plan = self.replan() if self.plan is None else self.plan
        if plan is None:
            raise PolicyGroupError("send_weights: call init_placement_info() and init_weight_buffer() first")
        assert self.layout is not None
        if self.wired is not plan:
            nodes = nodes_to_rewire(self.wired, plan)
            if self.wired is not None:
                logger.info(
                    "[PolicyGroup] re-planned: %s; rewiring nodes %s",
                    plan.diff(self.wired).summary(),
                    sorted(nodes),
                )
            self.wiring.wire_nodes(plan, self.layout, nodes)
            if plan.strategy == "Sharded" and nodes and self.wiring.world is not None:
                self.wiring.form(plan, self.wiring.backend)  # gather groups are torch groups: a new world
            self.wired = plan
        self.wiring.ensure_groups(plan)

    # -- wiring ---------------------------------------------------------------------------
    def trainer_layout(self) -> dict[str, Any]:
        """Trainer 0's weight layout (what every plan and endpoint is made for)."""
        size = self.config.weight_buffer.bucket_bytes
        layout: dict[str, Any] = self.calls.call_all(self.roster.train_list[:1], "get_weight_layout", size)[0]
        return layout

    def prepare_buffers(self) -> None:
        """Plan, then node buffers and every rollout worker's endpoint (`init_weight_buffer`)."""
        strategy = self.config.weight_buffer.buffer_strategy
        roster, calls = self.roster, self.calls
        if strategy == "Sharded" and not all(is_remote(p) for p in roster.train_list + roster.eval_list):
            raise PolicyGroupError(
                "buffer_strategy 'Sharded' needs Ray actors: a node's rollout workers gather their "
                "shards over a communication group at each swap"
            )
        self.strategy = strategy
        if not roster.train_list:
            return
        self.layout = self.trainer_layout()
        plan = self.replan()
        assert plan is not None
        calls.call_all(roster.train_list + roster.eval_list, "release_weight_buffers")
        self.wiring.wire_nodes(plan, self.layout, plan.nodes)
        self.wired = plan
        # a group built over workers that served an earlier group continues their numbering
        versions = calls.call_all(roster.train_list + roster.eval_list, "get_weight_version")
        self.version, self.staged = max([self.version, *versions]), None
        for p, v in zip(roster.eval_list, versions[len(roster.train_list) :], strict=True):
            self.rollouts.add(p, self.processes.node_of)
            self.rollouts.set_version(p, int(v))  # what it really serves

    def form_groups(self, backend: str) -> None:
        """The plan's communication groups on the actors (`init_comm_group`)."""
        plan = self.replan() if self.plan is None else self.plan
        if plan is None:
            raise PolicyGroupError(
                "init_comm_group: call init_placement_info() and init_weight_buffer() first"
            )
        self.wiring.form(plan, backend)

    # -- a run ----------------------------------------------------------------------------
    def next_version(self) -> int:
        """The number the next send uses: never one a failed send used (some receivers may hold
        it, with the trainers' weights of then)."""
        return max(self.version, self.attempted, self.reserved) + 1

    def send(self, version: int, retry: bool = True) -> SyncOutcome:
        """Stage `version` on every rollout worker ("None": applied in place, the workers drained).

        Every step of one attempt shares one deadline (``sync_timeout_s`` from its start); the
        retry for the survivors of a death is a second attempt with its own."""
        roster, start, begun = self.roster, time.perf_counter(), time.time()
        self.attempted = max(self.attempted, version)
        deadline_at = time.time() + self.config.sync_timeout_s
        if not roster.train_list:
            raise PolicyGroupError("send_weights: the group has no trainer")
        if self.strategy is None:
            raise PolicyGroupError("send_weights: call init_placement_info() and init_weight_buffer() first")
        gone = tuple(self.members.refresh())  # rollout workers found dead as this sync begins
        if not roster.eval_list:
            return SyncOutcome(version, 0, time.perf_counter() - start, gone)
        self._catch_up(version)
        self._rewire()
        plan = self.plan
        assert plan is not None
        in_place = self.strategy == "None"
        drained = list(roster.eval_list) if in_place else []
        self.stall = 0.0
        if drained:
            try:
                self.rollouts.drain(drained)
            except DrainTimeoutError as exc:  # the router is as it was: nothing sent, v-1 served
                raise PolicyGroupError(f"send_weights v{version} ('None' applies in place): {exc}") from exc
        idle = time.perf_counter()  # "None": the workers admit nothing until the version is in
        try:
            run = run_steps.start(
                plan,
                version,
                deadline_at,
                self.processes.by_pid(),
                self.calls.invoke,
                self.wiring.groups,
                self.wiring.names,
                self._ipc_options(),
            )
            self._steps_began = run.started
            results = run_steps.outcomes(run, self.calls, f"send_weights v{version}")
            failed = [(p, err) for p, (_, err) in results if err is not None]
            first = None if not failed else min(failed, key=lambda f: vagueness(f[1]))
            error = None if first is None else f"{roster.name(first[0])}: {first[1]}"
            self.report = run_steps.report(run, results, error, self._pid_of_rank())
            if not failed:
                if in_place:
                    self.applied(version)
                self.staged = version
                self.rollouts.announce(version)  # committed: the router bounds staleness from it
                self._time_whole(run.started, begun)
                return SyncOutcome(version, len(plan.steps), time.perf_counter() - start, gone, self.report)
            outcome = self._recover(version, failed, retry, start)
            self._time_whole(self._steps_began, begun)
            return dataclasses.replace(outcome, dropped=(*gone, *outcome.dropped), report=self.report)
        finally:
            # whatever happened (a dead trainer, a failed retry, an interrupt), the router is left
            # as the send found it: the workers it drained are routed to again
            if drained:
                self.rollouts.undrain(drained)
                self._stalled(idle)  # "None" applied in place: the stall is the transfer
                self._report_stall(version)

    def _pid_of_rank(self) -> dict[int, str]:
        """The world's ranks by process id (empty before the groups are formed)."""
        comm = self.wiring.comm
        return {} if comm is None else {rank: pid for pid, rank in comm.rank_of.items()}

    def _time_whole(self, steps_began: float, begun: float) -> None:
        """Put the whole send in the report: before the steps that delivered the version (checks,
        wiring, a failed first attempt), the steps, and after them (answers, bookkeeping)."""
        report = self.report
        if report is None:
            return
        steps = report.measured_seconds
        phases = {
            "prepare": max(0.0, steps_began - begun),
            "steps": steps,
            "collect": max(0.0, time.time() - steps_began - steps),
            "apply": 0.0,
        }
        self.report = report.with_wall(phases, self._predicted_wall(apply=False))

    def _report_stall(self, version: int) -> None:
        report = self.report
        if report is not None and report.version == version:
            self.report = dataclasses.replace(report, serving_stall_seconds=self.stall)

    def _stalled(self, idle: float) -> None:
        """A rollout worker admitted nothing from `idle` (drained, its requests done) until now."""
        self.stall = max(self.stall, time.perf_counter() - idle)

    def _predicted_wall(self, apply: bool) -> float | None:
        if self.plan is None:
            return None
        return sum(predict_sync_wall(self.plan, self.config.cost_model, apply=apply).values())

    def _ipc_options(self) -> dict[str, Any]:
        """What a cuda_ipc step's channel is made with: backend, the group's bucket size, checksums."""
        wb = self.config.weight_buffer
        bucket_bytes = int((self.layout or {}).get("bucket_bytes", wb.bucket_bytes))
        backend = "host" if wb.cuda_ipc == "host" else "cuda"
        return {"backend": backend, "bucket_bytes": bucket_bytes, "checksums": wb.checksums}

    def _recover(
        self, version: int, failed: list[tuple[Policy, BaseException]], retry: bool, start: float
    ) -> SyncOutcome:
        """After a failed run: a dead trainer raises; dead rollout workers are dropped and the
        survivors get the version once more; otherwise the clearest error is raised."""
        roster = self.roster
        for p, err in failed:
            if is_dead(err) and roster.is_trainer(p):
                raise TrainWorkerDiedError(f"send_weights v{version}: {roster.name(p)} died: {err}") from None
        before = len(roster.eval_list)
        dropped = []
        for p, err in failed:
            if died_itself(p, err) and any(p is e for e in roster.eval_list):
                dropped.append(roster.name(p))
                self.members.drop(p, f"died during send_weights v{version}")
        dropped += self.members.refresh()
        if self.strategy == "None":
            self.rollouts.undrain(roster.eval_list)  # the retry drains them again
        if retry and len(roster.eval_list) < before:
            msg = "[PolicyGroup] send_weights v%d: retrying for %d surviving rollout workers"
            logger.warning(msg, version, len(roster.eval_list))
            # "None" applied in place wherever the first try got through: resend as the next version
            again = self.send(version + 1 if self.strategy == "None" else version, False)
            return SyncOutcome(
                again.version, again.steps, time.perf_counter() - start, tuple(dropped), again.report
            )
        p, err = min(failed, key=lambda f: vagueness(f[1]))
        self.calls.raise_for(p, err, f"send_weights v{version}")

    def forget(self, policy: Policy) -> None:
        """A rollout worker left: the next send runs a new plan without it."""
        self.wiring.forget([self.processes.pid(policy)])
        for entry in self.node_buffers.values():
            entry["eval_policies"] = [p for p in entry["eval_policies"] if p is not policy]
        if self.plan is not None:
            self.replan()

    # -- apply ----------------------------------------------------------------------------
    def applied(self, version: int) -> None:
        """Every rollout worker serves `version` ("None": applied during the send)."""
        for p in self.roster.eval_list:
            self.rollouts.set_version(p, version)
        self.rollouts.undrain(self.roster.eval_list)
        self.version = version

    def apply(self) -> None:
        """Apply the staged version as a rolling update: drain one rollout worker, swap, undrain
        ("Sharded": node by node, since a node's workers gather together)."""
        version = self.staged
        if version is None or version <= self.version:
            return
        began = time.time()
        self.stall = 0.0
        try:
            self._apply_rolling(version)
        finally:
            report = self.report
            if report is not None and report.version == version and report.wall_seconds is not None:
                phases = {**report.wall_phases, "apply": time.time() - began}
                self.report = report.with_wall(phases, self._predicted_wall(apply=True))
            self._report_stall(version)
        self.version = version

    def _apply_rolling(self, version: int) -> None:
        """One swap after another; a worker whose requests outlast the drain keeps serving the
        previous version (routable, as it was) and the others go on; then a clear error names it
        and the next apply retries it."""
        comm = self.wiring.comm
        batches: list[tuple[list[Policy], str | None]] = []
        if self.strategy == "Sharded" and comm is not None:
            by_pid = self.processes.by_pid()
            for group in comm.gather:  # each node's rollout workers, in shard order
                mates = [comm.process_of(rank) for rank in group.ranks]
                batches.append(([by_pid[p] for p in mates if p in by_pid], group.group_id))
        elif self.strategy != "None":
            batches = [([p], None) for p in self.roster.eval_list]
        self.lagging = []
        for policies, group_id in batches:
            try:
                self._apply_together(policies, version, group_id)
            except DrainTimeoutError:
                self.lagging.append((policies, group_id))
        if self.lagging:
            busy = [self.roster.name(p) for policies, _ in self.lagging for p in policies]
            raise PolicyGroupError(
                f"apply v{version}: {', '.join(busy)} still had requests in flight after "
                f"drain_timeout_s={self.config.drain_timeout_s}; they keep serving v{self.version} "
                "and the next apply (notify_update_weights) or sync swaps them"
            )

    def _catch_up(self, version: int) -> None:
        """Before `version` is sent, swap the rollout workers the last rolling update left behind
        (their requests outlasted its drain). In a node buffer ("Shared") such a worker still
        holds the slot the writer of `version` needs: sending past it would wait out the sync's
        deadline and fail every sync after (a soak starved so). If it is still busy, "Shared"
        sends nothing (a clear error; the next sync tries again); the others send, and their
        rolling update swaps it."""
        staged, lagging, self.lagging = self.staged, self.lagging, []
        if staged is None or not lagging:
            return
        for policies, group_id in lagging:
            alive = [p for p in policies if any(p is q for q in self.roster.eval_list)]
            try:
                self._apply_together(alive, staged, group_id)
            except DrainTimeoutError:
                self.lagging.append((alive, group_id))
        if not self.lagging:
            self.version = max(self.version, staged)
        elif self.strategy == "Shared":
            busy = [self.roster.name(p) for policies, _ in self.lagging for p in policies]
            raise PolicyGroupError(
                f"send_weights v{version}: not sent: {', '.join(busy)} still serve v{self.version} "
                f"with requests in flight after drain_timeout_s={self.config.drain_timeout_s}, "
                "holding the node buffer's slot this version needs; the next sync swaps them first"
            )

    def _apply_together(self, policies: list[Policy], version: int, group_id: str | None) -> None:
        if not policies:
            return
        self.rollouts.drain(policies)
        idle = time.perf_counter()  # drained, their requests done: they serve nothing until undrained
        try:
            calls = [(p, self.calls.invoke(p, "apply_staged", version, None, group_id)) for p in policies]
            results = self.calls.gather(calls, self.config.rpc_timeout_s, f"apply v{version}")
            error = results[0][1]
            if group_id is None and is_dead(error):  # one worker: drop it, go on
                self.members.drop(policies[0], f"died while applying v{version}")
                return
            if group_id is None and error is not None:
                self.calls.raise_for(policies[0], error, f"apply v{version}")
            self.calls.raise_failures(policies, results, f"apply v{version}")
            for p, (live, _) in zip(policies, results, strict=True):
                # a worker may have bound a newer version already in its node buffer (it skipped ahead)
                self.rollouts.set_version(p, max(version, int(live)) if isinstance(live, int) else version)
        finally:
            self.rollouts.undrain(policies)
            self._stalled(idle)
