"""Drawing a `SyncPlan`: Graphviz DOT text, and a PNG through matplotlib (imported lazily).

Processes are grouped by node (one box per node) and labelled with their role and name; every
edge carries its step's transport and bytes; the title puts the measured time (when a report is
given) beside the prediction and the lower bound.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.placement._draw import human_bytes, quote_dot

if TYPE_CHECKING:
    from rlfleet.placement.sync._plan import SyncPlan, SyncProcess, SyncStep
    from rlfleet.placement.sync._report import SyncReport

__all__ = ["draw_sync_plan", "sync_plan_to_dot", "sync_title"]

# Okabe-Ito (colour-blind safe), one colour per transport.
TRANSPORT_COLOURS = {
    "broadcast": "#0072B2",
    "node_buffer": "#009E73",
    "cuda_ipc": "#E69F00",
    "p2p": "#CC79A7",
    "object_store": "#D55E00",
}
ROLE_COLOURS = {"trainer": "#F4A582", "rollout": "#92C5DE"}


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def sync_title(plan: SyncPlan, report: SyncReport | None = None) -> str:
    """``<name> (<strategy>): measured X / predicted Y (r x), bound Z``."""
    head = f"{plan.name} plan ({plan.strategy}, {len(plan.steps)} steps)"
    if report is not None:
        state = "" if report.ok else " FAILED"
        timing = (
            f"measured {_seconds(report.measured_seconds)}{state} / predicted "
            f"{_seconds(plan.predicted_seconds)} ({report.ratio:.2f}x)"
        )
    else:
        timing = f"predicted {_seconds(plan.predicted_seconds)} (not run)"
    return f"{head}: {timing}, lower bound {_seconds(plan.lower_bound_seconds)}"


def _label(p: SyncProcess) -> str:
    extra = [] if p.device == "cpu" else [p.device]
    if p.shard is not None:
        extra.append(f"shard {p.shard[0]}/{p.shard[1]}")
    return f"{p.role} {p.id}" + (f" ({', '.join(extra)})" if extra else "")


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
        lines.append(f"    label={quote_dot('node ' + node)};")
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


def _layout(
    plan: SyncPlan,
) -> tuple[dict[str, tuple[float, float]], list[tuple[str, float, float, float, float]]]:
    """Process centres, and one box (node, x, y, width, height) per node on a grid."""
    nodes = plan.nodes
    cols = max(1, min(4, math.ceil(math.sqrt(len(nodes)))))
    per_node = {n: [p for p in plan.processes if p.node == n] for n in nodes}
    tallest = max((len(v) for v in per_node.values()), default=1)
    box_w, row_h = 3.2, 0.55
    box_h = row_h * tallest + 0.6
    pos: dict[str, tuple[float, float]] = {}
    boxes = []
    for i, node in enumerate(nodes):
        x0, y0 = (i % cols) * (box_w + 1.6), -(i // cols) * (box_h + 1.2)
        boxes.append((node, x0, y0 - box_h, box_w, box_h))
        for j, p in enumerate(per_node[node]):
            pos[p.id] = (x0 + box_w / 2, y0 - 0.55 - j * row_h)
    return pos, boxes


def draw_sync_plan(plan: SyncPlan, path: Path, report: SyncReport | None = None) -> Path:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "SyncPlan.draw() needs matplotlib; install the extra: pip install 'rlfleet-placement[draw]'"
        ) from exc
    pos, boxes = _layout(plan)
    xs = [b[1] for b in boxes] + [b[1] + b[3] for b in boxes]
    ys = [b[2] for b in boxes] + [b[2] + b[4] for b in boxes]
    width, height = max(xs) - min(xs) + 1.0, max(ys) - min(ys) + 1.6
    scale = min(1.0, 18.0 / max(width, height))
    fig: Any = Figure(figsize=(max(6.0, width * 1.4 * scale), max(3.5, height * 1.4 * scale + 1.0)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    _draw_nodes(ax, plan, pos, boxes)
    _draw_edges(ax, plan, pos)
    used = [t for t in TRANSPORT_COLOURS if any(s.transport == t for s in plan.steps)]
    handles = [Line2D([0], [0], color=TRANSPORT_COLOURS[t], lw=2, label=t) for t in used]
    if handles:  # under the title, so a tight crop leaves no empty band
        where = {"loc": "lower center", "bbox_to_anchor": (0.5, 1.0), "ncol": len(handles)}
        ax.legend(handles=handles, frameon=False, fontsize=9, **where)
    source = textwrap.shorten(plan.topology_source, 150, placeholder="...")
    ax.set_title(f"{sync_title(plan, report)}\npriced on: {source}", fontsize=9, pad=22)
    ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.4)
    ax.set_aspect("equal")
    ax.axis("off")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png", bbox_inches="tight")
    return path


def _draw_nodes(ax: Any, plan: SyncPlan, pos: dict[str, tuple[float, float]], boxes: list[Any]) -> None:
    from matplotlib.patches import FancyBboxPatch

    for node, x, y, w, h in boxes:
        ax.add_patch(
            FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fill=False, edgecolor="#999999", lw=0.8)
        )
        ax.text(x + 0.1, y + h - 0.12, f"node {_short(node)}", fontsize=8, va="top", color="#444444")
    for p in plan.processes:
        cx, cy = pos[p.id]
        ax.text(
            cx,
            cy,
            _label(p),
            ha="center",
            va="center",
            fontsize=8,
            zorder=4,
            bbox={"boxstyle": "round,pad=0.25", "fc": ROLE_COLOURS[p.role], "ec": "#555555", "lw": 0.6},
        )


def _draw_edges(ax: Any, plan: SyncPlan, pos: dict[str, tuple[float, float]]) -> None:
    from matplotlib.patches import FancyArrowPatch

    procs = {p.id: p for p in plan.processes}
    for s in plan.steps:
        colour = TRANSPORT_COLOURS.get(s.transport, "#000000")
        labelled: set[str] = set()
        for k, d in enumerate(s.dst):
            (x1, y1), (x2, y2) = pos[s.src], pos[d]
            same = procs[s.src].node == procs[d].node
            bend = 0.5 if same else 0.12 + 0.05 * (s.index % 3)
            ax.add_patch(
                FancyArrowPatch(
                    (x1, y1),
                    (x2, y2),
                    connectionstyle=f"arc3,rad={bend}",
                    arrowstyle="-|>",
                    mutation_scale=9,
                    color=colour,
                    lw=1.1,
                    alpha=0.85,
                    shrinkA=14,
                    shrinkB=14,
                    zorder=2,
                )
            )
            node = procs[d].node
            if node in labelled:
                continue
            labelled.add(node)
            t = 0.5 if same else 0.7 - 0.08 * (k % 3)
            mx, my = x1 + (x2 - x1) * t, y1 + (y2 - y1) * t
            if same:
                mx += 0.9
            ax.text(
                mx,
                my,
                _edge_label(s),
                fontsize=7,
                color=colour,
                ha="center",
                va="center",
                zorder=5,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
            )


def _short(node: str) -> str:
    """A Ray node id is 56 hex digits: its first 8 tell nodes apart in a picture."""
    hexdigits = set("0123456789abcdef")
    return f"{node[:8]}…" if len(node) > 16 and set(node) <= hexdigits else node
