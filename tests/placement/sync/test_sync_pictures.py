"""Every kind of SyncPlan picture: units a reader reads, names said once, parallel edges drawn
apart with their labels on them, no edge through a box that neither sends nor receives it, and
only the file formats the picture can be written in."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from sync_processes import BUCKETS, R, T, cluster

from rlfleet.placement import (
    HARDWARE_PROFILES,
    CostModel,
    PlacementError,
    StepReport,
    SyncPlan,
    SyncProcess,
    SyncReport,
    SyncStep,
    Topology,
    plan_sync,
    seed_sync_plan,
)
from rlfleet.placement.sync._render import sync_picture

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"
GB = 10**9


def readme_plan() -> SyncPlan:
    procs = [T("t0", "n0", "cuda:0"), T("t1", "n1", "cuda:0"), R("r0", "n0", "cuda:1")]
    procs += [R("r1", "n2", "cuda:0"), R("r2", "n2", "cuda:1")]
    return plan_sync(procs, [256 * 2**20] * 16, "Shared", cost=HARDWARE_PROFILES["H100"])


def recipe_processes() -> list[SyncProcess]:
    procs = [SyncProcess(f"trainer-{i}", "trainer", "node0", f"cuda:{i}") for i in range(2)]
    slots = [(f"node{1 + i // 3}", f"cuda:{i % 3}") for i in range(6)]
    return procs + [SyncProcess(f"rollout-{i}", "rollout", node, dev) for i, (node, dev) in enumerate(slots)]


def relay_plan() -> SyncPlan:
    """By hand: a relay (p2p out of a rollout node) and an object-store step skipping a column."""
    procs = (T("t0", "n0"), R("r0", "n1"), R("r1", "n2"))
    steps = (
        SyncStep(0, "broadcast", "t0", ("r0",), None, (0,), GB),
        SyncStep(1, "p2p", "r0", ("r1",), None, (0,), GB, after=(0,)),
        SyncStep(2, "object_store", "t0", ("r1",), None, (1,), GB),
    )
    return SyncPlan("Double", procs, (GB, GB), None, steps, (), 1.0, 0.5, CostModel(), "by hand")


def plans() -> dict[str, SyncPlan]:
    topo = Topology.synthetic(3, 8)
    cost = HARDWARE_PROFILES["H100"]
    procs = recipe_processes()
    sharded = [p for p in cluster(2) if p.role == "trainer"]
    sharded += [R(f"s{i}", f"n{1 + i // 2}", shard=(i % 2, 2)) for i in range(4)]
    return {
        "shared_cuda_ipc": readme_plan(),
        "shared_node_buffer": plan_sync(procs, [GB] * 14, "Shared", topology=topo, cost=cost, cuda_ipc=False),
        "double_two_senders": plan_sync(procs, [GB] * 14, "Double", topology=topo, cost=cost),
        "seed": seed_sync_plan(procs, [GB] * 14, "Shared", topology=topo, cost=cost),
        "cpu_mixed": plan_sync(cluster(3), BUCKETS, "Double"),
        "sharded": plan_sync(sharded, BUCKETS, "Sharded"),
        "relay_and_skip": relay_plan(),
    }


def report_of(plan: SyncPlan, ok: bool) -> SyncReport:
    steps = tuple(StepReport(s.index, s.predicted_seconds, s.predicted_seconds, {}) for s in plan.steps)
    error = None if ok else "r1 died"
    return SyncReport(1, ok, error, steps, 1.2 * plan.predicted_seconds, plan.predicted_seconds, plan.digest)


def _distance(p: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    (px, py), (ax, ay), (bx, by) = p, a, b
    length = (bx - ax) ** 2 + (by - ay) ** 2
    t = 0.0 if length == 0 else max(0.0, min(1.0, ((px - ax) * (bx - ax) + (py - ay) * (by - ay)) / length))
    return math.hypot(px - (ax + t * (bx - ax)), py - (ay + t * (by - ay)))


@pytest.mark.parametrize("name", list(plans()))
def test_every_picture_kind_renders_as_png_svg_and_pdf(name: str, tmp_path: Path) -> None:
    plan = plans()[name]
    assert plan.draw(tmp_path / f"{name}.png").read_bytes()[:8] == PNG
    assert plan.draw(tmp_path / f"{name}.png", report_of(plan, ok=False)).read_bytes()[:8] == PNG
    assert b"<svg" in plan.draw(tmp_path / f"{name}.svg", report_of(plan, ok=True)).read_bytes()[:400]
    assert plan.draw(tmp_path / "x" / f"{name}.PDF").read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize("name", list(plans()))
def test_edges_go_only_through_their_own_boxes_apart_and_labelled_on_themselves(name: str) -> None:
    plan = plans()[name]
    pic = sync_picture(plan)
    assert len(pic.edges) == sum(len(s.dst) for s in plan.steps)  # one edge per receiver
    for edge in pic.edges:
        assert pic.through(edge) == set(), (edge.src, edge.dst, edge.label)
        if edge.label_at is not None:  # on its own edge, or beside its own bracket touching it
            pairs = zip(edge.points, edge.points[1:], strict=False)
            local = plan.process(edge.src).node == plan.process(edge.dst).node
            reach = 0.5 * (0.07 * len(edge.label) + 0.2) + 0.1 if local else 1e-9
            assert min(_distance(edge.label_at, a, b) for a, b in pairs) <= reach
    ends = [(e.points[0], e.points[-1]) for e in pic.edges]
    assert len(set(ends)) == len(ends)  # parallel edges start or end apart
    starts = {}
    for e in pic.edges:  # edges of different steps never share a port
        key = e.points[0]
        starts.setdefault(key, set()).add(e.label)
    assert all(len(labels) == 1 for labels in starts.values())
    for i, a in enumerate(pic.labels):
        for b in pic.labels[i + 1 :]:
            assert min(a.right, b.right) <= max(a.x, b.x) or min(a.top, b.top) <= max(a.y, b.y), (a, b)
    labelled = {(e.label, plan.process(e.dst).node) for e in pic.edges if e.label_at is not None}
    assert labelled == {(e.label, plan.process(e.dst).node) for e in pic.edges}  # every step, every node


def test_labels_say_each_name_once_and_units_a_reader_reads() -> None:
    for plan in plans().values():
        dot = plan.to_dot()
        for kind in ("node", "trainer", "rollout"):
            assert not re.search(rf"\b{kind} {kind}", dot, re.IGNORECASE), kind
        assert "e+" not in dot
        assert "B/s per" not in dot
        assert "e+" not in plan.topology_source
    assert 'label="node0"' in plans()["seed"].to_dot()
    assert 'label="trainer-0 (cuda:0)"' in plans()["seed"].to_dot()
    assert 'label="node n0"' in readme_plan().to_dot()
    assert 'label="trainer t0 (cuda:0)"' in readme_plan().to_dot()
    assert Topology.synthetic(3, 8).source == "synthetic: 3 nodes x 8 GPUs, NIC 50 GB/s per GPU"
    assert "NIC 12.5 GB/s per node" in Topology.synthetic(2, 1, nic_per="node", nic_bandwidth=12.5e9).source


def test_an_unknown_picture_format_is_refused_naming_the_ones_there_are(tmp_path: Path) -> None:
    plan = readme_plan()
    for name in ("x.svgz2", "x.jpeg", "plan"):
        with pytest.raises(PlacementError, match=r"must end in one of \['.pdf', '.png', '.svg', '.svgz'\]"):
            plan.draw(tmp_path / name)
        assert not (tmp_path / name).exists()
