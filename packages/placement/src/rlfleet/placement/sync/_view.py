"""The seed-shaped ``transfer_info`` as a view of a `SyncPlan` (derived, never parsed back).

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

__all__ = ["transfer_info_view"]


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
