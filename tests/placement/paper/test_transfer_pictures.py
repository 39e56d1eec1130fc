"""Every kind of TransferPlan picture: one box per node in columns from the trainers on, one edge
per pair of nodes labelled with its bytes, no edge through another node's box, readable units."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlfleet.placement import (
    PlacementError,
    Topology,
    TransferPlan,
    place_colocated,
    place_disaggregated,
    plan_transfer,
    seed_plan,
)
from rlfleet.placement.paper._render import plan_picture

pytest.importorskip("matplotlib")


def plans() -> dict[str, TransferPlan]:
    small, big = Topology.synthetic(4, 8), Topology.synthetic(16, 8, nic_per="node")
    packed, spread = place_disaggregated(small, 8, 24), place_disaggregated(small, 8, 24, mode="spread")
    wide = place_disaggregated(big, 32, 96)
    return {
        "chain": plan_transfer(small, packed, 14 * 10**9, relay="chain"),
        "direct": plan_transfer(big, wide, 10**12, relay="direct"),
        "trees": plan_transfer(big, wide, 10**12, max_fanout=3),
        "local_fan_outs": plan_transfer(small, spread, 14 * 10**9),
        "colocated": plan_transfer(small, place_colocated(small, 32, 32), 14 * 10**9),
        "seed": seed_plan(big, wide, 10**12),
        "seed_shared": seed_plan(small, packed, 14 * 10**9, buffer="Shared"),
    }


@pytest.mark.parametrize("name", list(plans()))
def test_every_picture_kind_renders_and_no_edge_crosses_another_node(name: str, tmp_path: Path) -> None:
    plan = plans()[name]
    assert plan.draw(tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in plan.draw(tmp_path / f"{name}.svg").read_bytes()[:400]
    pic, summary = plan_picture(plan)
    nodes = {v.split("/", 1)[0] for s in plan.steps for v in (s.src, s.dst)}
    assert set(summary) >= nodes
    crossing = {(s.src.split("/")[0], s.dst.split("/")[0]) for s in plan.steps}
    assert {(e.src, e.dst) for e in pic.edges} == {(a, b) for a, b in crossing if a != b}
    for edge in pic.edges:
        assert pic.through(edge) == set(), (edge.src, edge.dst)
        assert re.fullmatch(r"[\d.]+ [KMGT]?B", edge.label)
    dot = plan.to_dot()
    assert "e+" not in dot
    assert not re.search(r"\bnode node", dot)


def test_the_title_says_times_in_ms_or_s(tmp_path: Path) -> None:
    plan = plans()["chain"]
    assert "predicted 37.8 ms" in plan.to_dot()
    with pytest.raises(PlacementError, match="must end in one of"):
        plan.draw(tmp_path / "x.svgz2")
    assert not (tmp_path / "x.svgz2").exists()
