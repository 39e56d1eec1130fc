"""Sync execution: the group's steps (`plan`), the node buffers and groups they need
(`prepare_buffers`, `form_groups`), one run of them for a version (`send`, which reports a
`SyncOutcome`), and the rolling apply (`apply`).

A run starts every step's calls at once and orders them only through Ray: a rollout worker's
read of a node buffer takes the call that fills it as an argument. A rollout worker that died
is dropped and the version is sent again once for the survivors; a dead trainer is an error.
Every wait is bounded by the configured deadlines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import ray

from rlfleet.placement import CommGroup, CommGroupPlan, plan_comm_groups
from rlfleet.policygroup import _comm
from rlfleet.policygroup._calls import Calls, Outcome, Policy, died_itself, is_dead, vagueness
from rlfleet.policygroup._config import PolicyConfig
from rlfleet.policygroup._errors import PolicyGroupError, TrainWorkerDiedError
from rlfleet.policygroup._rollout import Rollouts
from rlfleet.policygroup._submitter import is_remote
from rlfleet.policygroup._sync_plan import BROADCAST, NODE_BUFFER, Processes, Step, plan_steps
from rlfleet.policygroup._worker_comm import ParallelMode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncOutcome:
    """What one `send` did: the version staged everywhere, the steps run, the seconds it took,
    and the rollout workers dropped (dead) before it was sent again to the survivors."""

    version: int
    steps: int
    seconds: float
    dropped: tuple[str, ...] = ()


class WeightSync:
    """Plans, prepares, runs and applies weight syncs over the group's processes."""

    def __init__(
        self,
        calls: Calls,
        rollouts: Rollouts,
        processes: Processes,
        config: PolicyConfig,
        uid: str,
        liveness: Callable[[], list[str]],  # drops dead rollout workers, returns their names
        drop: Callable[[Policy, str], None],
    ) -> None:
        self.calls, self.roster, self.rollouts, self.processes = calls, calls.roster, rollouts, processes
        self.config = config
        self.uid = uid
        self.liveness, self.drop = liveness, drop
        self.strategy: str | None = None  # set by prepare_buffers
        self.steps: list[Step] = []
        self.node_buffers: dict[Any, dict[str, Any]] = {}  # the seed's shared_weight_buffer_map
        self.version = 0
        self.staged: int | None = None
        self.dirty = False  # a node buffer's writer or readers changed: prepare again before the next send
        self.last: SyncOutcome | None = None
        self.world: CommGroupPlan | None = None
        self.backend = "gloo"
        self.gather_groups: dict[Any, str] = {}  # "Sharded": each node's rollout workers gather
        self._layout: dict[str, Any] | None = None
        self._prepared: dict[Any, tuple[Hashable, frozenset[Hashable]]] = {}
        self._groups_made: dict[tuple[int, ...], str] = {}
        self._rank_of: dict[Hashable, int] = {}
        self._rebuilds = 0

    # -- steps ----------------------------------------------------------------------------
    def plan(self) -> None:
        """The steps for the group's processes and strategy; broadcasts among members that
        already have a group keep it."""
        self.steps = plan_steps(self.processes, self.config.weight_buffer.buffer_strategy == "Shared")
        for step in self._broadcasts():
            ranks = self._ranks(step)
            if ranks is not None and ranks in self._groups_made:
                step.group_id, step.src_rank = self._groups_made[ranks], ranks[0]

    def _broadcasts(self) -> list[Step]:
        return [s for s in self.steps if s.transport == BROADCAST]

    def _ranks(self, step: Step) -> tuple[int, ...] | None:
        try:
            return tuple(self._rank_of[self.roster.wid(p)] for p in (step.src, *step.dst))
        except KeyError:
            return None

    def _signature(self) -> dict[Any, tuple[Hashable, frozenset[Hashable]]]:
        """Who writes and who copies from each node buffer a trainer writes."""
        wid = self.roster.wid
        return {
            s.node: (wid(s.src), frozenset(wid(r) for r in s.dst))
            for s in self.steps
            if s.transport == NODE_BUFFER and not s.after
        }

    # -- wiring ---------------------------------------------------------------------------
    def prepare_buffers(self) -> None:
        """Node buffers for the steps, and every rollout worker's endpoint (`init_weight_buffer`)."""
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
        bucket_bytes = self.config.weight_buffer.bucket_bytes
        self._layout = calls.call_all(roster.train_list[:1], "get_weight_layout", bucket_bytes)[0]
        calls.call_all(roster.train_list + roster.eval_list, "release_weight_buffers")
        specs = self._node_buffers(strategy)
        if strategy == "Sharded":  # rollout worker i of a node keeps share i of every version
            for entry in self.processes.placement_info.values():
                for i, p in enumerate(entry["eval_policies"]):
                    specs[roster.wid(p)].update(rank=i, world_size=len(entry["eval_policies"]))
        self._prepared = self._signature()
        init = [(p, specs[roster.wid(p)] or None) for p in roster.eval_list]
        ends = [
            (p, calls.invoke(p, "init_weight_buffer", spec, strategy=strategy, layout=self._layout))
            for p, spec in init
        ]
        for (p, _), (_, err) in zip(
            ends, calls.gather(ends, self.config.rpc_timeout_s, "init_weight_buffer"), strict=True
        ):
            if err is not None:
                calls.raise_for(p, err, "init_weight_buffer")
        # a group built over workers that served an earlier group continues their numbering
        versions = calls.call_all(roster.train_list + roster.eval_list, "get_weight_version")
        self.version, self.staged = max([self.version, *versions]), None
        for p, v in zip(roster.eval_list, versions[len(roster.train_list) :], strict=True):
            self.rollouts.add(p, self.processes.node_of)
            self.rollouts.set_version(p, int(v))  # what it really serves

    def _node_buffers(self, strategy: str) -> dict[Hashable, dict[str, Any]]:
        """One node buffer per node that has readers, written once per version: with "Shared"
        every rollout worker of the node reads it zero-copy; otherwise the workers a trainer on
        their node feeds copy each version out of it. The spec each rollout worker gets."""
        specs: dict[Hashable, dict[str, Any]] = {self.roster.wid(p): {} for p in self.roster.eval_list}
        self.node_buffers = {}
        by_node = {s.node: s for s in self.steps if s.transport == NODE_BUFFER}
        for node, entry in self.processes.placement_info.items():
            step = by_node.get(node)
            readers = list(entry["eval_policies"]) if strategy == "Shared" else list(step.dst if step else [])
            if not readers:
                continue
            if step is None:
                raise PolicyGroupError(
                    f"no trainer or cross-node receiver fills the shared buffer of node {node!r}"
                )
            wb = self.config.weight_buffer
            [name] = self.calls.call_all(
                [step.src],
                "create_shared_writer",
                self._layout,
                len(readers),
                f"rlfleet-{self.uid}",
                wb.checksums,
            )
            spec = {"name": name, "node_id": node}
            self.node_buffers[node] = {
                "shared_weight_buffer": spec,
                "eval_policies": readers,
                "writer": step.src,
            }
            for p in readers:
                specs[self.roster.wid(p)].update(spec)
        return specs

    def form_groups(self, backend: str) -> None:
        """The world group, intra-node groups, one group per broadcast step and the train
        data-parallel group (rlfleet.placement's plan), on the actors, bounded (`init_comm_group`)."""
        roster, processes = self.roster, self.processes
        everyone = roster.train_list + roster.eval_list
        self.backend = backend
        processes.locate(everyone)
        sharded = self.config.weight_buffer.buffer_strategy == "Sharded"
        colocated_only = processes.colocated and not self._broadcasts() and not sharded
        members = roster.train_list if colocated_only else everyone
        wid = roster.wid
        actors = [(wid(p), processes.node_of[wid(p)], processes.gpu_of[wid(p)]) for p in members]
        transfer = [{"sender": wid(s.src), "receiver": [wid(r) for r in s.dst]} for s in self._broadcasts()]
        plan = plan_comm_groups(
            actors, transfer, [wid(p) for p in roster.train_list], weight_buffer_strategy="Double"
        )
        rank = {r.actor_id: r.rank for r in plan.ranks}
        extra: list[CommGroup] = []
        self.gather_groups = {}
        if sharded:  # one group per node's rollout workers: they gather their shares at each swap
            for node, entry in processes.placement_info.items():
                if entry["eval_policies"]:
                    gid = f"sharded/{len(extra)}"
                    extra.append(
                        CommGroup(gid, "sharded", tuple(rank[wid(p)] for p in entry["eval_policies"]), node)
                    )
                    self.gather_groups[node] = gid
        by_wid = {wid(p): p for p in members}
        _comm.init_world(plan, by_wid, roster.names(), backend, self.config.group_timeout_s, extra)
        self.world, self._rank_of, self._groups_made = plan, rank, {}
        for step, g in zip(self._broadcasts(), plan.weight_transfer_groups, strict=True):
            step.group_id, step.src_rank = g.group_id, g.src_rank
            self._groups_made[g.ranks] = g.group_id

    def _ensure_groups(self) -> None:
        """Member groups for broadcast steps that have none yet (after a re-plan)."""
        missing = [s for s in self._broadcasts() if s.group_id is None]
        if not missing:
            return
        if self.world is None:
            raise PolicyGroupError("cross-node weight transfer needs init_comm_group() first")
        groups = []
        for step in missing:
            ranks = self._ranks(step)
            if ranks is None:
                name = self.roster.name(step.src)
                raise PolicyGroupError(f"{name} or a receiver has no rank; call init_comm_group()")
            self._rebuilds += 1
            gid = f"{ParallelMode.WEIGHT_TRANSFER.value}/r{self._rebuilds}"
            groups.append(CommGroup(gid, ParallelMode.WEIGHT_TRANSFER.value, ranks, step.node, ranks[0]))
            step.group_id, step.src_rank = gid, ranks[0]
            self._groups_made[ranks] = gid
        by_wid = {self.roster.wid(p): p for p in self.roster.train_list + self.roster.eval_list}
        _comm.create_groups(
            self.world, groups, by_wid, self.roster.names(), self.backend, self.config.group_timeout_s
        )

    def refresh_before_send(self) -> None:
        """Before a send: groups for new broadcasts, node buffers for changed readers."""
        self._ensure_groups()
        if self.strategy != "Shared":  # a re-plan can give a node's trainer new readers
            before = self._prepared
            self.dirty |= any(
                n not in before or w != before[n][0] or not readers <= before[n][1]
                for n, (w, readers) in self._signature().items()
            )
        if self.dirty:
            self.dirty = False
            self.prepare_buffers()  # a node buffer's writer or shard count changed
            if self.strategy == "Sharded":  # gather groups are torch groups: a new world
                self.form_groups(self.backend)

    # -- a run ----------------------------------------------------------------------------
    def run(self, version: int) -> list[tuple[Policy, Outcome]]:
        """Start every step's calls for `version` and wait for all (bounded); (worker, outcome)."""
        timeout = self.config.sync_timeout_s
        bucket_bytes = self.config.weight_buffer.bucket_bytes
        invoke = self.calls.invoke
        calls: list[tuple[Policy, Any]] = []
        fills: dict[int, Any] = {}  # node_buffer step -> the call that fills its buffer
        for step in self.steps:
            if step.transport == BROADCAST:
                calls.append(
                    (
                        step.src,
                        invoke(step.src, "send_broadcast", step.group_id, version, bucket_bytes, timeout),
                    )
                )
                for r in step.dst:
                    calls.append(
                        (r, invoke(r, "recv_broadcast", step.group_id, step.src_rank, version, timeout))
                    )
            elif not step.after and step.node in self.node_buffers:  # a trainer writes it once
                calls.append((step.src, invoke(step.src, "publish_shared", version, timeout)))
                fills[step.index] = calls[-1][1]
        for step in self.steps:
            if step.transport != NODE_BUFFER or not step.dst:
                continue
            if step.after:  # the receive of the worker that writes it for the node
                fills[step.index] = next(c for p, c in calls[::-1] if p is step.src)
            fill = fills.get(step.index)
            if fill is None:
                raise PolicyGroupError(f"send_weights: nothing fills the shared buffer of node {step.node!r}")
            name = self.node_buffers[step.node]["shared_weight_buffer"]["name"]
            after = fill if isinstance(fill, ray.ObjectRef) else None
            calls.extend((r, invoke(r, "stage_from_segment", name, version, after)) for r in step.dst)
        results = self.calls.gather(calls, timeout, f"send_weights v{version}")
        return [(p, outcome) for (p, _), outcome in zip(calls, results, strict=True)]

    def send(self, version: int, retry: bool = True) -> SyncOutcome:
        """Stage `version` on every rollout worker ("None": applied in place, the workers drained)."""
        roster, start = self.roster, time.perf_counter()
        if not roster.train_list:
            raise PolicyGroupError("send_weights: the group has no trainer")
        if self.strategy is None:
            raise PolicyGroupError("send_weights: call init_placement_info() and init_weight_buffer() first")
        self.liveness()
        if not roster.eval_list:
            return SyncOutcome(version, 0, time.perf_counter() - start)
        self.refresh_before_send()
        in_place = self.strategy == "None"
        if in_place:
            self.rollouts.drain(roster.eval_list)
        try:
            failed = [(p, err) for p, (_, err) in self.run(version) if err is not None]
        except BaseException:
            if in_place:
                self.rollouts.undrain(roster.eval_list)
            raise
        if not failed:
            if in_place:
                self.applied(version)
            self.staged = version
            return SyncOutcome(version, len(self.steps), time.perf_counter() - start)
        return self._recover(version, failed, retry, start)

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
                self.drop(p, f"died during send_weights v{version}")
        dropped += self.liveness()
        if self.strategy == "None":
            self.rollouts.undrain(roster.eval_list)
        if retry and len(roster.eval_list) < before:
            logger.warning(
                "[PolicyGroup] send_weights v%d: retrying for %d surviving rollout workers",
                version,
                len(roster.eval_list),
            )
            # "None" applied in place wherever the first try got through: resend as the next version
            again = self.send(version + 1 if self.strategy == "None" else version, retry=False)
            return SyncOutcome(again.version, again.steps, time.perf_counter() - start, tuple(dropped))
        p, err = min(failed, key=lambda f: vagueness(f[1]))
        self.calls.raise_for(p, err, f"send_weights v{version}")

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
        if self.strategy == "Sharded":
            for node, gid in self.gather_groups.items():
                self._apply_together(
                    self.processes.placement_info.get(node, {}).get("eval_policies", []), version, gid
                )
        elif self.strategy != "None":
            for p in list(self.roster.eval_list):
                self._apply_together([p], version, None)
        self.version = version

    def _apply_together(self, policies: list[Policy], version: int, group_id: str | None) -> None:
        if not policies:
            return
        self.rollouts.drain(policies)
        try:
            calls = [(p, self.calls.invoke(p, "apply_staged", version, None, group_id)) for p in policies]
            results = self.calls.gather(calls, self.config.rpc_timeout_s, f"apply v{version}")
            error = results[0][1]
            if group_id is None and is_dead(error):  # one worker: drop it, go on
                self.drop(policies[0], f"died while applying v{version}")
                return
            if group_id is None and error is not None:
                self.calls.raise_for(policies[0], error, f"apply v{version}")
            self.calls.raise_failures(policies, results, f"apply v{version}")
            for p in policies:
                self.rollouts.set_version(p, version)
        finally:
            self.rollouts.undrain(policies)
