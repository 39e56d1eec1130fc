"""Drawing a `TransferPlan`: Graphviz DOT text (every device), and a picture of its nodes.

A paper plan has thousands of device-to-device steps, so the picture is one box per node saying
what the node holds ("8 train", "6 eval, 2 relay") and one edge per pair of nodes with the bytes
that cross between them, coloured by the first stage that uses it. Nodes holding trainers stand
in the first column and every other node one column right of the nodes that feed it, so a relay
chain reads left to right and no edge crosses a node it does not leave or enter.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.placement._draw import (
    SCALE,
    Box,
    Edge,
    Picture,
    columns,
    figure,
    image_format,
    in_order,
    ports,
    save,
)
from rlfleet.placement._format import human_bytes, human_seconds, named, quote_dot

if TYPE_CHECKING:
    from rlfleet.placement.paper._plan import TransferPlan

__all__ = ["draw_plan", "plan_picture", "plan_to_dot"]

# Colour-blind-safe qualitative palette (Okabe-Ito), cycled by stage.
STAGE_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
ROLE_COLOURS = {"train": "#F4A582", "eval": "#92C5DE", "relay": "#E0E0E0"}
NODE_W, NODE_H, NODE_GAP = 3.0, 1.0, 0.6


def _stage_colour(stage: int) -> str:
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def _title(plan: TransferPlan) -> str:
    return (
        f"{plan.name}: predicted {human_seconds(plan.predicted_seconds)}, "
        f"lower bound {human_seconds(plan.lower_bound_seconds)} ({human_bytes(plan.model_bytes)} model)"
    )


def _vertices(plan: TransferPlan) -> dict[str, list[str]]:
    """Vertices touched by the plan, grouped by node, in first-use order."""
    by_node: dict[str, list[str]] = {}
    for v in [*plan.sources, *plan.receivers, *(x for s in plan.steps for x in (s.src, s.dst))]:
        group = by_node.setdefault(v.split("/", 1)[0], [])
        if v not in group:
            group.append(v)
    return by_node


def _role(plan: TransferPlan, vertex: str) -> str:
    return "train" if vertex in plan.sources else "eval" if vertex in plan.receivers else "relay"


def _edges(plan: TransferPlan) -> dict[tuple[str, str, int], int]:
    edges: dict[tuple[str, str, int], int] = {}
    for s in plan.steps:
        if s.src != s.dst:
            key = (s.src, s.dst, s.stage)
            edges[key] = edges.get(key, 0) + s.nbytes
    return edges


def plan_to_dot(plan: TransferPlan) -> str:
    lines = [
        "digraph transfer_plan {",
        "  rankdir=LR;",
        f"  label={quote_dot(_title(plan))};",
        "  node [shape=box, style=filled, fontsize=10];",
    ]
    for i, (node, vertices) in enumerate(_vertices(plan).items()):
        lines.append(f"  subgraph cluster_{i} {{")
        lines.append(f"    label={quote_dot(named('node', node))};")
        for v in vertices:
            role = _role(plan, v)
            label = v.split("/", 1)[1] if "/" in v else "host"
            attrs = f"label={quote_dot(f'{label} ({role})')}, fillcolor={quote_dot(ROLE_COLOURS[role])}"
            lines.append(f"    {quote_dot(v)} [{attrs}];")
        lines.append("  }")
    for (src, dst, stage), nbytes in _edges(plan).items():
        label = f"stage {stage}: {human_bytes(nbytes)}"
        attrs = f"color={quote_dot(_stage_colour(stage))}, label={quote_dot(label)}"
        lines.append(f"  {quote_dot(src)} -> {quote_dot(dst)} [{attrs}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node_summary(plan: TransferPlan, vertices: list[str]) -> str:
    counts: dict[str, int] = {}
    for v in vertices:
        if "/" in v:  # a device; a host vertex only relays a NIC's bytes
            counts[_role(plan, v)] = counts.get(_role(plan, v), 0) + 1
    return ", ".join(f"{n} {role}" for role, n in counts.items()) or "host only"


def plan_picture(plan: TransferPlan) -> tuple[Picture, dict[str, str]]:
    """Node boxes in columns and one routed edge per pair of nodes; and each node's summary."""
    groups = _vertices(plan)
    crossing: dict[tuple[str, str], tuple[int, int]] = {}  # (src node, dst node) -> (bytes, stage)
    for s in plan.steps:
        a, b = s.src.split("/", 1)[0], s.dst.split("/", 1)[0]
        if a != b:
            nbytes, stage = crossing.get((a, b), (0, s.stage))
            crossing[(a, b)] = (nbytes + s.nbytes, min(stage, s.stage))
    senders = {v.split("/", 1)[0] for v in plan.sources}
    col = columns(senders, crossing, list(groups))
    boxes: dict[str, Box] = {}
    heights = dict.fromkeys(col.values(), 0.0)
    for node in in_order(col, crossing, list(groups)):
        c = col[node]
        boxes[node] = Box(c * (NODE_W + 4.0), heights[c] - NODE_H, NODE_W, NODE_H)
        heights[c] -= NODE_H + NODE_GAP
    pic = Picture(boxes, col)
    outs: dict[str, list[str]] = {}
    ins: dict[str, list[str]] = {}
    for a, b in crossing:
        outs.setdefault(a, []).append(b)
        ins.setdefault(b, []).append(a)
    out_y: dict[tuple[str, str], float] = {}
    in_y: dict[tuple[str, str], float] = {}
    for a, dsts in outs.items():  # ports ordered by the other end's height: fewer crossings
        dsts.sort(key=lambda n: -boxes[n].y)
        spread = ports(len(dsts), boxes[a].y + NODE_H / 2, NODE_H)
        out_y.update(((a, b), y) for b, y in zip(dsts, spread, strict=True))
    for b, srcs in ins.items():
        srcs.sort(key=lambda n: -boxes[n].y)
        spread = ports(len(srcs), boxes[b].y + NODE_H / 2, NODE_H)
        in_y.update(((a, b), y) for a, y in zip(srcs, spread, strict=True))
    for (a, b), (nbytes, stage) in crossing.items():
        edge = Edge(a, b, _stage_colour(stage), human_bytes(nbytes))
        pic.route(edge, out_y[(a, b)], in_y[(a, b)])
        pic.edges.append(edge)
    return pic, {node: _node_summary(plan, vertices) for node, vertices in groups.items()}


