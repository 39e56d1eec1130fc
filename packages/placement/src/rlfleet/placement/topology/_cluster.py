"""A `Topology` of the cluster a program runs on: Ray's node list, optionally ``nvidia-smi topo -m``.

`topology_from_ray_nodes` takes the output of ``ray.nodes()`` as plain data (placement never imports
Ray). Ray says which nodes are alive, their ids, CPU and GPU counts and accelerator type; it says
nothing about links. Rates therefore come from, in order: per-node ``overrides``, an
``nvidia-smi topo -m`` matrix of the node (NVLink counts, which NIC sits next to which GPU), the
hardware profile of the node's accelerator type (``HARDWARE_PROFILES``), and otherwise a documented
fallback: GPUs meet over PCIe (32 GB/s) and the node has one 12.5 GB/s (100 Gb/s) NIC; a CPU node's
slots meet in shared memory at 10 GB/s and the node has one 1.25 GB/s (10 Gb/s) NIC. The
topology's ``source`` says which applied, and sync plans priced on it report it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rlfleet.placement._errors import TopologyError
from rlfleet.placement._public import public
from rlfleet.placement.cost._profiles import HARDWARE_PROFILES
from rlfleet.placement.topology._build import build_from_spec
from rlfleet.placement.topology._graph import TopologyGraph

__all__ = [
    "OVERRIDE_KEYS",
    "NvidiaSmiTopo",
    "alive_nodes",
    "parse_nvidia_smi_topo",
    "topology_from_ray_nodes",
]

G = TypeVar("G", bound=TopologyGraph)

#: Keys `topology_from_ray_nodes` accepts in ``overrides`` (and in ``overrides["per_node"][id]``).
OVERRIDE_KEYS: tuple[str, ...] = (
    "cpu_slots",
    "gpus",
    "host_bandwidth",
    "nic_bandwidth",
    "nic_latency",
    "nics",
    "nvidia_smi_topo",
    "nvlink_bandwidth",
    "pcie_bandwidth",
)
_TOP_KEYS = (*OVERRIDE_KEYS, "nodes", "per_node")
_NVLINK_PER_LINK = 25e9  # NVLink 3 and 4: 50 GB/s per link both ways, 25 GB/s each way
_FALLBACK_GPU = {"pcie_bandwidth": 32e9, "nic_bandwidth": 12.5e9, "nics": 1}
_FALLBACK_CPU = {"host_bandwidth": 10e9, "nic_bandwidth": 1.25e9}
_NEAR = ("PIX", "PXB")
_LABEL = re.compile(r"^(GPU|NIC)\d+$")


@public
@dataclass(frozen=True)
class NvidiaSmiTopo:
    """The matrix of ``nvidia-smi topo -m``: GPU and NIC labels and the connection code of each pair."""

    gpus: tuple[str, ...]
    nics: tuple[str, ...]
    codes: Mapping[tuple[str, str], str]

    def nvlinks(self, a: str, b: str) -> int:
        """NVLink count between two GPUs ("NV18" -> 18; 0 when they meet over PCIe)."""
        code = self.codes.get((a, b), "")
        return int(code[2:]) if code.startswith("NV") and code[2:].isdigit() else 0

    def nic_gpu(self, nic: str) -> str | None:
        """The GPU a NIC sits next to (same PCIe switch: PIX or PXB), else None (the host's)."""
        for code in _NEAR:
            for g in self.gpus:
                if self.codes.get((nic, g)) == code or self.codes.get((g, nic)) == code:
                    return g
        return None


@public
def parse_nvidia_smi_topo(text: str) -> NvidiaSmiTopo:
    """Parse ``nvidia-smi topo -m`` output; a text without a GPU matrix raises TopologyError."""
    if not isinstance(text, str):
        raise TopologyError(f"nvidia-smi topo text must be a string, got {type(text).__name__}")
    labels: list[str] = []
    codes: dict[tuple[str, str], str] = {}
    for line in text.splitlines():
        tokens = line.replace("\x1b[4m", "").replace("\x1b[0m", "").split()
        if not tokens:
            continue
        if not labels and _LABEL.match(tokens[0]) and all(_LABEL.match(t) for t in tokens[:2]):
            labels = [t for t in tokens if _LABEL.match(t)]
            continue
        if labels and tokens[0] in labels and len(tokens) > len(labels):
            for col, code in zip(labels, tokens[1 : 1 + len(labels)], strict=True):
                codes[(tokens[0], col)] = code
    gpus = tuple(label for label in labels if label.startswith("GPU"))
    if not gpus or not codes:
        raise TopologyError("nvidia-smi topo text holds no GPU matrix (expected a 'GPU0 GPU1 ...' header)")
    return NvidiaSmiTopo(gpus, tuple(label for label in labels if label.startswith("NIC")), codes)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TopologyError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def alive_nodes(nodes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The alive entries of ``ray.nodes()`` output, head node first (then by node id)."""
    out = []
    for i, n in enumerate(nodes):
        if not isinstance(n, Mapping) or "NodeID" not in n:
            raise TopologyError(f"ray nodes[{i}] is not a ray.nodes() entry (a mapping with 'NodeID')")
        if n.get("Alive", n.get("alive", True)):
            out.append(n)
    out.sort(key=lambda n: (not n.get("Resources", {}).get("node:__internal_head__"), str(n["NodeID"])))
    return out


def _accelerator(resources: Mapping[str, Any]) -> str | None:
    for key in resources:
        if str(key).startswith("accelerator_type:"):
            return str(key).split(":", 1)[1]
    return None


class _NodeSpec:
    """Spec pieces (devices, switches, links) of one node, and what its rates came from."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.devices: list[dict[str, str]] = []
        self.switches: list[dict[str, str]] = []
        self.links: list[dict[str, Any]] = []
        self.origin = "fallback"

    def link(self, a: str, b: str, kind: str, bandwidth: float, latency: float) -> None:
        self.links.append({"a": a, "b": b, "kind": kind, "bandwidth": bandwidth, "latency": latency})


def _gpu_node(spec: _NodeSpec, gpus: int, opts: Mapping[str, Any], accel: str | None) -> None:
    node = spec.node
    profile = HARDWARE_PROFILES.get(accel or "")
    base: dict[str, Any] = dict(_FALLBACK_GPU)
    if profile is not None:
        spec.origin = f"profile {accel}"
        base.update(
            nvlink_bandwidth=profile.intra_node_bytes_per_s,
            nic_bandwidth=profile.inter_node_bytes_per_s,
            nics=profile.nics_per_node,
            pcie_bandwidth=profile.h2d_bytes_per_s,
            nic_latency=profile.latency_s,
        )
    smi = opts.get("nvidia_smi_topo")
    topo = parse_nvidia_smi_topo(smi) if smi is not None else None
    if topo is not None:
        gpus = len(topo.gpus)
        spec.origin = f"nvidia-smi topo ({spec.origin} rates)"
    if any(k in opts for k in OVERRIDE_KEYS if k != "nvidia_smi_topo"):
        spec.origin += " + overrides"
    rates = {**base, **{k: v for k, v in opts.items() if k != "nvidia_smi_topo"}}
    pcie = _number(rates["pcie_bandwidth"], f"{node}: pcie_bandwidth")
    nic = _number(rates["nic_bandwidth"], f"{node}: nic_bandwidth")
    latency = float(rates.get("nic_latency", 5e-6))
    names = [f"gpu{g}" for g in range(gpus)]
    spec.devices = [{"id": n, "kind": "gpu"} for n in names]
    spec.switches.append({"id": "host", "node": node})
    for n in names:
        spec.link(f"{node}/{n}", f"{node}/host", "pcie", pcie, 2e-6)
    _nvlinks(spec, names, topo, rates)
    rails: dict[str, float] = {}
    if topo is not None and topo.nics:
        for label in topo.nics:
            gpu = topo.nic_gpu(label)
            end = f"{node}/gpu{topo.gpus.index(gpu)}" if gpu is not None else f"{node}/host"
            rails[end] = rails.get(end, 0.0) + nic
    else:
        count = int(rates.get("nics", 1))
        ends = [f"{node}/{names[k * gpus // count]}" for k in range(count)] if count > 1 else [f"{node}/host"]
        for end in ends:
            rails[end] = rails.get(end, 0.0) + nic
    for end, bandwidth in rails.items():
        spec.link(end, "fabric", "network", bandwidth, latency)


def _nvlinks(spec: _NodeSpec, names: list[str], topo: NvidiaSmiTopo | None, rates: Mapping[str, Any]) -> None:
    node = spec.node
    if len(names) < 2:
        return
    if topo is not None:
        pairs = [(a, b) for a in range(len(names)) for b in range(a)]
        counts = {(a, b): topo.nvlinks(topo.gpus[a], topo.gpus[b]) for a, b in pairs}
        if not any(counts.values()):
            return
        if len(set(counts.values())) > 1:  # direct NVLinks between some pairs
            for (a, b), n in counts.items():
                if n:
                    bandwidth = n * _NVLINK_PER_LINK
                    spec.link(f"{node}/{names[a]}", f"{node}/{names[b]}", "nvlink", bandwidth, 2e-6)
            return
        bandwidth = next(iter(counts.values())) * _NVLINK_PER_LINK
    elif "nvlink_bandwidth" in rates:
        bandwidth = _number(rates["nvlink_bandwidth"], f"{node}: nvlink_bandwidth")
    else:
        return
    spec.switches.append({"id": "nvswitch", "node": node})
    for name in names:
        spec.link(f"{node}/{name}", f"{node}/nvswitch", "nvlink", bandwidth, 2e-6)


def _cpu_node(spec: _NodeSpec, slots: int, opts: Mapping[str, Any]) -> None:
    node = spec.node
    rates = {**_FALLBACK_CPU, **opts}
    if any(k in opts for k in OVERRIDE_KEYS):
        spec.origin = "fallback + overrides"
    host = _number(rates["host_bandwidth"], f"{node}: host_bandwidth")
    nic = _number(rates["nic_bandwidth"], f"{node}: nic_bandwidth")
    spec.devices = [{"id": f"cpu{k}", "kind": "cpu"} for k in range(slots)]
    spec.switches.append({"id": "host", "node": node})
    for k in range(slots):
        spec.link(f"{node}/cpu{k}", f"{node}/host", "pcie", host, 1e-6)
    spec.link(f"{node}/host", "fabric", "network", nic, float(rates.get("nic_latency", 5e-5)))


def topology_from_ray_nodes(
    nodes: Sequence[Mapping[str, Any]], overrides: Mapping[str, Any] | None, cls: type[G]
) -> G:
    """A Topology of the alive nodes in ``nodes`` (``ray.nodes()`` output), head node first.

    ``overrides`` (all optional): ``nodes`` (ids to keep, in order), any of `OVERRIDE_KEYS` for
    every node, and ``per_node: {node_id: {key: value}}``. ``gpus`` / ``cpu_slots`` set the device
    count (default: the node's GPU resource, else one slot per CPU); ``nvidia_smi_topo`` is the
    node's ``nvidia-smi topo -m`` text. See the module docstring for where rates come from.
    """
    opts = dict(overrides or {})
    unknown = sorted(set(opts) - set(_TOP_KEYS))
    if unknown:
        raise TopologyError(f"unknown override(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    per_node = dict(opts.pop("per_node", {}) or {})
    alive = {str(n["NodeID"]): n for n in alive_nodes(nodes)}
    wanted = [str(n) for n in opts.pop("nodes", None) or list(alive)]
    missing = [n for n in wanted if n not in alive]
    if missing:
        raise TopologyError(f"node(s) {missing} are not alive in the Ray node list (alive: {list(alive)})")
    if not wanted:
        raise TopologyError("no alive Ray node in the node list")
    bad = sorted(set(per_node) - set(wanted))
    if bad:
        raise TopologyError(f"per_node overrides name node(s) {bad} that are not in the topology")
    specs = []
    for nid in wanted:
        node_opts = {**opts, **dict(per_node.get(nid, {}))}
        extra = sorted(set(node_opts) - set(OVERRIDE_KEYS))
        if extra:
            raise TopologyError(f"per_node[{nid!r}]: unknown key(s) {extra}; known: {list(OVERRIDE_KEYS)}")
        resources = dict(alive[nid].get("Resources", {}))
        gpus = int(node_opts.pop("gpus", resources.get("GPU", 0)))
        spec = _NodeSpec(nid)
        if gpus > 0 or "nvidia_smi_topo" in node_opts:
            _gpu_node(spec, gpus, node_opts, _accelerator(resources))
        else:
            slots = int(node_opts.pop("cpu_slots", max(1, int(resources.get("CPU", 1)))))
            _cpu_node(spec, max(1, slots), node_opts)
        specs.append(spec)
    topo = build_from_spec(
        {
            "nodes": [{"id": s.node, "devices": s.devices} for s in specs],
            "switches": [{"id": "fabric"}] + [sw for s in specs for sw in s.switches],
            "links": [link for s in specs for link in s.links],
        },
        cls,
    )
    origins: dict[str, int] = {}
    for s in specs:
        origins[s.origin] = origins.get(s.origin, 0) + 1
    summary = ", ".join(f"{count} node(s) from {origin}" for origin, count in origins.items())
    topo.source = f"ray.nodes(): {len(specs)} alive node(s); rates: {summary}"
    return topo
