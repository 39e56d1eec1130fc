"""The group's workers as rlfleet.placement `SyncProcess`es, and the `SyncPlan` placement makes.

`Processes` finds each worker's node and device (one call per worker, once) and names it with a
stable id ("t0" for a trainer, "r3" for a rollout worker: given at first sight in roster order,
kept while the worker keeps its role, so a plan made after a death differs from the previous
one only where the group changed).
`plan_for` asks placement for the plan: `plan_sync` ("rlfleet", several senders by default) or
`seed_sync_plan` ("seed", the seed's round-robin funnel), priced on the cluster's topology
(`Topology.from_ray_nodes`, with the configured overrides) and validated. Nothing here plans a
transfer itself: the plan is executed as it is (`_sync_run`). `ipc_mode` says whether placement
may hand weights over by CUDA IPC ("cuda_ipc" steps; ``weight_buffer.cuda_ipc``).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal

import ray

from rlfleet.placement import CostModel, SyncPlan, SyncProcess, Topology, plan_sync, seed_sync_plan
from rlfleet.policygroup._calls import Calls, Policy, Roster
from rlfleet.policygroup._comm import ray_nodes
from rlfleet.policygroup._config import PolicyConfig
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.weightsync import Layout


class Processes:
    """Node, device and stable id of every worker; the seed's `placement_info` view."""

    def __init__(self, roster: Roster, calls: Calls) -> None:
        self.roster = roster
        self.calls = calls
        self.node_of: dict[Hashable, Any] = {}
        self.gpu_of: dict[Hashable, int] = {}  # -1: a CPU worker
        self.ip_of: dict[Hashable, str] = {}  # the machine: raylets of one machine share its NICs
        self.colocated = False
        self._ids: dict[Hashable, tuple[str, str]] = {}  # worker -> (role, id)
        self._counters = {role: itertools.count() for role in ("trainer", "rollout")}

    def locate(self, policies: Sequence[Policy]) -> None:
        """Ask each worker not located yet for its node and GPU."""
        todo = [p for p in policies if self.roster.wid(p) not in self.node_of]
        if not todo:
            return
        nodes = self.calls.call_all(todo, "_get_node_id")
        devices = self.calls.call_all(todo, "report_node_ip_and_gpu_id")
        for p, node, (ip, gpu) in zip(todo, nodes, devices, strict=True):
            self.node_of[self.roster.wid(p)] = str(node)
            self.ip_of[self.roster.wid(p)] = str(ip)
            self.gpu_of[self.roster.wid(p)] = int(gpu)

    def node(self, policy: Policy) -> Any:
        self.locate([policy])
        return self.node_of[self.roster.wid(policy)]

    def pid(self, policy: Policy) -> str:
        """The worker's process id in sync plans (a new one when its role changed)."""
        for p in [*self.roster.train_list, *self.roster.eval_list, policy]:  # first sight: roster order
            role = "trainer" if self.roster.is_trainer(p) else "rollout"
            wid = self.roster.wid(p)
            if self._ids.get(wid, ("", ""))[0] != role:
                self._ids[wid] = (role, f"{role[0]}{next(self._counters[role])}")
        return self._ids[self.roster.wid(policy)][1]

    def by_pid(self) -> dict[str, Policy]:
        return {self.pid(p): p for p in self.roster.train_list + self.roster.eval_list}

    @property
    def placement_info(self) -> dict[Any, dict[str, list[Policy]]]:
        """The seed's view: workers by node."""
        info: dict[Any, dict[str, list[Policy]]] = {}
        for key, members in (
            ("train_policies", self.roster.train_list),
            ("eval_policies", self.roster.eval_list),
        ):
            for p in members:
                info.setdefault(self.node(p), {"train_policies": [], "eval_policies": []})[key].append(p)
        return info

    def sync_processes(self, strategy: str) -> list[SyncProcess]:
        """Every worker as a SyncProcess; "Sharded" rollout worker i of a node keeps share i."""
        roster = self.roster
        self.locate(roster.train_list + roster.eval_list)
        out = []
        for p in roster.train_list:
            out.append(SyncProcess(self.pid(p), "trainer", self.node(p), self._device(p), None, self._ip(p)))
        by_node: dict[Any, list[Policy]] = {}
        for p in roster.eval_list:
            by_node.setdefault(self.node(p), []).append(p)
        for p in roster.eval_list:
            mates = by_node[self.node(p)]
            shard = (mates.index(p), len(mates)) if strategy == "Sharded" else None
            out.append(SyncProcess(self.pid(p), "rollout", self.node(p), self._device(p), shard, self._ip(p)))
        return out

    def _ip(self, policy: Policy) -> str:
        return self.ip_of[self.roster.wid(policy)]

    def _device(self, policy: Policy) -> str:
        gpu = self.gpu_of[self.roster.wid(policy)]
        return "cpu" if gpu < 0 else f"cuda:{gpu}"