def draw_plan(plan: TransferPlan, path: Path) -> Path:
    image_format(path)  # an unknown format is refused before any drawing
    pic, summary = plan_picture(plan)
    x0, x1, y0, y1 = pic.extent()
    fig = figure(max(6.0, (x1 - x0) * SCALE), max(3.0, (y1 - y0) * SCALE + 1.2), "TransferPlan.draw()")
    ax = fig.add_subplot(1, 1, 1)
    _draw_nodes(ax, plan, pic, summary)
    pic.draw(ax)
    _legend(ax, pic)
    ax.set_title(f"{_title(plan)}\n{plan.relay}", fontsize=9, pad=24)
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_aspect("equal")
    ax.axis("off")
    return save(fig, path)


def _draw_nodes(ax: Any, plan: TransferPlan, pic: Picture, summary: dict[str, str]) -> None:
    from matplotlib.patches import FancyBboxPatch

    senders = {v.split("/", 1)[0] for v in plan.sources}
    for node, text in summary.items():
        b = pic.boxes[node]
        colour = ROLE_COLOURS["train" if node in senders else "eval"]
        style = "round,pad=0,rounding_size=0.1"
        ax.add_patch(FancyBboxPatch((b.x, b.y), b.w, b.h, boxstyle=style, fc=colour, ec="#555555", lw=0.6))
        ax.text(b.x + b.w / 2, b.y + 0.66, named("node", node), fontsize=8, ha="center", va="center")
        ax.text(b.x + b.w / 2, b.y + 0.3, text, fontsize=7, ha="center", va="center", color="#333333")


def _legend(ax: Any, pic: Picture) -> None:
    from matplotlib.lines import Line2D

    stages = sorted({STAGE_COLOURS.index(e.colour) for e in pic.edges})
    handles = [Line2D([0], [0], color=STAGE_COLOURS[s], lw=2, label=f"stage {s}") for s in stages[:8]]
    if handles:
        where = {"loc": "lower center", "bbox_to_anchor": (0.5, 1.0), "ncol": len(handles)}
        ax.legend(handles=handles, frameon=False, fontsize=8, **where)
