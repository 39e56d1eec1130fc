"""Topology: specs, validation errors that name the offending entry, synthetic clusters, routes."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest

from rlfleet.placement import PlacementError, Topology, TopologyError


def small_spec() -> dict[str, Any]:
    return {
        "nodes": [
            {"id": "a", "devices": [{"id": "gpu0", "kind": "gpu"}, {"id": "gpu1", "kind": "gpu"}]},
            {"id": "b", "devices": [{"id": "gpu0", "kind": "gpu"}, {"id": "cpu0", "kind": "cpu"}]},
        ],
        "switches": [{"id": "fabric"}, {"id": "nvs", "node": "a"}],
        "links": [
            {"a": "a/gpu0", "b": "a/nvs", "kind": "nvlink", "bandwidth": 9e11, "latency": 1e-6},
            {"a": "a/gpu1", "b": "a/nvs", "kind": "nvlink", "bandwidth": 9e11, "latency": 1e-6},
            {"a": "a/gpu0", "b": "a", "kind": "pcie", "bandwidth": 6.4e10, "latency": 2e-6},
            {"a": "a/gpu1", "b": "a", "kind": "pcie", "bandwidth": 6.4e10, "latency": 2e-6},
            {"a": "b/gpu0", "b": "b", "kind": "pcie", "bandwidth": 6.4e10, "latency": 2e-6},
            {"a": "a", "b": "fabric", "kind": "network", "bandwidth": 5e10, "latency": 5e-6},
            {"a": "b", "b": "fabric", "kind": "network", "bandwidth": 5e10, "latency": 5e-6},
        ],
    }


def test_spec_round_trip_is_exact() -> None:
    spec = small_spec()
    topo = Topology.from_spec(spec)
    assert topo.to_spec() == spec
    again = Topology.from_spec(json.loads(json.dumps(topo.to_spec())))
    assert again == topo
    assert again.to_spec() == topo.to_spec()


def test_synthetic_round_trips_and_has_realistic_defaults() -> None:
    topo = Topology.synthetic(3, 8)
    assert Topology.from_spec(topo.to_spec()) == topo
    assert topo.nodes == ("node0", "node1", "node2")
    assert len(topo.devices()) == 24
    assert len(topo.devices("node1", kind="gpu")) == 8
    assert topo.link("node0/gpu0", "node0/nvswitch").bandwidth == 450e9  # NVLink 4, each way
    assert topo.link("node0/gpu3", "fabric").bandwidth == 50e9  # 400 Gb/s
    assert len(topo.ports("node2")) == 8
    assert topo.ingress_bandwidth("node2") == 8 * 50e9
    per_node = Topology.synthetic(2, 4, nic_per="node", nic_bandwidth=100e9)
    assert [p.local for p in per_node.ports("node1")] == ["node1"]
    assert per_node.ingress_bandwidth("node1") == 100e9


def test_graph_is_networkx_with_attributes() -> None:
    topo = Topology.synthetic(2, 2)
    g = topo.graph
    assert g.nodes["node0/gpu1"]["role"] == "device"
    assert g.nodes["node0"]["role"] == "host"
    assert g.edges["node1/gpu0", "fabric"]["kind"] == "network"


def test_routes_prefer_nvlink_inside_a_node_and_nics_across() -> None:
    topo = Topology.synthetic(2, 4)
    assert topo.route("node0/gpu0", "node0/gpu3") == (
        ("node0/gpu0", "node0/nvswitch"),
        ("node0/nvswitch", "node0/gpu3"),
    )
    assert topo.route("node0/gpu2", "node1/gpu2") == (("node0/gpu2", "fabric"), ("fabric", "node1/gpu2"))
    assert topo.route("node0/gpu1", "node0/gpu1") == ()
    per_node = Topology.synthetic(2, 2, nic_per="node")
    assert per_node.route("node0/gpu1", "node1/gpu0") == (
        ("node0/gpu1", "node0"),
        ("node0", "fabric"),
        ("fabric", "node1"),
        ("node1", "node1/gpu0"),
    )
    with pytest.raises(TopologyError, match="nope"):
        topo.route("node0/gpu0", "nope")


def test_routes_cross_a_leaf_spine_fabric() -> None:
    spec = Topology.synthetic(4, 2).to_spec()
    spec["switches"] = [s for s in spec["switches"] if s["id"] != "fabric"]
    spec["switches"] += [{"id": "leaf0"}, {"id": "leaf1"}, {"id": "spine"}]
    links = []
    for ln in spec["links"]:
        if ln["b"] == "fabric":
            node = int(ln["a"].split("/")[0].removeprefix("node"))
            ln = {**ln, "b": f"leaf{node // 2}"}
        links.append(ln)
    links += [
        {"a": "leaf0", "b": "spine", "kind": "network", "bandwidth": 2e11, "latency": 1e-6},
        {"a": "leaf1", "b": "spine", "kind": "network", "bandwidth": 2e11, "latency": 1e-6},
    ]
    spec["links"] = links
    topo = Topology.from_spec(spec)
    route = topo.route("node0/gpu0", "node3/gpu1")
    assert ("leaf0", "spine") in route
    assert ("spine", "leaf1") in route
    assert route[-1] == ("leaf1", "node3/gpu1")


def test_direct_node_to_node_link_routes_without_fabric() -> None:
    spec = {
        "nodes": [{"id": "x", "devices": [{"id": "g"}]}, {"id": "y", "devices": [{"id": "g"}]}],
        "links": [{"a": "x/g", "b": "y/g", "kind": "network", "bandwidth": 1e9}],
    }
    topo = Topology.from_spec(spec)
    assert topo.route("x/g", "y/g") == (("x/g", "y/g"),)
    with pytest.raises(TopologyError, match="no path"):
        topo.route("x", "y")


def _mutate(path: list[Any], value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(small_spec())
    target: Any = spec
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return spec


_DELETE = object()

BAD_SPECS = [
    ("unknown node in link", _mutate(["links", 5, "a"], "zz"), ["links[5]", "'zz'", "unknown endpoint"]),
    ("unknown device in link", _mutate(["links", 4, "a"], "b/gpu9"), ["links[4]", "b/gpu9"]),
    ("negative bandwidth", _mutate(["links", 0, "bandwidth"], -1.0), ["links[0]", "bandwidth", "-1.0"]),
    ("zero bandwidth", _mutate(["links", 1, "bandwidth"], 0), ["links[1]", "bandwidth"]),
    ("nan bandwidth", _mutate(["links", 1, "bandwidth"], math.nan), ["links[1]", "bandwidth"]),
    ("bool bandwidth", _mutate(["links", 1, "bandwidth"], True), ["links[1]", "bandwidth"]),
    ("string bandwidth", _mutate(["links", 2, "bandwidth"], "fast"), ["links[2]", "'fast'"]),
    ("negative latency", _mutate(["links", 2, "latency"], -1e-6), ["links[2]", "latency"]),
    ("missing bandwidth", _mutate(["links", 3, "bandwidth"], _DELETE), ["links[3]", "'bandwidth'"]),
    ("bad link kind", _mutate(["links", 3, "kind"], "wifi"), ["links[3]", "'wifi'"]),
    ("self loop", _mutate(["links", 3, "b"], "a/gpu1"), ["links[3]", "itself"]),
    ("duplicate node", _mutate(["nodes", 1, "id"], "a"), ["nodes[1]", "duplicate", "'a'"]),
    (
        "duplicate device",
        _mutate(["nodes", 0, "devices", 1, "id"], "gpu0"),
        ["nodes[0].devices[1]", "a/gpu0"],
    ),
    ("device kind", _mutate(["nodes", 0, "devices", 1, "kind"], "tpu"), ["nodes[0].devices[1]", "'tpu'"]),
    ("int node id", _mutate(["nodes", 0, "id"], 7), ["nodes[0]", "7"]),
    ("slash in id", _mutate(["nodes", 0, "id"], "a/b"), ["nodes[0]", "'a/b'"]),
    ("nodes not a list", _mutate(["nodes"], {"a": 1}), ["spec.nodes", "list"]),
    ("devices not a list", _mutate(["nodes", 0, "devices"], "gpu0"), ["nodes[0].devices", "list"]),
    ("link not a mapping", _mutate(["links", 0], ["a", "b"]), ["links[0]", "mapping"]),
    ("unknown key", _mutate(["links", 0, "bw"], 1.0), ["links[0]", "'bw'"]),
    ("switch on unknown node", _mutate(["switches", 1, "node"], "q"), ["switches[1]", "'q'"]),
    ("switch clashes with node", _mutate(["switches", 0, "id"], "a"), ["switches[0]", "duplicate"]),
    ("endpoint not a string", _mutate(["links", 0, "a"], 3), ["links[0]", "3"]),
]


@pytest.mark.parametrize(("name", "spec", "needles"), BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_specs_raise_a_clear_error(name: str, spec: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(TopologyError) as info:
        Topology.from_spec(spec)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, PlacementError)
    for needle in needles:
        assert needle in str(info.value), (name, str(info.value))


def test_duplicate_link_is_rejected() -> None:
    spec = small_spec()
    spec["links"].append({"a": "a", "b": "a/gpu0", "kind": "pcie", "bandwidth": 1e9})
    with pytest.raises(TopologyError, match=r"links\[7\].*duplicate link"):
        Topology.from_spec(spec)


def test_spec_must_be_a_mapping() -> None:
    with pytest.raises(TopologyError, match="mapping"):
        Topology.from_spec([])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nodes": 0}, "nodes"),
        ({"nodes": 2, "gpus_per_node": -1}, "gpus_per_node"),
        ({"nodes": 2, "nic_per": "rack"}, "nic_per"),
        ({"nodes": 2, "nic_bandwidth": 0.0}, "bandwidth"),
    ],
)
def test_bad_synthetic_arguments(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(TopologyError, match=needle):
        Topology.synthetic(**kwargs)


def test_queries_name_unknown_things() -> None:
    topo = Topology.synthetic(1, 2)
    with pytest.raises(TopologyError, match="'n9'"):
        topo.ports("n9")
    with pytest.raises(TopologyError, match="'gpu7'"):
        topo.device_vertex("node0", "gpu7")
    with pytest.raises(TopologyError, match="no link"):
        topo.link("node0/gpu0", "node0/gpu1")
    assert topo.node_of("fabric") is None
    assert topo.node_of("node0/nvswitch") == "node0"
    assert "Topology(nodes=1" in repr(topo)
