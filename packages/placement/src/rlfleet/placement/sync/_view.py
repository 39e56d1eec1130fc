"""The seed-shaped ``transfer_info`` and ``router_map`` as views of a `SyncPlan` (derived, never parsed back).

Disaggregated shape: ``{sender_node: [{"sender", "receiver", "intra_node"}, ...]}`` in step order.
A broadcast step is one item (its destinations are the receivers). A node-local step written by a
trainer is an intra-node item; with "Shared" it names no receivers, as the seed's does (the
sender fills the node's buffer). Node-local steps written by a rollout worker are the node's own
fan-out after a broadcast landed there: the seed has no item for them. Colocated plans give
``{"all": [{"sender", "receiver"}, ...]}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlfleet.placement._errors import SyncPlanError

if TYPE_CHECKING:
    from rlfleet.placement.sync._plan import SyncPlan

__all__ = ["router_map_view", "transfer_info_view"]


def transfer_info_view(plan: SyncPlan, objects: Mapping[str, Any]) -> dict[Any, list[dict[str, Any]]]:
    def obj(pid: str) -> Any:
        try:
            return objects[pid]
        except KeyError:
            raise SyncPlanError(f"transfer_info: no object given for process {pid!r}") from None

    roles = {p.id: p for p in plan.processes}
    if plan.colocated:
        return {"all": [{"sender": obj(s.src), "receiver": obj(d)} for s in plan.steps for d in s.dst]}
    info: dict[Any, list[dict[str, Any]]] = {}
    for step in plan.steps:
        src = roles[step.src]
        local = step.transport in ("node_buffer", "cuda_ipc")
        if local and src.role != "trainer":
            continue
        intra = local or all(roles[d].node == src.node for d in step.dst)
        receivers = [] if local and plan.strategy == "Shared" else [obj(d) for d in step.dst]
        info.setdefault(src.node, []).append(
            {"sender": obj(step.src), "receiver": receivers, "intra_node": intra}
        )
    return info


def router_map_view(plan: SyncPlan) -> dict[str, list[str]]:
    """The seed's ``router_map``: each trainer node -> the nodes its version reaches, itself first
    when rollout workers share it, in step order.

    A node a relay fills (a rollout worker forwarding what it received) counts for the trainer
    node that fed the relay, as the seed counts an eval node for the train node it is assigned
    to. Colocated plans map every trainer node to itself."""
    processes = {p.id: p for p in plan.processes}
    origin: dict[str, str] = {}  # process -> the trainer node its version came from
    for p in plan.processes:
        if p.role == "trainer":
            origin[p.id] = p.node
    out: dict[str, list[str]] = {}
    for step in plan.steps:
        root = origin.get(step.src)
        if root is None:
            raise SyncPlanError(f"router_map: step {step.index} sends from {step.src!r} before it received")
        reached = out.setdefault(root, [])
        for d in step.dst:
            origin.setdefault(d, root)
            node = processes[d].node
            if node not in reached:
                reached.append(node)
    for node, reached in out.items():  # the seed lists a mixed node first, as its own receiver
        if node in reached:
            reached.remove(node)
            reached.insert(0, node)
    return out
