"""A `SyncPlan`'s node buffers, endpoints and communication groups made on the actors; what to make
is placement's (`node_wiring`, `SyncGroups`, `CommGroupPlan.creation_calls`). Releasing a node's
buffers also closes its workers' CUDA IPC channels; groups a re-plan needs are made among their
members alone. Every call on the actors is bounded, and its error names the rank that failed."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ray

from rlfleet.placement import CommGroup, CommGroupPlan, SyncGroups, SyncPlan, node_wiring
from rlfleet.policygroup._config import PolicyConfig
from rlfleet.policygroup._errors import CommGroupFormationError, PolicyGroupError, WorkerDiedError
from rlfleet.policygroup._ray_node import local_host
from rlfleet.policygroup.driver._calls import Calls
from rlfleet.policygroup.sync._plan import Processes
from rlfleet.weightsync import CommGroupError

RankCall = Callable[..., tuple[str, Any]]  # (rank, method, *args) -> (who, the started call)


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
        for "Sharded", each node's gather group, on the actors (`init_comm_group`).

        Rank 0 hosts the rendezvous store; every rank joins the world (naming the ranks that did
        not show up in time), then creates its groups in one call, in plan order."""
        comm = SyncGroups.for_plan(plan, self.processes.colocated)
        comm.rebuilds = 0 if self.comm is None else self.comm.rebuilds  # names of later groups stay unique
        self.backend, world = backend, comm.world
        if world.ranks:
            timeout, epoch = self.config.group_timeout_s, uuid.uuid4().hex[:12]
            call = self._rank_calls(world)
            host = call(0, "_get_addr_and_port", local_host())
            [(addr, port)] = _wait([host], timeout + 15.0, "rendezvous")
            env = {"world_size": world.world_size, "master_addr": addr, "master_port": port}
            env.update(backend=backend, timeout_s=timeout, epoch=epoch)
            joins = []
            for r in world.ranks:
                local = {"rank": r.rank, "local_rank": r.local_rank, "local_world_size": r.local_world_size}
                joins.append(call(r.rank, "init_distributed_env", **local, **env))
            _wait(joins, timeout + 15.0, "init_distributed_env")
            self._create(call, world, [*world.groups, *comm.gather], registered=True)
        self.comm, self.world, self.groups = comm, world, comm.groups

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
        self._create(self._rank_calls(self.comm.world), self.comm.world, make, registered=False)

    def forget(self, pids: Iterable[str]) -> None:
        """Groups with a member that left are never used again (in place: `comm` shares `groups`)."""
        if self.comm is not None:
            self.comm.forget(pids)

    def _create(
        self, call: RankCall, world: CommGroupPlan, groups: Sequence[CommGroup], registered: bool
    ) -> None:
        """`groups` on the actors, one call per rank (so a rank creates its groups in order)."""
        timeout = self.config.group_timeout_s
        calls = [
            call(rank, "init_comm_groups", specs, self.backend, timeout, registered)
            for rank, specs in world.creation_calls(groups, registered).items()
        ]
        _wait(calls, timeout + 15.0, "create communication groups")

    def _rank_calls(self, world: CommGroupPlan) -> RankCall:
        """call(rank, method, *args) -> (who: the rank, its worker and node; the started call)."""
        by_pid = self.processes.by_pid()  # a SyncGroups world ranks process ids

        def call(rank: int, method: str, /, *args: Any, **kwargs: Any) -> tuple[str, Any]:
            info = world.ranks[rank]
            policy = by_pid[str(info.actor_id)]
            who = f"rank {rank} ({self.processes.roster.name(policy)}, node {str(info.node_id)[:12]})"
            return who, getattr(policy, method).remote(*args, **kwargs)

        return call


def _wait(calls: Sequence[tuple[str, Any]], timeout_s: float, what: str) -> list[Any]:
    """Every call's value within `timeout_s`; an error names whose call failed or did not finish."""
    refs = [ref for _, ref in calls]
    if not refs:
        return []
    _ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [who for who, ref in calls if ref in set(pending)]
        raise CommGroupFormationError(f"{what}: {', '.join(late)} did not finish within {timeout_s:.1f}s")
    out = []
    for who, ref in calls:
        try:
            out.append(ray.get(ref, timeout=1.0))
        except ray.exceptions.RayActorError as exc:
            raise WorkerDiedError(f"{what}: {who} died: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            missing = cause.missing_ranks if isinstance(cause, CommGroupError) else ()
            raise CommGroupFormationError(f"{what}: {who} failed: {cause}", missing) from cause
    return out
