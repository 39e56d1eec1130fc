"""Topology from the cluster: ray.nodes() output as data, nvidia-smi topo -m, overrides, fallback."""

from __future__ import annotations

from typing import Any

import pytest

from rlfleet.placement import (
    SyncPlanError,
    SyncProcess,
    Topology,
    TopologyError,
    parse_nvidia_smi_topo,
    plan_sync,
)


def ray_node(node_id: str, ip: str, resources: dict[str, float], *, alive: bool = True) -> dict[str, Any]:
    """An entry as ``ray.nodes()`` returns it (Ray 2.x keys)."""
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": ip,
        "NodeManagerHostname": f"host-{ip}",
        "NodeManagerPort": 40000,
        "ObjectManagerPort": 40001,
        "ObjectStoreSocketName": f"/tmp/ray/session/sockets/plasma_store_{node_id[:4]}",
        "RayletSocketName": f"/tmp/ray/session/sockets/raylet_{node_id[:4]}",
        "MetricsExportPort": 40002,
        "NodeName": ip,
        "alive": alive,
        "Resources": {**resources, f"node:{ip}": 1.0, "memory": 2.5e11, "object_store_memory": 1.0e11},
        "Labels": {"ray.io/node_id": node_id},
    }


HEAD = ray_node("f1e2d3c4b5a6" * 4 + "aabbccdd", "10.0.0.1", {"CPU": 4.0, "node:__internal_head__": 1.0})
GPU = ray_node(
    "0a1b2c3d4e5f" * 4 + "11223344", "10.0.0.2", {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H100": 1.0}
)
ODD = ray_node(
    "9988776655" * 5 + "12345678", "10.0.0.3", {"CPU": 64.0, "GPU": 4.0, "accelerator_type:L4": 1.0}
)
DEAD = ray_node("dead" * 14, "10.0.0.9", {"CPU": 8.0}, alive=False)

SMI = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tNIC2\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tPIX\tSYS\tSYS\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tSYS\tPXB\tSYS\t0-47\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\tSYS\tSYS\t48-95\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\tSYS\tSYS\t48-95\t1\t\tN/A
NIC0\tPIX\tSYS\tSYS\tSYS\t X \tSYS\tSYS
NIC1\tSYS\tPXB\tSYS\tSYS\tSYS\t X \tSYS
NIC2\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
  NIC2: mlx5_bond_0
"""


def test_alive_nodes_head_first_with_profile_or_fallback_rates() -> None:
    topo = Topology.from_ray_nodes([GPU, DEAD, HEAD, ODD])
    assert topo.nodes == (HEAD["NodeID"], GPU["NodeID"], ODD["NodeID"])
    cpu = HEAD["NodeID"]
    assert [d.kind for d in topo.devices(cpu)] == ["cpu"] * 4
    assert topo.ingress_bandwidth(cpu) == 1.25e9  # fallback: one 10 Gb/s NIC
    h100 = GPU["NodeID"]
    assert len(topo.ports(h100)) == 8
    assert topo.ingress_bandwidth(h100) == 8 * 50e9
    assert topo.link(f"{h100}/gpu0", f"{h100}/nvswitch").bandwidth == 450e9
    l4 = ODD["NodeID"]
    assert topo.ingress_bandwidth(l4) == 12.5e9
    assert not any(link.kind == "nvlink" for link in topo.links if topo.node_of(link.a) == l4)
    assert topo.source.startswith("ray.nodes(): 3 alive node(s)")
    assert "2 node(s) from fallback" in topo.source
    assert "1 node(s) from profile H100" in topo.source


def test_overrides_and_nvidia_smi_topo() -> None:
    gpu = GPU["NodeID"]
    topo = Topology.from_ray_nodes(
        [HEAD, GPU],
        {"nodes": [gpu], "per_node": {gpu: {"nvidia_smi_topo": SMI, "nic_bandwidth": 25e9}}},
    )
    assert topo.nodes == (gpu,)
    assert len(topo.devices(gpu)) == 4  # the matrix, not Ray's GPU count, says how many
    assert topo.link(f"{gpu}/gpu2", f"{gpu}/nvswitch").bandwidth == 18 * 25e9
    rails = {p.local: p.bandwidth for p in topo.ports(gpu)}
    assert rails == {f"{gpu}/gpu0": 25e9, f"{gpu}/gpu1": 25e9, gpu + "/host": 25e9}  # NIC2 sits on the host
    assert "nvidia-smi topo" in topo.source
    assert "overrides" in topo.source
    cpu = HEAD["NodeID"]
    slots = Topology.from_ray_nodes([HEAD], {"cpu_slots": 2, "host_bandwidth": 5e9})
    assert len(slots.devices(cpu)) == 2
    assert slots.link(f"{cpu}/cpu0", f"{cpu}/host").bandwidth == 5e9


def test_parse_nvidia_smi_topo() -> None:
    smi = parse_nvidia_smi_topo(SMI)
    assert smi.gpus == ("GPU0", "GPU1", "GPU2", "GPU3")
    assert smi.nics == ("NIC0", "NIC1", "NIC2")
    assert smi.nvlinks("GPU0", "GPU3") == 18
    assert smi.nvlinks("GPU0", "NIC0") == 0
    assert smi.nic_gpu("NIC0") == "GPU0"
    assert smi.nic_gpu("NIC1") == "GPU1"
    assert smi.nic_gpu("NIC2") is None
    with pytest.raises(TopologyError, match="no GPU matrix"):
        parse_nvidia_smi_topo("No devices were found")


def test_bad_input_is_named() -> None:
    with pytest.raises(TopologyError, match="unknown override"):
        Topology.from_ray_nodes([HEAD], {"nic_speed": 1})
    with pytest.raises(TopologyError, match="not alive"):
        Topology.from_ray_nodes([HEAD, DEAD], {"nodes": [DEAD["NodeID"]]})
    with pytest.raises(TopologyError, match="per_node overrides name node"):
        Topology.from_ray_nodes([HEAD], {"per_node": {"elsewhere": {"gpus": 1}}})
    with pytest.raises(TopologyError, match="NodeID"):
        Topology.from_ray_nodes([{"Alive": True}])
    with pytest.raises(TopologyError, match="nic_bandwidth must be a positive number"):
        Topology.from_ray_nodes([HEAD], {"nic_bandwidth": -1})


def test_sync_plans_say_what_they_were_priced_on() -> None:
    cpu, gpu = HEAD["NodeID"], GPU["NodeID"]
    topo = Topology.from_ray_nodes([HEAD, GPU])
    procs = [SyncProcess("t0", "trainer", cpu), SyncProcess("r0", "rollout", gpu, "cuda:0")]
    plan = plan_sync(procs, [2**20] * 4, "Double", topology=topo)
    assert plan.topology_source.startswith("topology: ray.nodes()")
    assert plan.cost.nics_per_node == 1  # the slowest used node sets the rates
    assert plan_sync(procs, [2**20] * 4, "Double").topology_source.startswith("fallback: no topology")
    with pytest.raises(SyncPlanError, match="not in the topology"):
        plan_sync([*procs, SyncProcess("r1", "rollout", "nowhere")], [2**20], "Double", topology=topo)
