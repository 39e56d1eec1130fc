"""Transfer plans: every eval device gets every byte once, loads add up, senders are balanced,
plans are deterministic, and the seed's plan is costed the same way."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.placement import (
    DEFAULT_BUCKET_BYTES,
    HARDWARE_PROFILES,
    Placement,
    PlacementError,
    Topology,
    TransferPlan,
    WorkerPlacement,
    cost_transfer_info,
    lower_bound_seconds,
    place_colocated,
    place_disaggregated,
    plan_transfer,
    seed_plan,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Topology, Placement, int, int]:
    nodes = draw(st.integers(1, 6))
    gpus = draw(st.integers(1, 4))
    topo = Topology.synthetic(
        nodes,
        gpus,
        nic_per=draw(st.sampled_from(["gpu", "node"])),
        nvlink=draw(st.booleans()),
        nic_bandwidth=draw(st.sampled_from([12.5e9, 50e9])),
    )
    total = nodes * gpus
    layout = draw(st.sampled_from(["packed", "spread", "colocated"]))
    n_train = draw(st.integers(1, total if layout == "colocated" else max(1, total - 1)))
    if layout == "colocated":
        placement = place_colocated(topo, n_train, draw(st.integers(0, n_train)))
    else:
        placement = place_disaggregated(topo, n_train, draw(st.integers(0, total - n_train)), mode=layout)
    model_bytes = draw(st.integers(1, 10**12))
    bucket = draw(st.sampled_from([1, 4096, 2**20, DEFAULT_BUCKET_BYTES, 2**31]))
    return topo, placement, model_bytes, bucket


@st.composite
def mixed_scenarios(draw: st.DrawFn) -> tuple[Topology, Placement, int, int]:
    """Heterogeneous nodes: varying GPU counts, NICs on some GPUs and/or the host, two leaf switches."""
    n_nodes = draw(st.integers(2, 5))
    nodes: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    switches: list[dict[str, Any]] = [{"id": "leaf0"}, {"id": "leaf1"}, {"id": "spine"}]
    links += [
        {"a": "leaf0", "b": "spine", "kind": "network", "bandwidth": 4e11, "latency": 1e-6},
        {"a": "leaf1", "b": "spine", "kind": "network", "bandwidth": 4e11, "latency": 1e-6},
    ]
    for i in range(n_nodes):
        node = f"h{i}"
        gpus = draw(st.integers(1, 4))
        nodes.append({"id": node, "devices": [{"id": f"g{j}", "kind": "gpu"} for j in range(gpus)]})
        nvlink = gpus > 1 and draw(st.booleans())
        if nvlink:
            switches.append({"id": "nvs", "node": node})
        nic_gpus = draw(st.lists(st.integers(0, gpus - 1), unique=True, max_size=gpus))
        host_nic = draw(st.booleans()) or not nic_gpus
        for j in range(gpus):
            dev = f"{node}/g{j}"
            links.append({"a": dev, "b": node, "kind": "pcie", "bandwidth": 6.4e10, "latency": 2e-6})
            if nvlink:
                links.append(
                    {"a": dev, "b": f"{node}/nvs", "kind": "nvlink", "bandwidth": 9e11, "latency": 1e-6}
                )
            if j in nic_gpus:
                bw = draw(st.sampled_from([2.5e10, 5e10]))
                links.append(
                    {"a": dev, "b": f"leaf{i % 2}", "kind": "network", "bandwidth": bw, "latency": 5e-6}
                )
        if host_nic:
            links.append(
                {"a": node, "b": f"leaf{i % 2}", "kind": "network", "bandwidth": 1e11, "latency": 5e-6}
            )
    topo = Topology.from_spec({"nodes": nodes, "switches": switches, "links": links})
    devices = [(d.node, d.id) for d in topo.devices()]
    roles = draw(
        st.lists(st.sampled_from(["train", "eval", "idle"]), min_size=len(devices), max_size=len(devices))
    )
    if "train" not in roles:
        roles[draw(st.integers(0, len(roles) - 1))] = "train"
    workers = [
        WorkerPlacement(f"w{k}", role, node, dev)
        for k, (role, (node, dev)) in enumerate(zip(roles, devices, strict=True))
        if role != "idle"
    ]
    model_bytes = draw(st.integers(1, 10**12))
    return (
        topo,
        Placement(tuple(workers)),
        model_bytes,
        draw(st.sampled_from([1, 2**20, DEFAULT_BUCKET_BYTES])),
    )


def check_plan(plan: TransferPlan, topo: Topology, model_bytes: int) -> None:
    # every eval device receives every byte exactly once
    received = plan.received()
    for r in plan.receivers:
        cur = 0
        for lo, hi in received.get(r, []):
            assert lo == cur, (r, received[r][:4])
            cur = hi
        assert cur == model_bytes, r
    # no link carries more than the plan says, and no link needs longer than the prediction
    loads: dict[tuple[str, str], int] = {}
    for s in plan.steps:
        assert s.links == topo.route(s.src, s.dst)
        for link in s.links:
            loads[link] = loads.get(link, 0) + s.nbytes
    assert loads == {(ln.src, ln.dst): ln.nbytes for ln in plan.link_loads}
    tol = 1e-9 * max(1.0, plan.predicted_seconds)
    for ln in plan.link_loads:
        assert ln.seconds <= plan.predicted_seconds + tol
        assert ln.bandwidth == topo.link(ln.src, ln.dst).bandwidth
    # step structure: bytes flow forward from trainers
    sources = set(plan.sources)
    for s in plan.steps:
        assert s.nbytes > 0
        if s.after is None:
            assert s.src in sources
            assert s.stage == 0
        else:
            prev = plan.steps[s.after]
            assert s.after < s.id
            assert prev.dst == s.src
            assert s.stage == prev.stage + 1
            assert prev.offset <= s.offset
            assert s.end <= prev.end
        assert 0 <= s.first_seconds <= s.finish_seconds + tol
    assert plan.predicted_seconds + tol >= plan.lower_bound_seconds
    assert plan.lower_bound_seconds == lower_bound_seconds(topo, model_bytes, plan.sources, plan.receivers)


def check_feeders_balanced(plan: TransferPlan, placement: Placement) -> None:
    """The devices of trainer-only nodes that feed other nodes each send the same bytes off their
    node (within a byte): the copies are laid end to end and cut into one equal run per feeder."""
    eval_nodes = {w.node for w in placement.eval}
    sent: dict[str, int] = {}
    for s in plan.steps:
        node = s.src.split("/", 1)[0]
        if node not in eval_nodes and s.dst.split("/", 1)[0] != node:
            sent[s.src] = sent.get(s.src, 0) + s.nbytes
    if sent:
        assert max(sent.values()) - min(sent.values()) <= 1, sent


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_plan_properties(scenario: tuple[Topology, Placement, int, int]) -> None:
    topo, placement, model_bytes, bucket = scenario
    plan = plan_transfer(topo, placement, model_bytes, bucket_bytes=bucket)
    check_plan(plan, topo, model_bytes)
    check_feeders_balanced(plan, placement)
    # every node without a trainer takes the model in through its NICs exactly once
    train_nodes = {p.node for p in placement.train}
    for node in {w.node for w in placement.eval} - train_nodes:
        ingress = sum(
            s.nbytes for s in plan.steps if s.dst.split("/")[0] == node and s.src.split("/")[0] != node
        )
        assert ingress == model_bytes, (node, ingress)
    # same input -> same plan, also through a spec round trip
    assert plan_transfer(topo, placement, model_bytes, bucket_bytes=bucket) == plan
    rebuilt = Topology.from_spec(topo.to_spec())
    assert plan_transfer(rebuilt, placement, model_bytes, bucket_bytes=bucket) == plan
    json.dumps(plan.to_dict())


@settings(max_examples=100, deadline=None)
@given(mixed_scenarios(), st.sampled_from(["auto", "chain", "direct"]))
def test_plan_properties_on_heterogeneous_clusters(
    scenario: tuple[Topology, Placement, int, int], relay: str
) -> None:
    topo, placement, model_bytes, bucket = scenario
    plan = plan_transfer(topo, placement, model_bytes, bucket_bytes=bucket, relay=relay)
    check_plan(plan, topo, model_bytes)
    check_feeders_balanced(plan, placement)
    assert plan == plan_transfer(topo, placement, model_bytes, bucket_bytes=bucket, relay=relay)
    seed = seed_plan(topo, placement, model_bytes)
    check_plan(seed, topo, model_bytes)


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.sampled_from(["None", "Double", "Shared"]))
def test_seed_plan_properties(scenario: tuple[Topology, Placement, int, int], buffer: str) -> None:
    topo, placement, model_bytes, bucket = scenario
    if not placement.eval:
        return
    plan = seed_plan(topo, placement, model_bytes, buffer=buffer, bucket_bytes=bucket)
    check_plan(plan, topo, model_bytes)
    assert plan == seed_plan(topo, placement, model_bytes, buffer=buffer, bucket_bytes=bucket)


def rows() -> list[tuple[int, int, int, int]]:
    out = []
    for nodes in (8, 64):
        for t, e in ((1, 1), (1, 3)):
            n_train = nodes * t // (t + e)
            for params in (7e9, 70e9, 1e12):
                out.append((nodes, n_train, nodes - n_train, int(2 * params)))
    return out


@pytest.mark.parametrize(("nodes", "train_nodes", "eval_nodes", "model_bytes"), rows())
def test_beats_the_seed_and_nears_the_bound(
    nodes: int, train_nodes: int, eval_nodes: int, model_bytes: int
) -> None:
    topo = Topology.synthetic(nodes, 8)
    placement = place_disaggregated(topo, 8 * train_nodes, 8 * eval_nodes)
    ours = plan_transfer(topo, placement, model_bytes)
    seed = seed_plan(topo, placement, model_bytes)
    assert ours.lower_bound_seconds == seed.lower_bound_seconds
    # NCCL spreads the seed's broadcasts over all 8 NICs too: ours wins by relaying (a train node
    # serving several eval nodes sends the model once, not once per eval node) and never loses
    assert ours.predicted_seconds <= seed.predicted_seconds * 1.001
    if eval_nodes > train_nodes:
        assert ours.predicted_seconds < seed.predicted_seconds / 2
    assert ours.predicted_seconds <= 1.25 * ours.lower_bound_seconds
    # no rank-0 funnel: every trainer sends
    assert min(ours.sender_shares().values()) > 0


def test_relays_form_chains_through_eval_nodes() -> None:
    topo = Topology.synthetic(4, 8)
    placement = place_disaggregated(topo, 8, 24)
    plan = plan_transfer(topo, placement, 16 * 10**9)
    assert "1 chain over 3 eval nodes, depth 3" in plan.relay
    network = [s for s in plan.steps if s.kind == "network"]
    # each eval node's NICs take the model in exactly once: 8 rails x 2 GB
    for node in ("node1", "node2", "node3"):
        ingress = sum(s.nbytes for s in network if s.dst.startswith(node + "/"))
        assert ingress == 16 * 10**9
    assert {s.stage for s in network} == {0, 1, 2}
    # every trainer sends one disjoint eighth
    assert sorted(plan.shares_by_node()["node1"].values()) == [2 * 10**9] * 8


def test_mixed_nodes_use_local_trainers_and_a_colocated_handoff_is_a_device_copy() -> None:
    topo = Topology.synthetic(2, 8)
    spread = place_disaggregated(topo, 8, 8, mode="spread")
    plan = plan_transfer(topo, spread, 10**9)
    assert all(s.kind != "network" for s in plan.steps)
    coloc = plan_transfer(topo, place_colocated(topo, 8, 8), 10**9)
    assert {s.kind for s in coloc.steps} == {"local"}
    cost = HARDWARE_PROFILES["H100"]  # plan_transfer's default pricing
    per_byte = max(1 / cost.load_bytes_per_s, cost.per_bucket_s / DEFAULT_BUCKET_BYTES)
    assert coloc.predicted_seconds == pytest.approx(10**9 * per_byte)  # not free
    assert coloc.lower_bound_seconds == 0.0  # sharing the trainer's memory would be
    nothing = plan_transfer(topo, place_disaggregated(topo, 4, 0), 10**9)
    assert nothing.steps == ()
    assert nothing.predicted_seconds == 0.0


def test_seed_plan_matches_the_seed_shape() -> None:
    topo = Topology.synthetic(4, 8)
    placement = place_disaggregated(topo, 8, 24)
    double = seed_plan(topo, placement, 10**9, buffer="Double")
    # one whole-model broadcast per eval node, each from a different trainer of node0; NCCL runs it
    # as 8 channel rings, one per rail of the eval node, reached over NVLink from the sender
    first_hops = [s for s in double.steps if s.after is None]
    assert sorted({s.src for s in first_hops}) == ["node0/gpu0", "node0/gpu1", "node0/gpu2"]
    assert len(first_hops) == 3 * 8
    for node in ("node1", "node2", "node3"):
        entering = [s for s in double.steps if s.dst.startswith(node + "/") and s.kind == "network"]
        assert sorted(s.dst for s in entering) == [f"{node}/gpu{g}" for g in range(8)]  # every rail
        assert sum(s.nbytes for s in entering) == 10**9  # the model enters the node once
    shared = seed_plan(topo, placement, 10**9, buffer="Shared")
    assert any(s.dst == "node1" for s in shared.steps)  # staged in the node's host-memory buffer
    with pytest.raises(PlacementError, match="'ghost'"):
        cost_transfer_info(topo, placement, {"x": [{"sender": "ghost", "receiver": []}]}, 10**9)


def test_bad_arguments() -> None:
    topo = Topology.synthetic(2, 2)
    placement = place_disaggregated(topo, 2, 2)
    for kwargs, needle in (
        ({"bucket_bytes": 0}, "bucket_bytes"),
        ({"buffer": "Sharded"}, "buffer"),
        ({"relay": "tree"}, "relay"),
        ({"max_fanout": 0}, "max_fanout"),
    ):
        with pytest.raises(PlacementError, match=needle):
            plan_transfer(topo, placement, 10, **kwargs)
    with pytest.raises(PlacementError, match="model_bytes"):
        plan_transfer(topo, placement, 0)
    with pytest.raises(PlacementError, match="no train worker"):
        plan_transfer(topo, Placement((WorkerPlacement("e", "eval", "node0", "gpu0"),)), 10)
    with pytest.raises(PlacementError, match="'node7'"):
        plan_transfer(topo, Placement((WorkerPlacement("e", "eval", "node7", "gpu0"),)), 10)
    isolated = Topology.from_spec(
        {"nodes": [{"id": "a", "devices": [{"id": "g"}]}, {"id": "b", "devices": [{"id": "g"}]}]}
    )
    lonely = Placement((WorkerPlacement("t", "train", "a", "g"), WorkerPlacement("e", "eval", "b", "g")))
    with pytest.raises(PlacementError, match="no link"):
        plan_transfer(isolated, lonely, 10)


def test_relay_modes() -> None:
    topo = Topology.synthetic(8, 8)
    placement = place_disaggregated(topo, 8, 56)
    chain = plan_transfer(topo, placement, 10**9, relay="chain")
    direct = plan_transfer(topo, placement, 10**9, relay="direct")
    assert "chain" in chain.relay
    assert direct.relay.startswith("7 chains")
    for plan in (chain, direct):
        check_plan(plan, topo, 10**9)


def test_to_dot_and_draw(tmp_path: Path) -> None:
    topo = Topology.synthetic(3, 4)
    plan = plan_transfer(topo, place_disaggregated(topo, 4, 8), 10**9)
    dot = plan.to_dot()
    assert dot.startswith("digraph transfer_plan {")
    assert dot.rstrip().endswith("}")
    assert '"node0/gpu0" -> "node1/gpu0"' in dot
    assert "stage 1" in dot
    assert "cluster_" in dot
    out = plan.draw(tmp_path / "sub" / "plan.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 1000
    seed = seed_plan(topo, place_disaggregated(topo, 4, 8), 10**9, buffer="Shared")
    assert seed.draw(tmp_path / "seed.png").read_bytes().startswith(PNG_MAGIC)


def test_draw_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    topo = Topology.synthetic(1, 2)
    plan = plan_transfer(topo, place_disaggregated(topo, 1, 1), 10)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install matplotlib.*\[draw\] extra of rlfleet-placement"):
        plan.draw(tmp_path / "x.png")


def test_plans_do_not_depend_on_hash_seeds() -> None:
    code = (
        "import json, sys\n"
        "from rlfleet.placement import Topology, place_disaggregated, plan_transfer, seed_plan\n"
        "t = Topology.synthetic(6, 4, nic_per='node')\n"
        "p = place_disaggregated(t, 5, 15, mode='spread')\n"
        "q = place_disaggregated(t, 6, 14)\n"
        "out = [plan_transfer(t, x, 10**9 + 7).to_dict() for x in (p, q)]\n"
        "out.append(seed_plan(t, q, 10**9 + 7, buffer='Shared').to_dict())\n"
        "sys.stdout.write(json.dumps(out))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1


def test_import_pulls_no_heavy_dependency() -> None:
    code = (
        "import sys, rlfleet.placement as p\n"
        "heavy = [m for m in ('torch', 'ray', 'matplotlib', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert sorted(p.__all__) == sorted(set(p.__all__))\n"
        "assert all(hasattr(p, n) for n in p.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_trainers_sharing_a_node_with_rollouts_use_the_nodes_idle_nics() -> None:
    """verl's shape: 2 trainers and 6 rollouts on node 0, 24 rollouts on 3 more nodes. The trainers'
    own 2 NICs would take 4x the bound; routing over NVLink to the 6 idle NICs brings it near."""
    topo = Topology.synthetic(4, 8)
    workers = [WorkerPlacement(f"train-{i}", "train", "node0", f"gpu{i}") for i in range(2)]
    slots = [(f"node{(k + 2) // 8}", f"gpu{(k + 2) % 8}") for k in range(30)]
    workers += [WorkerPlacement(f"eval-{k}", "eval", node, gpu) for k, (node, gpu) in enumerate(slots)]
    plan = plan_transfer(topo, Placement(tuple(workers)), 61 * 10**9)
    assert plan.predicted_seconds <= 1.25 * plan.lower_bound_seconds
    out_of_node0 = {s.src for s in plan.steps if s.src.startswith("node0/") and s.kind == "network"}
    assert out_of_node0 == {f"node0/gpu{g}" for g in range(8)}  # every NIC of node 0 carries a share


def test_direct_spreads_rollout_nodes_evenly_over_trainer_nodes_and_beats_the_seed() -> None:
    """Issue 25 #16: 16 nodes x 8 GPUs, 32 trainers on 4 nodes, 96 rollout GPUs on 12, 1 TB. Direct
    fan-out predicted 10.6 s against the seed's 7.98 s: disjoint feeder groups of 2 or 3 GPUs left
    some rollout nodes fed through two NICs. Now each trainer node serves three rollout nodes
    through all of its eight NICs, as the seed's broadcasts do."""
    topo = Topology.synthetic(16, 8)
    placement = place_disaggregated(topo, 32, 96, mode="packed")
    seed = seed_plan(topo, placement, 10**12)
    direct = plan_transfer(topo, placement, 10**12, relay="direct")
    assert direct.predicted_seconds <= seed.predicted_seconds
    served: dict[str, set[str]] = {}
    for s in direct.steps:
        if s.kind == "network":
            served.setdefault(s.src.split("/", 1)[0], set()).add(s.dst.split("/", 1)[0])
    assert sorted(len(nodes) for nodes in served.values()) == [3, 3, 3, 3]
    nics = {s.src for s in direct.steps if s.kind == "network"}
    assert len(nics) == 32  # every trainer NIC sends


