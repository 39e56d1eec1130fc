"""Drawing a `SyncPlan`: Graphviz DOT text, and a picture through matplotlib (imported lazily).

One box per node holding one box per process, named once ("trainer-0", or "trainer t0" when the
id does not say its role). Nodes with a trainer stand in the first column and every other node
one column right of the nodes that send to it, so broadcasts run left to right between columns
and never through a box that does not send or receive them; a node's own steps (node buffer,
CUDA IPC) are brackets in its margin. Every edge carries its step's number, transport and
bytes; the title puts the measured time (when a report is given) beside the prediction and the
lower bound, and the subtitle what the plan was priced on.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.placement._draw import (
    CHAR,
    GAP,
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
    from rlfleet.placement.sync._plan import SyncPlan, SyncProcess, SyncStep
    from rlfleet.placement.sync._report import SyncReport

__all__ = ["draw_sync_plan", "sync_picture", "sync_plan_to_dot", "sync_title"]

# Okabe-Ito (colour-blind safe), one colour per transport.
TRANSPORT_COLOURS = {
    "broadcast": "#0072B2",
    "node_buffer": "#009E73",
    "cuda_ipc": "#E69F00",
    "p2p": "#CC79A7",
    "object_store": "#D55E00",
}
ROLE_COLOURS = {"trainer": "#F4A582", "rollout": "#92C5DE"}
ROW, PROC_H, TITLE_H, MARGIN = 0.62, 0.42, 0.55, 0.5


def sync_title(plan: SyncPlan, report: SyncReport | None = None) -> str:
    """``<name> plan (<strategy>, n steps): measured X / predicted Y (r x), lower bound Z``."""
    head = f"{plan.name} plan ({plan.strategy}, {len(plan.steps)} steps)"
    if report is not None:
        state = "" if report.ok else " FAILED"
        timing = (
            f"measured {human_seconds(report.measured_seconds)}{state} / predicted "
            f"{human_seconds(plan.predicted_seconds)} ({report.ratio:.2f}x)"
        )
    else:
        timing = f"predicted {human_seconds(plan.predicted_seconds)} (not run)"
    return f"{head}: {timing}, lower bound {human_seconds(plan.lower_bound_seconds)}"


def _label(p: SyncProcess) -> str:
    extra = [] if p.device == "cpu" else [p.device]
    if p.shard is not None:
        extra.append(f"shard {p.shard[0]}/{p.shard[1]}")
    return named(p.role, p.id) + (f" ({', '.join(extra)})" if extra else "")


def _node_label(node: str) -> str:
    return named("node", _short(node))


def _edge_label(step: SyncStep) -> str:
    return f"#{step.index} {step.transport} {human_bytes(step.nbytes)}"


def sync_plan_to_dot(plan: SyncPlan, report: SyncReport | None = None) -> str:
    lines = [
        "digraph sync_plan {",
        "  rankdir=LR;",
        f"  label={quote_dot(sync_title(plan, report))};",
        "  labelloc=t;",
        '  node [shape=box, style="rounded,filled", fontsize=10];',
    ]
    for i, node in enumerate(plan.nodes):
        lines.append(f"  subgraph cluster_{i} {{")
        lines.append(f"    label={quote_dot(_node_label(node))};")
        for p in plan.processes:
            if p.node == node:
                colour = ROLE_COLOURS[p.role]
                attrs = f"label={quote_dot(_label(p))}, fillcolor={quote_dot(colour)}"
                lines.append(f"    {quote_dot(p.id)} [{attrs}];")
        lines.append("  }")
    for s in plan.steps:
        colour = TRANSPORT_COLOURS.get(s.transport, "#000000")
        for d in s.dst:
            lines.append(
                f"  {quote_dot(s.src)} -> {quote_dot(d)} "
                f"[color={quote_dot(colour)}, label={quote_dot(_edge_label(s))}];"
            )
    lines.append("}")
    return "\n".join(lines) + "\n"


def _boxes(plan: SyncPlan) -> tuple[dict[str, Box], dict[str, int], dict[str, str], dict[str, int]]:
    """Node and process boxes (nodes in columns, processes stacked inside), each box's column,
    the node holding each process, and which side (-1 left, +1 right) a node's brackets go."""
    node_of = {p.id: p.node for p in plan.processes}
    cross = [(node_of[s.src], node_of[d]) for s in plan.steps for d in s.dst]
    cross = [(a, b) for a, b in cross if a != b]
    col = columns({p.node for p in plan.trainers}, cross, plan.nodes)
    sends_out = {a for a, _b in cross}
    side = {n: -1 if n in sends_out else 1 for n in plan.nodes}
    brackets = dict.fromkeys(plan.nodes, 0)  # a node's own edges, nested in its margin
    label_w = dict.fromkeys(plan.nodes, 0.0)
    for s in plan.steps:
        local = sum(node_of[d] == node_of[s.src] for d in s.dst)
        if local:
            brackets[node_of[s.src]] += local
            label_w[node_of[s.src]] = max(label_w[node_of[s.src]], CHAR * 0.85 * len(_edge_label(s)) + 0.2)
    bracket_room = {n: 0.45 + 0.18 * brackets[n] + label_w[n] if brackets[n] else 0.0 for n in plan.nodes}
    width = dict.fromkeys(col.values(), 0.0)
    for p in plan.processes:
        width[col[p.node]] = max(width[col[p.node]], CHAR * len(_label(p)) + 0.4)
    room = {c: max([bracket_room[n] for n in plan.nodes if col[n] == c], default=0.0) for c in width}
    boxes: dict[str, Box] = {}
    column_of: dict[str, int] = {}
    ordered = in_order(col, cross, plan.nodes)
    x = 0.0
    for c in sorted(width):
        node_w = width[c] + 2 * MARGIN + room[c]
        y = 0.0
        for node in (n for n in ordered if col[n] == c):
            procs = [p for p in plan.processes if p.node == node]
            h = TITLE_H + ROW * len(procs) + 0.2
            boxes[node], column_of[node] = Box(x, y - h, node_w, h), c
            px = x + MARGIN + (room[c] if side[node] < 0 else 0.0)
            for j, p in enumerate(procs):
                boxes[p.id] = Box(px, y - TITLE_H - ROW * j - PROC_H, width[c], PROC_H)
                column_of[p.id] = c
            y -= h + 0.7
        x += node_w + GAP
    return boxes, column_of, node_of, side


