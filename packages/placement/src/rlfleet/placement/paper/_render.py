"""Rendering: Graphviz DOT text, and a PNG through matplotlib (imported only here, lazily)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.placement._draw import human_bytes, quote_dot

if TYPE_CHECKING:
    from rlfleet.placement.paper._plan import TransferPlan

__all__ = ["draw_plan", "plan_to_dot"]

# Colour-blind-safe qualitative palette (Okabe-Ito), cycled by stage.
STAGE_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")


def _stage_colour(stage: int) -> str:
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def _title(plan: TransferPlan) -> str:
    return (
        f"{plan.name}: predicted {plan.predicted_seconds:.4g} s, lower bound {plan.lower_bound_seconds:.4g} s"
    )


def _vertices(plan: TransferPlan) -> dict[str, list[str]]:
    """Vertices touched by the plan, grouped by node, in first-use order."""
    by_node: dict[str, list[str]] = {}
    for v in [*plan.sources, *plan.receivers, *(x for s in plan.steps for x in (s.src, s.dst))]:
        group = by_node.setdefault(v.split("/", 1)[0], [])
        if v not in group:
            group.append(v)
    return by_node


def _edges(plan: TransferPlan) -> dict[tuple[str, str, int], int]:
    edges: dict[tuple[str, str, int], int] = {}
    for s in plan.steps:
        if s.src != s.dst:
            key = (s.src, s.dst, s.stage)
            edges[key] = edges.get(key, 0) + s.nbytes
    return edges


def plan_to_dot(plan: TransferPlan) -> str:
    sources, receivers = set(plan.sources), set(plan.receivers)
    lines = [
        "digraph transfer_plan {",
        "  rankdir=LR;",
        f"  label={quote_dot(_title(plan))};",
        "  node [shape=box, style=filled, fontsize=10];",
    ]
    for i, (node, vertices) in enumerate(_vertices(plan).items()):
        lines.append(f"  subgraph cluster_{i} {{")
        lines.append(f"    label={quote_dot(node)};")
        for v in vertices:
            role = "train" if v in sources else "eval" if v in receivers else "relay"
            colour = {"train": "#F4A582", "eval": "#92C5DE", "relay": "#E0E0E0"}[role]
            label = v.split("/", 1)[1] if "/" in v else "host"
            lines.append(
                f"    {quote_dot(v)} [label={quote_dot(f'{label} ({role})')}, fillcolor={quote_dot(colour)}];"
            )
        lines.append("  }")
    for (src, dst, stage), nbytes in _edges(plan).items():
        colour = _stage_colour(stage)
        label = f"stage {stage}: {human_bytes(nbytes)}"
        attrs = f"color={quote_dot(colour)}, label={quote_dot(label)}"
        lines.append(f"  {quote_dot(src)} -> {quote_dot(dst)} [{attrs}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _layout(plan: TransferPlan) -> dict[str, tuple[float, float]]:
    """Nodes on a grid; each node's vertices on a small circle around its centre."""
    groups = _vertices(plan)
    cols = max(1, math.ceil(math.sqrt(len(groups))))
    pos: dict[str, tuple[float, float]] = {}
    for i, vertices in enumerate(groups.values()):
        cx, cy = 3.0 * (i % cols), -3.0 * (i // cols)
        for j, v in enumerate(vertices):
            angle = 2 * math.pi * j / max(1, len(vertices))
            pos[v] = (cx + math.cos(angle), cy + math.sin(angle))
    return pos


def draw_plan(plan: TransferPlan, path: Path) -> Path:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import LineCollection
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as exc:  # pragma: no cover - exercised by a test that hides matplotlib
        raise ImportError(
            "TransferPlan.draw() needs matplotlib; install the extra: pip install 'rlfleet-placement[draw]'"
        ) from exc
    pos = _layout(plan)
    groups = _vertices(plan)
    fig: Any = Figure(figsize=(8, 8), dpi=100)
    FigureCanvasAgg(fig)  # attaches itself to the figure; no pyplot, no global backend switch
    ax = fig.add_subplot(1, 1, 1)
    cols = max(1, math.ceil(math.sqrt(len(groups))))
    for i, node in enumerate(groups):
        cx, cy = 3.0 * (i % cols), -3.0 * (i // cols)
        ax.add_patch(_circle(cx, cy))
        ax.text(cx, cy + 1.35, node, ha="center", fontsize=7)
    by_stage: dict[int, list[tuple[tuple[float, float], tuple[float, float]]]] = {}
    for src, dst, stage in _edges(plan):
        by_stage.setdefault(stage, []).append((pos[src], pos[dst]))
    for stage, segments in sorted(by_stage.items()):
        ax.add_collection(LineCollection(segments, colors=_stage_colour(stage), linewidths=0.8, alpha=0.7))
    sources, receivers = set(plan.sources), set(plan.receivers)
    for role, colour, members in (
        ("train", "#D6604D", [v for v in pos if v in sources]),
        ("eval", "#4393C3", [v for v in pos if v in receivers and v not in sources]),
        ("relay", "#999999", [v for v in pos if v not in sources and v not in receivers]),
    ):
        if members:
            ax.scatter(
                [pos[v][0] for v in members],
                [pos[v][1] for v in members],
                s=14,
                c=colour,
                label=role,
                zorder=3,
            )
    handles = [Line2D([0], [0], color=_stage_colour(s), label=f"stage {s}") for s in sorted(by_stage)[:8]]
    legend = ax.get_legend_handles_labels()[0] + handles
    fig.legend(handles=legend, fontsize=7, loc="lower center", ncol=min(len(legend), 6), frameon=False)
    ax.set_title(
        _title(plan),
        fontsize=9,
    )
    ax.set_aspect("equal")
    ax.autoscale()
    ax.axis("off")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png")
    return path


def _circle(cx: float, cy: float) -> Any:
    from matplotlib.patches import Circle

    return Circle((cx, cy), 1.25, fill=False, linewidth=0.5, edgecolor="#BBBBBB")
