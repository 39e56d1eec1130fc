"""What a `SyncPlan` needs on the workers before it runs: node buffers, endpoints and groups.

For each `NodeBuffer` of the plan the writer creates the node's shared buffer (a trainer, or
the rollout worker that receives for the node; with "Shared" it reads its own buffer too) and
the node's rollout workers get their endpoint (bound to it, copying from it, or receiving
broadcasts; "Sharded" with their share). Communication groups: the world and every group of
the plan (one per broadcast step's members, sender first) when the group is formed; later,
a group the new plan needs is made among its members alone. After a worker died, joined, was
popped or converted, `rewire` rebuilds only what `SyncPlan.diff` says changed (a node whose
"cuda_ipc" readers changed too: releasing its workers' buffers closes their IPC channels, and
the next sync's writer makes a channel for the new readers); placement's `nodes_to_rewire`
says which nodes that is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rlfleet.placement import CommGroup, CommGroupPlan, SyncPlan, plan_comm_groups
from rlfleet.policygroup import _comm
from rlfleet.policygroup._calls import Calls, Policy
from rlfleet.policygroup._config import PolicyConfig
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.policygroup._sync_plan import Processes
from rlfleet.weightsync import ParallelMode


class Wiring:
    """Node buffers, endpoints and communication groups of the plan being run."""

    def __init__(self, calls: Calls, processes: Processes, config: PolicyConfig, uid: str) -> None:
        self.calls, self.processes, self.config, self.uid = calls, processes, config, uid
        self.node_buffers: dict[Any, dict[str, Any]] = {}  # the seed's shared_weight_buffer_map
        self.names: dict[str, str] = {}  # node -> its buffer's name
        self.groups: dict[tuple[str, ...], tuple[str, int]] = {}  # members -> (group id, src rank)
        self.gather_groups: dict[Any, str] = {}  # "Sharded": each node's rollout workers gather
        self.world: CommGroupPlan | None = None
        self.backend = "gloo"
        self._rank_of: dict[str, int] = {}
        self._made: dict[tuple[int, ...], str] = {}
        self._rebuilds = 0

    # -- buffers and endpoints ------------------------------------------------------------
    def wire_nodes(self, plan: SyncPlan, layout: Mapping[str, Any], nodes: Iterable[str]) -> None:
        """Rebuild the node buffer and the rollout workers' endpoints of `nodes`."""
        nodes = set(nodes)
        if not nodes:
            return
        by_pid = self.processes.by_pid()
        on_nodes = [by_pid[p.id] for p in plan.processes if p.node in nodes]
        self.calls.call_all(on_nodes, "release_weight_buffers")
        specs: dict[str, dict[str, Any]] = {p.id: {} for p in plan.rollouts if p.node in nodes}
        wb = self.config.weight_buffer
        for buf in plan.node_buffers:
            if buf.node not in nodes:
                continue
            writer = by_pid[buf.writer]
            relay = plan.process(buf.writer).role == "rollout"
            readers = len(buf.readers) + (1 if relay else 0)  # a relay binds its own buffer too
            [name] = self.calls.call_all(
                [writer], "create_shared_writer", dict(layout), readers, f"rlfleet-{self.uid}", wb.checksums
            )
            self.names[buf.node] = name
            spec = {"name": name, "node_id": buf.node}
            users = [*buf.readers, *([buf.writer] if relay else [])]
            self.node_buffers[buf.node] = {
                "shared_weight_buffer": spec,
                "eval_policies": [by_pid[r] for r in users],
                "writer": writer,
            }
            for pid in users:
                specs[pid].update(spec)
        for node in nodes - {b.node for b in plan.node_buffers}:
            self.node_buffers.pop(node, None)
            self.names.pop(node, None)
        for p in plan.rollouts:
            if p.id in specs and p.shard is not None:
                specs[p.id].update(rank=p.shard[0], world_size=p.shard[1])
        ends = [
            (
                by_pid[pid],
                self.calls.invoke(
                    by_pid[pid],
                    "init_weight_buffer",
                    spec or None,
                    strategy=plan.strategy,
                    layout=dict(layout),
                ),
            )
            for pid, spec in specs.items()
        ]
        results = self.calls.gather(ends, self.config.rpc_timeout_s, "init_weight_buffer")
        for (p, _), (_, err) in zip(ends, results, strict=True):
            if err is not None:
                self.calls.raise_for(p, err, "init_weight_buffer")

    # -- groups ---------------------------------------------------------------------------
    def form(self, plan: SyncPlan, backend: str) -> None:
        """The world group, intra-node groups, the plan's groups, the train data-parallel group and,
        for "Sharded", each node's gather group, on the actors, bounded (`init_comm_group`)."""
        self.backend = backend
        by_pid = self.processes.by_pid()
        roster = self.processes.roster
        members = [p.id for p in plan.processes]
        if self.processes.colocated and not plan.groups() and plan.strategy != "Sharded":
            members = [self.processes.pid(p) for p in roster.train_list]  # trainers only, as the seed
        gpu = self.processes.gpu_of
        actors = [(pid, plan.process(pid).node, max(0, gpu[roster.wid(by_pid[pid])])) for pid in members]
        transfer = [{"sender": g[0], "receiver": list(g[1:])} for g in plan.groups()]
        trainers = [self.processes.pid(p) for p in roster.train_list]
        world = plan_comm_groups(actors, transfer, trainers, weight_buffer_strategy="Double")
        rank = {str(r.actor_id): r.rank for r in world.ranks}
        extra: list[CommGroup] = []
        self.gather_groups = {}
        if plan.strategy == "Sharded":  # a node's rollout workers gather their shares at each swap
            for node in plan.nodes:
                mates = sorted((p for p in plan.rollouts if p.node == node), key=lambda p: p.shard or (0, 0))
                if mates:
                    gid = f"sharded/{len(extra)}"
                    extra.append(CommGroup(gid, "sharded", tuple(rank[p.id] for p in mates), node))
                    self.gather_groups[node] = gid
        names = {pid: roster.name(by_pid[pid]) for pid in members}
        _comm.init_world(
            world, {pid: by_pid[pid] for pid in members}, names, backend, self.config.group_timeout_s, extra
        )
        self.world, self._rank_of, self._made, self.groups = world, rank, {}, {}
        for members_, g in zip(plan.groups(), world.weight_transfer_groups, strict=True):
            self.groups[members_] = (g.group_id, rank[members_[0]])
            self._made[g.ranks] = g.group_id

    def ensure_groups(self, plan: SyncPlan) -> None:
        """A member group for every group of `plan` that has none yet (after a re-plan)."""
        missing = [g for g in plan.groups() if g not in self.groups]
        if not missing:
            return
        if self.world is None:
            raise PolicyGroupError("cross-node weight transfer needs init_comm_group() first")
        make = []
        for members in missing:
            unknown = [m for m in members if m not in self._rank_of]
            if unknown:
                raise PolicyGroupError(
                    f"{', '.join(unknown)} have no rank in the world group; call init_comm_group()"
                )
            ranks = tuple(self._rank_of[m] for m in members)
            gid = self._made.get(ranks)
            if gid is None:
                self._rebuilds += 1
                gid = f"{ParallelMode.WEIGHT_TRANSFER.value}/r{self._rebuilds}"
                make.append(CommGroup(gid, ParallelMode.WEIGHT_TRANSFER.value, ranks, None, ranks[0]))
                self._made[ranks] = gid
            self.groups[members] = (gid, ranks[0])
        if make:
            roster = self.processes.roster
            by_pid = self.processes.by_pid()
            names = {pid: roster.name(p) for pid, p in by_pid.items()}
            by_rank = {self._rank_of[pid]: pid for pid in by_pid if pid in self._rank_of}
            actors = {by_rank[r]: by_pid[by_rank[r]] for g in make for r in g.ranks}
            _comm.create_groups(self.world, make, actors, names, self.backend, self.config.group_timeout_s)

    def forget(self, pids: Iterable[str]) -> None:
        """Groups with a member that left are never used again."""
        gone = set(pids)
        self.groups = {m: g for m, g in self.groups.items() if not gone & set(m)}

    def policies(self, plan: SyncPlan) -> dict[str, Policy]:
        return {pid: p for pid, p in self.processes.by_pid().items() if pid in {q.id for q in plan.processes}}