def sync_picture(plan: SyncPlan) -> Picture:
    """The plan's boxes and routed edges (what `draw_sync_plan` draws; tests check its geometry)."""
    boxes, column_of, node_of, side = _boxes(plan)
    pic = Picture(boxes, column_of, frames=node_of)
    cross = [(s, d) for s in plan.steps for d in s.dst if node_of[s.src] != node_of[d]]
    outs: dict[str, list[tuple[SyncStep, str]]] = {}
    ins: dict[str, list[tuple[SyncStep, str]]] = {}
    for s, d in cross:
        outs.setdefault(s.src, []).append((s, d))
        ins.setdefault(d, []).append((s, d))
    out_y: dict[tuple[int, str], float] = {}
    in_y: dict[tuple[int, str], float] = {}
    for pid, edges in outs.items():  # ports ordered by the other end's height: fewer crossings
        edges.sort(key=lambda e: -boxes[e[1]].y)
        spread = ports(len(edges), boxes[pid].y + PROC_H / 2, PROC_H)
        out_y.update(((s.index, d), y) for (s, d), y in zip(edges, spread, strict=True))
    for pid, edges in ins.items():
        edges.sort(key=lambda e: -boxes[e[0].src].y)
        spread = ports(len(edges), boxes[pid].y + PROC_H / 2, PROC_H)
        in_y.update(((s.index, d), y) for (s, d), y in zip(edges, spread, strict=True))
    labelled: set[tuple[int, str]] = set()
    for s, d in cross:
        edge = Edge(s.src, d, TRANSPORT_COLOURS.get(s.transport, "#000000"), _edge_label(s))
        pic.route(edge, out_y[(s.index, d)], in_y[(s.index, d)])
        if (s.index, node_of[d]) in labelled:
            edge.label_at = None  # one label per step and node: its other edges run beside it
            pic.labels.pop()
        labelled.add((s.index, node_of[d]))
        pic.edges.append(edge)
    _brackets(plan, pic, node_of, side)
    return pic