def cluster_topology(nodes: Sequence[str], overrides: Mapping[str, Any] | None) -> Topology | None:
    """The cluster as rlfleet.placement sees it (`ray.nodes()`); None without Ray (local objects)."""
    if not ray.is_initialized():
        return None
    listed = ray_nodes()
    known = {str(n.get("NodeID")) for n in listed if n.get("Alive")}
    if not listed or not set(nodes) <= known:
        return None
    return Topology.from_ray_nodes(listed, overrides)


def cost_overrides(cost: CostModel | None) -> dict[str, Any]:
    """Topology rates that agree with a calibrated cost model (so pricing keeps its rates)."""
    if cost is None:
        return {}
    return {
        "nic_bandwidth": cost.inter_node_bytes_per_s,
        "nic_latency": cost.latency_s,
        "host_bandwidth": cost.intra_node_bytes_per_s,
    }


def ipc_mode(config: PolicyConfig, actors: bool) -> bool | Literal["force"]:
    """`plan_sync`'s ``cuda_ipc`` for this config: True lets GPU workers of a node meet by CUDA
    IPC, "force" every same-node worker ("host"), False none. IPC steps run between processes
    (Ray actors: `actors`); "Shared" binds its node buffer zero-copy, so it keeps that buffer."""
    wb = config.weight_buffer
    if wb.cuda_ipc == "off" or wb.buffer_strategy == "Shared":
        return False
    if not actors:
        if wb.cuda_ipc == "host":
            raise PolicyGroupError(
                "weight_buffer.cuda_ipc 'host' needs Ray actors: an IPC channel joins two processes"
            )
        return False
    return "force" if wb.cuda_ipc == "host" else True


def plan_for(
    processes: Sequence[SyncProcess],
    layout: Mapping[str, Any],
    config: PolicyConfig,
    colocated: bool,
    cuda_ipc: bool | Literal["force"] = False,
) -> SyncPlan:
    """The plan placement makes for these processes and the trainers' layout (validated);
    `cuda_ipc` from `ipc_mode`."""
    wb = config.weight_buffer
    parsed = Layout.from_dict(layout)
    sizes = [b.nbytes for b in parsed.buckets]
    tensors = [len(b.tensors) for b in parsed.buckets]
    overrides = {**cost_overrides(config.cost_model), **dict(config.topology or {})}
    topology = cluster_topology([p.node for p in processes], overrides)
    common: dict[str, Any] = {
        "topology": topology,
        "cost": config.cost_model,
        "layout_digest": parsed.digest,
        "bucket_tensors": tensors,
    }
    try:
        if wb.planner == "seed":
            plan = seed_sync_plan(processes, sizes, wb.buffer_strategy, colocated=colocated, **common)
        else:
            plan = plan_sync(
                processes,
                sizes,
                wb.buffer_strategy,
                senders=wb.senders,  # type: ignore[arg-type]
                fanout=wb.fanout,  # type: ignore[arg-type]
                cuda_ipc=cuda_ipc,
                **common,
            )
        plan.validate()
        if not cuda_ipc and any(s.transport == "cuda_ipc" for s in plan.steps):
            raise ValueError(
                "the seed's colocated plan hands weights to GPU workers by CUDA IPC, which "
                "weight_buffer.cuda_ipc and these workers do not allow (use Ray actors and cuda_ipc "
                "'auto', or planner 'rlfleet')"
            )
    except ValueError as exc:
        raise PolicyGroupError(f"sync plan: {exc}") from exc
    return plan
