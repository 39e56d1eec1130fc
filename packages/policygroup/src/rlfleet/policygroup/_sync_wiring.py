"""A `SyncPlan`'s node buffers, endpoints and communication groups made on the actors; what to make
is placement's (`node_wiring`, `SyncGroups`). Releasing a node's buffers also closes its workers'
CUDA IPC channels; groups a re-plan needs are made among their members alone."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rlfleet.placement import CommGroupPlan, SyncGroups, SyncPlan, node_wiring
from rlfleet.policygroup import _comm
from rlfleet.policygroup._calls import Calls
from rlfleet.policygroup._config import PolicyConfig
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.policygroup._sync_plan import Processes


class Wiring:
    """Node buffers, endpoints and communication groups of the plan being run."""

    def __init__(self, calls: Calls, processes: Processes, config: PolicyConfig, uid: str) -> None:
        self.calls, self.processes, self.config, self.uid = calls, processes, config, uid
        self.node_buffers: dict[Any, dict[str, Any]] = {}  # the seed's shared_weight_buffer_map
        self.names: dict[str, str] = {}  # node -> its buffer's name
        self.comm: SyncGroups | None = None  # set by `form`, with `groups` and `world`
        self.groups: dict[tuple[str, ...], tuple[str, int]] = {}  # members -> (group id, sender's rank)
        self.world: CommGroupPlan | None = None
        self.backend = "gloo"

    def wire_nodes(self, plan: SyncPlan, layout: Mapping[str, Any], nodes: Iterable[str]) -> None:
        """Rebuild the node buffer and the rollout workers' endpoints of `nodes` (none: nothing)."""
        todo, by_pid, wb = node_wiring(plan, nodes), self.processes.by_pid(), self.config.weight_buffer
        self.calls.call_all([by_pid[p] for p in todo.processes], "release_weight_buffers")
        for buf in todo.buffers:
            node, writer = buf.node, by_pid[buf.writer]
            args = (dict(layout), buf.readers, f"rlfleet-{self.uid}", wb.checksums)
            [self.names[node]] = self.calls.call_all([writer], "create_shared_writer", *args)
            spec, users = {"name": self.names[node], "node_id": node}, [by_pid[r] for r in buf.users]
            self.node_buffers[node] = {"shared_weight_buffer": spec, "eval_policies": users, "writer": writer}
        for node in todo.unbuffered:
            self.node_buffers.pop(node, None)
            self.names.pop(node, None)
        kwargs = {"strategy": plan.strategy, "layout": dict(layout)}
        ends = [(by_pid[p], spec) for p, spec in todo.endpoint_specs(self.names).items()]
        calls = [(p, self.calls.invoke(p, "init_weight_buffer", spec or None, **kwargs)) for p, spec in ends]
        results = self.calls.gather(calls, self.config.rpc_timeout_s, "init_weight_buffer")
        for (p, _), (_, err) in zip(calls, results, strict=True):
            if err is not None:
                self.calls.raise_for(p, err, "init_weight_buffer")

    def form(self, plan: SyncPlan, backend: str) -> None:
        """The world group, intra-node groups, the plan's groups, the train data-parallel group and,
        for "Sharded", each node's gather group, on the actors, bounded (`init_comm_group`)."""
        comm, by_pid = SyncGroups.for_plan(plan, self.processes.colocated), self.processes.by_pid()
        comm.rebuilds = 0 if self.comm is None else self.comm.rebuilds  # names of later groups stay unique
        actors = {pid: by_pid[pid] for pid in comm.members}
        names = {pid: self.processes.roster.name(p) for pid, p in actors.items()}
        self.backend, timeout = backend, self.config.group_timeout_s
        _comm.init_world(comm.world, actors, names, backend, timeout, comm.gather)
        self.comm, self.world = comm, comm.world
        self.groups = comm.groups

    def ensure_groups(self, plan: SyncPlan) -> None:
        """A member group for every group of `plan` that has none yet (after a re-plan; none: no call)."""
        if all(g in self.groups for g in plan.groups()):
            return
        if self.comm is None:
            raise PolicyGroupError("cross-node weight transfer needs init_comm_group() first")
        try:
            make = self.comm.add_missing(plan)
        except ValueError as exc:
            raise PolicyGroupError(f"{exc}; call init_comm_group()") from exc
        by_pid, timeout = self.processes.by_pid(), self.config.group_timeout_s
        actors = {pid: by_pid[pid] for pid in {self.comm.process_of(r) for g in make for r in g.ranks}}
        names = {pid: self.processes.roster.name(p) for pid, p in by_pid.items()}
        _comm.create_groups(self.comm.world, make, actors, names, self.backend, timeout)

    def forget(self, pids: Iterable[str]) -> None:
        """Groups with a member that left are never used again (in place: `comm` shares `groups`)."""
        if self.comm is not None:
            self.comm.forget(pids)