def _idle_placement(topo: Topology, trainers: int) -> Placement:
    """Trainers on the first node only, the rest of it idle; rollout workers fill every other node."""
    gpus = len(topo.devices("node0"))
    workers = [WorkerPlacement(f"t{i}", "train", "node0", f"gpu{i}") for i in range(trainers)]
    slots = [(n, d.id) for n in topo.nodes[1:] for d in topo.devices(n)]
    workers += [WorkerPlacement(f"e{k}", "eval", node, dev) for k, (node, dev) in enumerate(slots)]
    assert trainers <= gpus
    return Placement(tuple(workers))


SHAPES = [(2, 1, "gpu"), (3, 4, "gpu"), (5, 8, "gpu"), (16, 8, "gpu"), (6, 2, "gpu")]
SHAPES += [(3, 8, "node"), (8, 4, "node")]  # one NIC per node, on the host


@pytest.mark.parametrize(("nodes", "gpus", "nic_per"), SHAPES)
def test_no_planner_option_is_worse_than_the_seed_under_the_same_constraint(
    nodes: int, gpus: int, nic_per: str
) -> None:
    """ "direct" keeps the seed's constraint (every rollout node fed straight from trainers, no
    relay) and "auto" is free of it: over packed, spread and half-idle trainer nodes, 1:1 to 1:7
    trainers to rollout workers, Double and Shared, both predict no longer than the seed's plan."""
    topo = Topology.synthetic(nodes, gpus, nic_per=nic_per)
    total = nodes * gpus
    placements = [_idle_placement(topo, t) for t in sorted({1, gpus // 2 or 1, gpus})]
    for n_train in sorted({1, max(1, total // 8), max(1, total // 4), max(1, total // 2)}):
        for mode in ("packed", "spread"):
            placements.append(place_disaggregated(topo, n_train, total - n_train, mode=mode))
    cases = itertools.product(placements, (10**9, 10**12), ("Double", "Shared"))
    for placement, model_bytes, buffer in cases:
        seed = seed_plan(topo, placement, model_bytes, buffer=buffer)
        for relay in ("direct", "auto"):
            ours = plan_transfer(topo, placement, model_bytes, relay=relay, buffer=buffer)
            assert ours.predicted_seconds <= seed.predicted_seconds * (1 + 1e-12), (relay, buffer, placement)
