"""The group's workers as placement's `SyncProcess`es, each with a stable id ("t0", "r3": given
at first sight in roster order, kept while the worker keeps its role, so a plan made after a death
differs only where the group changed), and placement's plan for them, priced on the cluster."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import ray

from rlfleet.placement import SyncPlan, SyncProcess, Topology, cuda_ipc_mode, make_sync_plan, sync_processes
from rlfleet.policygroup._config import PolicyConfig
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.policygroup._ray_node import ray_nodes
from rlfleet.policygroup.driver._calls import Calls, Policy, Roster
from rlfleet.weightsync import Layout


class Processes:
    """Node, device and stable id of every worker; the seed's `placement_info` view."""

    def __init__(self, roster: Roster, calls: Calls) -> None:
        self.roster, self.calls, self.colocated = roster, calls, False
        self.node_of: dict[Hashable, Any] = {}
        self.gpu_of: dict[Hashable, int] = {}  # -1: a CPU worker
        self.ip_of: dict[Hashable, str] = {}  # the machine: raylets of one machine share its NICs
        self._ids: dict[Hashable, tuple[str, str]] = {}  # worker -> (role, id)
        self._counters = {role: itertools.count() for role in ("trainer", "rollout")}

    def locate(self, policies: Sequence[Policy]) -> None:
        """Ask each worker not located yet for its node and GPU."""
        todo = [p for p in policies if self.roster.wid(p) not in self.node_of]
        if todo:
            nodes = self.calls.call_all(todo, "_get_node_id")
            devices = self.calls.call_all(todo, "report_node_ip_and_gpu_id")
            for p, node, (ip, gpu) in zip(todo, nodes, devices, strict=True):
                wid = self.roster.wid(p)
                self.node_of[wid], self.ip_of[wid], self.gpu_of[wid] = str(node), str(ip), int(gpu)

    def node(self, policy: Policy) -> Any:
        self.locate([policy])
        return self.node_of[self.roster.wid(policy)]

    def pid(self, policy: Policy) -> str:
        """The worker's process id in sync plans (a new one when its role changed)."""
        for p in [*self.roster.train_list, *self.roster.eval_list, policy]:  # first sight: roster order
            role = "trainer" if self.roster.is_trainer(p) else "rollout"
            if self._ids.get(self.roster.wid(p), ("", ""))[0] != role:
                self._ids[self.roster.wid(p)] = (role, f"{role[0]}{next(self._counters[role])}")
        return self._ids[self.roster.wid(policy)][1]

    def by_pid(self) -> dict[str, Policy]:
        return {self.pid(p): p for p in self.roster.train_list + self.roster.eval_list}

    @property
    def placement_info(self) -> dict[Any, dict[str, list[Policy]]]:
        """The seed's view: workers by node."""
        info: dict[Any, dict[str, list[Policy]]] = {}
        for p in self.roster.train_list + self.roster.eval_list:
            entry = info.setdefault(self.node(p), {"train_policies": [], "eval_policies": []})
            entry["train_policies" if self.roster.is_trainer(p) else "eval_policies"].append(p)
        return info

    def sync_processes(self, strategy: str) -> list[SyncProcess]:
        """Every worker as a SyncProcess (placement's `sync_processes`: shares for "Sharded")."""
        workers = self.roster.train_list + self.roster.eval_list
        self.locate(workers)
        sites = []
        for p in workers:
            wid, role = self.roster.wid(p), "trainer" if self.roster.is_trainer(p) else "rollout"
            sites.append((self.pid(p), role, self.node_of[wid], self.gpu_of[wid], self.ip_of[wid]))
        return sync_processes(sites, strategy)


def cluster_topology(nodes: Sequence[str], overrides: Mapping[str, Any]) -> Topology | None:
    """The cluster as placement sees it (`ray.nodes()`); None without Ray (local objects)."""
    listed = ray_nodes() if ray.is_initialized() else []
    known = {str(n.get("NodeID")) for n in listed if n.get("Alive")}
    return Topology.from_ray_nodes(listed, overrides) if listed and set(nodes) <= known else None


def plan_for(
    processes: Sequence[SyncProcess],
    layout: Mapping[str, Any],
    config: PolicyConfig,
    colocated: bool,
    actors: bool,
) -> SyncPlan:
    """Placement's plan for these processes and the trainers' layout (`actors`: Ray actors, which
    CUDA IPC channels can join), priced on the cluster."""
    wb, parsed, cost = config.weight_buffer, Layout.from_dict(layout), config.cost_model
    try:
        cuda_ipc = cuda_ipc_mode(wb.cuda_ipc, wb.buffer_strategy, actors)
    except ValueError as exc:
        raise PolicyGroupError(f"weight_buffer: {exc}") from exc
    overrides = {**(cost.topology_overrides() if cost else {}), **(config.topology or {})}
    topology = cluster_topology([p.node for p in processes], overrides)
    try:
        return make_sync_plan(
            processes,
            [b.nbytes for b in parsed.buckets],
            wb.buffer_strategy,
            planner=wb.planner,
            bucket_tensors=[len(b.tensors) for b in parsed.buckets],
            layout_digest=parsed.digest,
            topology=topology,
            cost=cost,
            colocated=colocated,
            senders=wb.senders,
            fanout=wb.fanout,
            cuda_ipc=cuda_ipc,
        )
    except ValueError as exc:
        raise PolicyGroupError(f"sync plan: {exc}") from exc
