"""Where the group's workers run, and the steps a weight sync takes between them.

`Processes` finds each worker's node and GPU and keeps the seed's views of them:
`placement_info` (workers by node) and `transfer_info` (rlfleet.placement's seed planners).
`plan_steps` turns that into `Step`s, shaped like placement's `SyncStep` so that an executed
`SyncPlan` can replace this planner: a "node_buffer" step writes a node's shared buffer once
(a trainer on the node publishes, or the rollout worker that receives for the node lands a
broadcast in it) and its destinations read it; a "broadcast" step sends every bucket from a
trainer to rollout workers on another node, in a weight-transfer group of (src, *dst).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.placement import build_transfer_info_for_colocated, build_transfer_info_for_disaggregated
from rlfleet.policygroup._calls import Calls, Policy, Roster

NODE_BUFFER, BROADCAST = "node_buffer", "broadcast"


@dataclass
class Step:
    """One transfer of a sync. `after`: the steps whose bytes this one needs."""

    index: int
    transport: str
    src: Policy
    dst: list[Policy]
    node: Hashable  # node_buffer: the node whose buffer; broadcast: the destinations' node
    after: tuple[int, ...] = ()
    group_id: str | None = None  # broadcast: its weight-transfer group, once it exists
    src_rank: int | None = None  # broadcast: the sender's world rank


class Processes:
    """Node and GPU of every worker, `placement_info` and `transfer_info` (the seed's shapes)."""

    def __init__(self, roster: Roster, calls: Calls) -> None:
        self.roster = roster
        self.calls = calls
        self.node_of: dict[Hashable, Any] = {}
        self.gpu_of: dict[Hashable, int] = {}
        self.placement_info: dict[Any, dict[str, list[Policy]]] = {}
        self.transfer_info: dict[Any, list[dict[str, Any]]] = {}
        self.colocated = False

    def locate(self, policies: Sequence[Policy]) -> None:
        """Ask each worker not located yet for its node and GPU."""
        todo = [p for p in policies if self.roster.wid(p) not in self.node_of]
        if not todo:
            return
        nodes = self.calls.call_all(todo, "_get_node_id")
        gpus = self.calls.call_all(todo, "_get_gpu_ids")
        for p, node, gpu in zip(todo, nodes, gpus, strict=True):
            self.node_of[self.roster.wid(p)] = node
            self.gpu_of[self.roster.wid(p)] = gpu[0] if gpu else 0

    def node(self, policy: Policy) -> Any:
        self.locate([policy])
        return self.node_of[self.roster.wid(policy)]

    def place(self, colocated: bool, strategy: str) -> None:
        """Workers by node, then the transfers between them (the seed's planners)."""
        self.colocated = colocated
        roster = self.roster
        self.locate(roster.train_list + roster.eval_list)
        info: dict[Any, dict[str, list[Policy]]] = {}
        for key, members in (("train_policies", roster.train_list), ("eval_policies", roster.eval_list)):
            for p in members:
                entry = info.setdefault(self.node(p), {"train_policies": [], "eval_policies": []})
                entry[key].append(p)
        self.placement_info = info
        self.plan_transfers(strategy)

    def plan_transfers(self, strategy: str) -> None:
        self.placement_info = {n: e for n, e in self.placement_info.items() if any(e.values())}
        train, evals = self.roster.train_list, self.roster.eval_list
        if not train or not evals:
            self.transfer_info = {}
        elif self.colocated:
            self.transfer_info = build_transfer_info_for_colocated(train, evals)
        else:  # the seed's planner knows no "Sharded": its transfers are Double's
            seed = "Double" if strategy == "Sharded" else strategy
            self.transfer_info = build_transfer_info_for_disaggregated(self.placement_info, seed)

    def drop(self, policy: Policy) -> None:
        for entry in self.placement_info.values():
            entry["eval_policies"] = [p for p in entry["eval_policies"] if p is not policy]


def _add(members: list[Policy], policy: Policy) -> None:
    if all(policy is not m for m in members):
        members.append(policy)


def plan_steps(processes: Processes, shared: bool) -> list[Step]:
    """The steps of one sync from `transfer_info`: the trainers' node buffers, then each broadcast
    (with "Shared", followed by the node buffer it fills: one rollout worker receives for its
    node, the others read that node's buffer)."""
    node: Callable[[Policy], Any] = processes.node
    evals = processes.roster.eval_list
    writers: dict[Any, Policy] = {}
    readers: dict[Any, list[Policy]] = {}
    cross: list[tuple[Policy, list[Policy], Any]] = []  # (sender, receivers, their node)
    fed: set[Any] = set()  # nodes whose buffer gets filled ("Shared")
    for item in (it for items in processes.transfer_info.values() for it in items):
        sender, receivers = item["sender"], item["receiver"]
        receivers = receivers if isinstance(receivers, list) else [receivers]
        s_node = node(sender)
        if item.get("intra_node") or (receivers and all(node(r) == s_node for r in receivers)):
            writers.setdefault(s_node, sender)
            for r in [p for p in evals if node(p) == s_node] if shared else receivers:
                _add(readers.setdefault(s_node, []), r)
            fed.add(s_node)
            continue
        for r in receivers:
            r_node = node(r)
            if shared and r_node in fed:
                _add(readers.setdefault(r_node, []), r)
            elif shared:
                fed.add(r_node)
                cross.append((sender, [r], r_node))
                for other in (p for p in evals if node(p) == r_node and p is not r):
                    _add(readers.setdefault(r_node, []), other)
            else:
                same = [c for c in cross if c[0] is sender and c[2] == r_node]
                if same:
                    same[0][1].append(r)
                else:
                    cross.append((sender, [r], r_node))
    broadcast_to = {processes.roster.wid(r) for _, rs, _ in cross for r in rs}
    if shared:  # a rollout worker that receives a broadcast never also reads its node buffer
        readers = {
            n: [r for r in rs if processes.roster.wid(r) not in broadcast_to] for n, rs in readers.items()
        }
    steps = [Step(0, NODE_BUFFER, w, readers.get(n, []), n) for n, w in writers.items()]
    for sender, receivers, r_node in cross:
        steps.append(Step(0, BROADCAST, sender, receivers, r_node))
        if shared:
            steps.append(
                Step(0, NODE_BUFFER, receivers[0], readers.get(r_node, []), r_node, (len(steps) - 1,))
            )
    for i, step in enumerate(steps):
        step.index = i
    return steps
