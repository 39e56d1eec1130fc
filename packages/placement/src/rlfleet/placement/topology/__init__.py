"""Topology: nodes, devices, switches and links with bandwidths, from a spec, a synthetic
cluster or Ray's node list (with ``nvidia-smi topo -m``)."""

from rlfleet.placement.topology._cluster import NvidiaSmiTopo, parse_nvidia_smi_topo
from rlfleet.placement.topology._graph import DEVICE_KINDS, LINK_KINDS, Device, Link, Port, Switch
from rlfleet.placement.topology._topology import Topology

__all__ = [
    "DEVICE_KINDS",
    "LINK_KINDS",
    "Device",
    "Link",
    "NvidiaSmiTopo",
    "Port",
    "Switch",
    "Topology",
    "parse_nvidia_smi_topo",
]