def _brackets(plan: SyncPlan, pic: Picture, node_of: dict[str, str], side: dict[str, int]) -> None:
    """A node's own steps: one bracket per reader, nested by reach, labelled once per step."""
    depth: dict[str, float] = {}
    for s in plan.steps:
        local = sorted(
            (d for d in s.dst if node_of[d] == node_of[s.src]),
            key=lambda d: abs(pic.boxes[d].y - pic.boxes[s.src].y),
        )
        node = node_of[s.src]
        for k, d in enumerate(local):
            depth[node] = depth.get(node, 0.07) + 0.18
            edge = Edge(s.src, d, TRANSPORT_COLOURS.get(s.transport, "#000000"), _edge_label(s))
            pic.bracket(edge, side[node], depth[node], label=k == len(local) - 1)
            pic.edges.append(edge)


def draw_sync_plan(plan: SyncPlan, path: Path, report: SyncReport | None = None) -> Path:
    image_format(path)  # an unknown format is refused before any drawing
    pic = sync_picture(plan)
    x0, x1, y0, y1 = pic.extent()
    fig = figure(max(6.0, (x1 - x0) * SCALE), max(3.0, (y1 - y0) * SCALE + 1.2), "SyncPlan.draw()")
    ax = fig.add_subplot(1, 1, 1)
    _draw_boxes(ax, plan, pic)
    pic.draw(ax)
    _legend(ax, plan)
    source = textwrap.shorten(plan.topology_source, 150, placeholder="...")
    ax.set_title(f"{sync_title(plan, report)}\npriced on: {source}", fontsize=9, pad=24)
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_aspect("equal")
    ax.axis("off")
    return save(fig, path)


def _draw_boxes(ax: Any, plan: SyncPlan, pic: Picture) -> None:
    from matplotlib.patches import FancyBboxPatch

    for node in plan.nodes:
        b = pic.boxes[node]
        frame = FancyBboxPatch(
            (b.x, b.y), b.w, b.h, boxstyle="round,pad=0,rounding_size=0.12", fill=False, ec="#999999", lw=0.8
        )
        ax.add_patch(frame)
        ax.text(b.x + 0.15, b.top - 0.15, _node_label(node), fontsize=8, va="top", color="#444444")
    for p in plan.processes:
        b = pic.boxes[p.id]
        style = "round,pad=0,rounding_size=0.08"
        box = FancyBboxPatch((b.x, b.y), b.w, b.h, boxstyle=style, fc=ROLE_COLOURS[p.role], ec="#555555")
        box.set_linewidth(0.6)
        box.set_zorder(3)
        ax.add_patch(box)
        ax.text(b.x + b.w / 2, b.y + b.h / 2, _label(p), fontsize=8, ha="center", va="center", zorder=4)


def _legend(ax: Any, plan: SyncPlan) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    used = [t for t in TRANSPORT_COLOURS if any(s.transport == t for s in plan.steps)]
    handles: list[Any] = [Line2D([0], [0], color=TRANSPORT_COLOURS[t], lw=2, label=t) for t in used]
    handles += [Patch(fc=ROLE_COLOURS[r], ec="#555555", label=r) for r in ROLE_COLOURS]
    where = {"loc": "lower center", "bbox_to_anchor": (0.5, 1.0), "ncol": len(handles)}
    ax.legend(handles=handles, frameon=False, fontsize=8, **where)


def _short(node: str) -> str:
    """A Ray node id is 56 hex digits: its first 8 tell nodes apart in a picture."""
    hexdigits = set("0123456789abcdef")
    return f"{node[:8]}…" if len(node) > 16 and set(node) <= hexdigits else node
