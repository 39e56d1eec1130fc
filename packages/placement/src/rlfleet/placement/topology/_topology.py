"""`Topology`: the graph of `TopologyGraph` with its constructors (a spec, a synthetic cluster,
Ray's node list); they sit above the builders so no module of this folder imports a later one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlfleet.placement._public import public
from rlfleet.placement.topology._build import SyntheticLinks, build_from_spec, build_synthetic
from rlfleet.placement.topology._cluster import topology_from_ray_nodes
from rlfleet.placement.topology._graph import TopologyGraph

__all__ = ["Topology"]


@public
class Topology(TopologyGraph):
    """Hosts, devices, switches and links with bandwidths, on a :class:`networkx.Graph`.

    Build it with :meth:`from_spec`, :meth:`synthetic` or :meth:`from_ray_nodes`; the graph is
    available as :attr:`graph` (vertex attributes ``role`` and ``node``, edge attributes ``kind``,
    ``bandwidth``, ``latency``). Treat it as immutable once built: routes are cached.
    """

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Topology:
        """Build from a plain dict (see :meth:`to_spec` for the format); bad entries raise TopologyError.

        ``{"nodes": [{"id": "n0", "devices": [{"id": "gpu0", "kind": "gpu"}]}],
        "switches": [{"id": "fabric"}, {"id": "nvswitch", "node": "n0"}],
        "links": [{"a": "n0/gpu0", "b": "fabric", "kind": "network", "bandwidth": 5e10, "latency": 5e-6}]}``
        """
        return build_from_spec(spec, cls)

    @classmethod
    def from_ray_nodes(
        cls, nodes: Sequence[Mapping[str, Any]], overrides: Mapping[str, Any] | None = None
    ) -> Topology:
        """The cluster in ``ray.nodes()`` output (plain data), rates from ``overrides``,
        ``nvidia-smi topo -m`` text, hardware profiles or a documented fallback (``source`` says
        which); see the README's "Topology from the cluster"."""
        return topology_from_ray_nodes(nodes, overrides, cls)

    @classmethod
    def synthetic(
        cls,
        nodes: int,
        gpus_per_node: int = 8,
        *,
        nvlink_bandwidth: float = 450e9,
        nvlink_latency: float = 2e-6,
        pcie_bandwidth: float = 64e9,
        pcie_latency: float = 2e-6,
        nic_bandwidth: float = 50e9,
        nic_latency: float = 5e-6,
        nic_per: str = "gpu",
        nvlink: bool = True,
        node_prefix: str = "node",
    ) -> Topology:
        """A homogeneous cluster behind one non-blocking fabric switch (``"fabric"``).

        Defaults model an H100/H200 HGX node: NVLink 450 GB/s each way per GPU through an
        NVSwitch, PCIe Gen5 x16 (64 GB/s) from each GPU to the host, and a 400 Gb/s (50 GB/s) NIC per GPU
        (``nic_per="gpu"``, rail style) or one per node (``nic_per="node"``, on the host).
        Links are full duplex, so bandwidths are per direction: NVLink 4's quoted 900 GB/s is
        450 GB/s each way.
        """
        rates = SyntheticLinks(
            nvlink_bandwidth, nvlink_latency, pcie_bandwidth, pcie_latency, nic_bandwidth, nic_latency
        )
        return build_synthetic(
            cls, nodes, gpus_per_node, rates, nic_per=nic_per, nvlink=nvlink, node_prefix=node_prefix
        )
