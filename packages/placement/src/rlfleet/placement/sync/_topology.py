"""A cost model's link rates taken from a `Topology` (the cluster a sync plan runs on).

The slowest used node sets the rates: its NIC count and the slowest NIC for the network, its
fastest device-to-device link (NVLink) for GPU traffic inside a node, the largest NIC latency.
Everything else (per-tensor, copies, control) stays the cost model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement.cost._model import CostModel
from rlfleet.placement.topology._topology import Topology

__all__ = ["cost_for_topology"]


def cost_for_topology(cost: CostModel, topology: Topology, nodes: Sequence[str]) -> CostModel:
    used = list(dict.fromkeys(nodes))
    unknown = [n for n in used if n not in topology.nodes]
    if unknown:
        raise SyncPlanError(
            f"process node(s) {unknown[:5]} are not in the topology "
            f"(its nodes: {list(topology.nodes)[:5]}...)"
        )
    changes: dict[str, object] = {
        "source": f"{cost.source}; link rates from the topology ({topology.source})"
    }
    ports = [topology.ports(n) for n in used]
    with_ports = [p for p in ports if p]
    if with_ports:
        changes["nics_per_node"] = min(len({port.local for port in p}) for p in with_ports)
        changes["inter_node_bytes_per_s"] = min(port.bandwidth for p in with_ports for port in p)
        changes["latency_s"] = max(port.latency for p in with_ports for port in p)
    nvlink = [
        link.bandwidth
        for link in topology.links
        if link.kind == "nvlink" and topology.node_of(link.a) in used and topology.node_of(link.b) in used
    ]
    if nvlink:
        changes["intra_node_bytes_per_s"] = min(nvlink)
    return dataclasses.replace(cost, **changes)  # type: ignore[arg-type]
