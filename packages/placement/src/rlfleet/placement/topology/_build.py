"""Building a `Topology`: from a plain-dict spec, or a synthetic homogeneous cluster."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from rlfleet.placement._errors import TopologyError
from rlfleet.placement._format import human_rate
from rlfleet.placement.topology._graph import Link, Switch, TopologyGraph

__all__ = ["SyntheticLinks", "build_from_spec", "build_synthetic", "check_id"]

G = TypeVar("G", bound=TopologyGraph)


def check_id(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise TopologyError(f"{where}: id must be a non-empty string, got {value!r}")
    if "/" in value or value.startswith("@"):
        raise TopologyError(f"{where}: id {value!r} may not contain '/' or start with '@'")
    return value


def _check_keys(entry: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    unknown = sorted(str(k) for k in entry if k not in allowed)
    if unknown:
        raise TopologyError(f"{where}: unknown key(s) {unknown}; allowed: {list(allowed)}")


def _as_mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TopologyError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _as_list(value: object, where: str) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise TopologyError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def build_from_spec(spec: Mapping[str, Any], cls: type[G]) -> G:
    """See `Topology.from_spec`: a ``cls`` built from ``spec``."""
    spec = _as_mapping(spec, "spec")
    _check_keys(spec, ("nodes", "switches", "links"), "spec")
    topo = cls()
    topo.source = "spec"
    for i, raw in enumerate(_as_list(spec.get("nodes", []), "spec.nodes")):
        where = f"nodes[{i}]"
        entry = _as_mapping(raw, where)
        _check_keys(entry, ("id", "devices"), where)
        node = check_id(entry.get("id"), where)
        topo._add_node(node, f"{where} ({node!r})")
        for j, raw_dev in enumerate(_as_list(entry.get("devices", []), f"{where}.devices")):
            dwhere = f"nodes[{i}].devices[{j}]"
            dev = _as_mapping(raw_dev, dwhere)
            _check_keys(dev, ("id", "kind"), dwhere)
            did = check_id(dev.get("id"), dwhere)
            topo._add_device(node, did, dev.get("kind", "gpu"), f"{dwhere} ({node}/{did})")
    for i, raw in enumerate(_as_list(spec.get("switches", []), "spec.switches")):
        where = f"switches[{i}]"
        entry = _as_mapping(raw, where)
        _check_keys(entry, ("id", "node"), where)
        sid = check_id(entry.get("id"), where)
        owner = entry.get("node")
        if owner is not None and not isinstance(owner, str):
            raise TopologyError(f"{where}: node must be a string, got {owner!r}")
        topo._add_switch(Switch(sid, owner), f"{where} ({sid!r})")
    for i, raw in enumerate(_as_list(spec.get("links", []), "spec.links")):
        where = f"links[{i}]"
        entry = _as_mapping(raw, where)
        _check_keys(entry, ("a", "b", "kind", "bandwidth", "latency"), where)
        a, b = entry.get("a"), entry.get("b")
        if not isinstance(a, str) or not isinstance(b, str):
            raise TopologyError(f"{where}: endpoints 'a' and 'b' must be vertex id strings, got {a!r}, {b!r}")
        for key in ("kind", "bandwidth"):
            if key not in entry:
                raise TopologyError(f"{where} ({a!r} - {b!r}): missing {key!r}")
        link = Link(a, b, entry["kind"], entry["bandwidth"], entry.get("latency", 0.0))
        topo._add_link(link, f"{where} ({a!r} - {b!r})")
    return topo


class SyntheticLinks(NamedTuple):
    """Per-direction bandwidth (bytes/s) and latency (s) of a synthetic node's three link kinds."""

    nvlink_bandwidth: float
    nvlink_latency: float
    pcie_bandwidth: float
    pcie_latency: float
    nic_bandwidth: float
    nic_latency: float


def build_synthetic(
    cls: type[G],
    nodes: int,
    gpus_per_node: int,
    rates: SyntheticLinks,
    *,
    nic_per: str,
    nvlink: bool,
    node_prefix: str,
) -> G:
    """See `Topology.synthetic`: a ``cls`` of ``nodes`` equal nodes behind one fabric switch."""
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise TopologyError(f"synthetic: nodes must be a positive int, got {nodes!r}")
    if not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool) or gpus_per_node < 0:
        raise TopologyError(f"synthetic: gpus_per_node must be a non-negative int, got {gpus_per_node!r}")
    if nic_per not in ("gpu", "node"):
        raise TopologyError(f"synthetic: nic_per must be 'gpu' or 'node', got {nic_per!r}")
    if nic_per == "gpu" and gpus_per_node == 0:
        raise TopologyError("synthetic: nic_per='gpu' needs gpus_per_node >= 1")
    check_id(node_prefix + "0", "synthetic: node_prefix")
    topo = cls()
    topo.source = (
        f"synthetic: {nodes} nodes x {gpus_per_node} GPUs, NIC {human_rate(rates.nic_bandwidth)} "
        f"per {nic_per.upper() if nic_per == 'gpu' else nic_per}"
    )
    fabric = Switch("fabric")
    for n in range(nodes):
        node = f"{node_prefix}{n}"
        topo._add_node(node, f"synthetic node {node!r}")
        for g in range(gpus_per_node):
            topo._add_device(node, f"gpu{g}", "gpu", f"synthetic device {node}/gpu{g}")
    topo._add_switch(fabric, "synthetic fabric")
    for node, devs in topo._nodes.items():
        where = f"synthetic links of {node!r}"
        use_nvswitch = nvlink and len(devs) > 1
        if use_nvswitch:
            nvs = Switch("nvswitch", node)
            topo._add_switch(nvs, where)
        for dev in devs:
            nic = (rates.nic_bandwidth, rates.nic_latency)
            if use_nvswitch:
                nvl = (rates.nvlink_bandwidth, rates.nvlink_latency)
                topo._add_link(Link(dev, f"{node}/nvswitch", "nvlink", *nvl), where)
            topo._add_link(Link(dev, node, "pcie", rates.pcie_bandwidth, rates.pcie_latency), where)
            if nic_per == "gpu":
                topo._add_link(Link(dev, fabric.vertex, "network", *nic), where)
        if nic_per == "node":
            nic = (rates.nic_bandwidth, rates.nic_latency)
            topo._add_link(Link(node, fabric.vertex, "network", *nic), where)
    return topo
