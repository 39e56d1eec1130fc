"""What a `SyncPlan` needs on its processes before it runs: node buffers, endpoints and groups.

`node_wiring` says, for the nodes an executor rebuilds (all of them at first, then
`nodes_to_rewire`'s), which node buffers to create (writer, how many processes attach, which
rollout workers use it) and each rollout worker's endpoint spec. `SyncGroups` is the world
and every communication group the plan runs in: one per broadcast group of the plan (sender
first), each node's gather group with "Sharded", and the groups a later plan needs among the
same ranks (made among their members alone).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement._public import public
from rlfleet.placement.schedule._comm import WEIGHT_TRANSFER, CommGroup, CommGroupPlan, plan_comm_groups
from rlfleet.placement.sync._plan import SyncPlan

__all__ = ["GATHER", "BufferWiring", "NodeWiring", "SyncGroups", "node_wiring"]

#: The mode of a "Sharded" node's gather group (its rollout workers gather their shares at a swap).
GATHER = "sharded"


@public
@dataclass(frozen=True)
class BufferWiring:
    """One node buffer to create: its writer, the processes that attach to it (its readers and,
    when the writer is a rollout worker relaying for the node, the writer itself, which binds its
    own buffer too) and the rollout workers whose endpoint uses it."""

    node: str
    writer: str
    readers: int
    users: tuple[str, ...]


@public
@dataclass(frozen=True)
class NodeWiring:
    """What rebuilding some nodes of a plan takes: the processes on them (whose old buffers are
    released first), the node buffers to create, the nodes left without one, and each rollout
    worker's endpoint as (id, the node whose buffer it uses or None, its shard or None)."""

    processes: tuple[str, ...]
    buffers: tuple[BufferWiring, ...]
    unbuffered: tuple[str, ...]
    endpoints: tuple[tuple[str, str | None, tuple[int, int] | None], ...]

    def endpoint_specs(self, names: Mapping[str, str]) -> dict[str, dict[str, Any]]:
        """Each rollout worker's endpoint spec, given the created buffers' names by node: the
        buffer's ``name`` and ``node_id``, a shard's ``rank`` and ``world_size``; {} for a worker
        that receives by broadcast into its own buffer."""
        specs: dict[str, dict[str, Any]] = {}
        for pid, node, shard in self.endpoints:
            spec: dict[str, Any] = {} if node is None else {"name": names[node], "node_id": node}
            if shard is not None:
                spec.update(rank=shard[0], world_size=shard[1])
            specs[pid] = spec
        return specs


@public
def node_wiring(plan: SyncPlan, nodes: Iterable[str]) -> NodeWiring:
    """What rebuilding `nodes` of `plan` takes (see `NodeWiring`); nodes not in the plan are ignored
    except that they end up in ``unbuffered``."""
    wanted = set(nodes)
    buffers = []
    uses: dict[str, str] = {}
    for buf in plan.node_buffers:
        if buf.node not in wanted:
            continue
        relay = plan.process(buf.writer).role == "rollout"
        users = (*buf.readers, *((buf.writer,) if relay else ()))
        buffers.append(BufferWiring(buf.node, buf.writer, len(buf.readers) + int(relay), users))
        uses.update(dict.fromkeys(users, buf.node))
    return NodeWiring(
        processes=tuple(p.id for p in plan.processes if p.node in wanted),
        buffers=tuple(buffers),
        unbuffered=tuple(sorted(wanted - {b.node for b in plan.node_buffers})),
        endpoints=tuple((p.id, uses.get(p.id), p.shard) for p in plan.rollouts if p.node in wanted),
    )


def _gpu_index(device: str) -> int:
    """The GPU a process's device names ("cuda:3": 3); 0 for a CPU process or a bare "cuda"."""
    index = device.rpartition(":")[2] if device.startswith("cuda:") else ""
    return int(index) if index.isdigit() else 0


@public
@dataclass
class SyncGroups:
    """The world and communication groups a plan runs in (`for_plan`), and those a later plan
    over the same world needs (`add_missing`). ``groups`` maps a broadcast group's members
    (sender first) to (group id, the sender's world rank); ``gather_groups`` a "Sharded" node to
    its gather group's id; ``gather`` are those groups, made with the world."""

    world: CommGroupPlan
    members: tuple[str, ...]
    gather: tuple[CommGroup, ...]
    gather_groups: dict[str, str]
    groups: dict[tuple[str, ...], tuple[str, int]]
    rank_of: dict[str, int]
    made: dict[tuple[int, ...], str] = field(default_factory=dict)
    rebuilds: int = 0

    @classmethod
    def for_plan(cls, plan: SyncPlan, colocated: bool = False) -> SyncGroups:
        """Ranks for every process of `plan` (only its trainers when `colocated` and nothing runs
        in a group, as the seed), the plan's broadcast groups, the trainers' data-parallel group
        and, with "Sharded", one gather group per node of its rollout workers in shard order."""
        members = [p.id for p in plan.processes]
        if colocated and not plan.groups() and plan.strategy != "Sharded":
            members = [p.id for p in plan.trainers]
        actors = [(pid, plan.process(pid).node, _gpu_index(plan.process(pid).device)) for pid in members]
        transfer = [{"sender": g[0], "receiver": list(g[1:])} for g in plan.groups()]
        trainers = [p.id for p in plan.trainers]
        world = plan_comm_groups(actors, transfer, trainers, weight_buffer_strategy="Double")
        rank_of = {str(r.actor_id): r.rank for r in world.ranks}
        gather: list[CommGroup] = []
        gather_groups: dict[str, str] = {}
        if plan.strategy == "Sharded":
            for node in plan.nodes:
                mates = sorted((p for p in plan.rollouts if p.node == node), key=lambda p: p.shard or (0, 0))
                if mates:
                    gid = f"{GATHER}/{len(gather)}"
                    gather.append(CommGroup(gid, GATHER, tuple(rank_of[p.id] for p in mates), node))
                    gather_groups[node] = gid
        groups, made = {}, {}
        for group, made_group in zip(plan.groups(), world.weight_transfer_groups, strict=True):
            groups[group] = (made_group.group_id, rank_of[group[0]])
            made[made_group.ranks] = made_group.group_id
        return cls(world, tuple(members), tuple(gather), gather_groups, groups, rank_of, made)

    def add_missing(self, plan: SyncPlan) -> list[CommGroup]:
        """Give every broadcast group of `plan` that has none yet a group (one among the same
        ranks if any, else a new one, named ``weight_transfer/r<n>``); returns the new groups to
        create. A SyncPlanError names the processes that have no rank in this world."""
        make: list[CommGroup] = []
        for members in plan.groups():
            if members in self.groups:
                continue
            unknown = [m for m in members if m not in self.rank_of]
            if unknown:
                raise SyncPlanError(f"{', '.join(unknown)} have no rank in the world group")
            ranks = tuple(self.rank_of[m] for m in members)
            gid = self.made.get(ranks)
            if gid is None:
                self.rebuilds += 1
                gid = f"{WEIGHT_TRANSFER}/r{self.rebuilds}"
                make.append(CommGroup(gid, WEIGHT_TRANSFER, ranks, None, ranks[0]))
                self.made[ranks] = gid
            self.groups[members] = (gid, ranks[0])
        return make

    def process_of(self, rank: int) -> str:
        """The process id that holds world rank `rank`."""
        return str(self.world.ranks[rank].actor_id)

    def forget(self, pids: Iterable[str]) -> None:
        """Groups with a member that left are never used again (``groups`` changes in place)."""
        gone = set(pids)
        for members in [m for m in self.groups if gone & set(m)]:
            del self.groups[members]
