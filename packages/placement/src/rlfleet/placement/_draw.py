"""Writing a picture of a plan: boxes in columns, edges routed between them, labels on the edges.

Both pictures (a `SyncPlan`'s processes, a `TransferPlan`'s nodes) put the boxes that send first
in column 0 and every box one column right of its furthest sender, so bytes flow left to right.
An edge between neighbouring columns leaves its box sideways, crosses the gap between the two
columns (where no box is) and enters its box sideways; an edge that skips a column, stays in
one or goes back runs over the top of every box in a lane of its own; an edge inside one box
(a node's own fan-out) is a bracket in that box's margin. Edges sharing a box side get ports of
their own, so parallel edges are drawn apart, and each label sits on its own edge, moved along
it until it overlaps no other label. `Picture.through` says which boxes an edge crosses (a test
checks it is only its own). matplotlib is imported only when a figure is made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.placement._errors import PlacementError

__all__ = [
    "IMAGE_FORMATS",
    "Box",
    "Edge",
    "Picture",
    "columns",
    "figure",
    "image_format",
    "in_order",
    "ports",
    "save",
]

#: File name suffix -> matplotlib format a plan's ``draw`` writes.
IMAGE_FORMATS: dict[str, str] = {".png": "png", ".svg": "svg", ".svgz": "svgz", ".pdf": "pdf"}
CHAR = 0.075  # width of one character of an 8 pt label, in picture units (see `SCALE`)
SCALE = 0.75  # inches per picture unit
GAP = 4.0  # between columns: room for the edges and their labels
PAD = 0.35  # an edge's horizontal run out of (and into) its box before it turns


@dataclass(frozen=True)
class Box:
    """A rectangle: ``x``, ``y`` its lower-left corner."""

    x: float
    y: float
    w: float
    h: float

    @property
    def right(self) -> float:
        return self.x + self.w

    @property
    def top(self) -> float:
        return self.y + self.h

    def holds(self, px: float, py: float, eps: float = 1e-6) -> bool:
        """Strictly inside (a point on the border is outside)."""
        return self.x + eps < px < self.right - eps and self.y + eps < py < self.top - eps


@dataclass
class Edge:
    """One drawn edge: its polyline, colour, label and where the label sits."""

    src: str
    dst: str
    colour: str
    label: str
    points: list[tuple[float, float]] = field(default_factory=list)
    label_at: tuple[float, float] | None = None


def columns(senders: Iterable[str], links: Iterable[tuple[str, str]], names: Sequence[str]) -> dict[str, int]:
    """Column of every name: 0 for ``senders``, else one right of its furthest sender."""
    fixed = set(senders)
    col = {n: 0 if n in fixed else 1 for n in names}
    pairs = [(a, b) for a, b in links if a != b and b not in fixed]
    for _ in range(len(names)):
        moved = False
        for a, b in pairs:
            if col[b] < col[a] + 1 <= len(names):
                col[b], moved = col[a] + 1, True
        if not moved:
            break
    return col


def in_order(col: Mapping[str, int], links: Iterable[tuple[str, str]], names: Sequence[str]) -> list[str]:
    """``names`` by column, each column below its senders' mean height (fewer crossing edges)."""
    senders: dict[str, list[str]] = {}
    for a, b in links:
        if a != b:
            senders.setdefault(b, []).append(a)
    rank = {n: float(i) for i, n in enumerate(names)}
    out: list[str] = []
    for c in sorted(set(col.values())):
        here = [n for n in names if col[n] == c]
        if c > 0:
            placed = {n: i for i, n in enumerate(out)}
            for n in here:
                known = [placed[a] for a in senders.get(n, []) if a in placed]
                rank[n] = sum(known) / len(known) if known else rank[n] + len(names)
            here.sort(key=lambda n: (rank[n], names.index(n)))
        out += here
    return out


def image_format(path: Path) -> str:
    """The format ``path`` names; an unknown suffix is refused before anything is drawn."""
    fmt = IMAGE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise PlacementError(
            f"cannot draw to {str(path)!r}: the file name must end in one of {sorted(IMAGE_FORMATS)} "
            f"(it sets the format), got {path.suffix or 'no suffix'!r}"
        )
    return fmt


def figure(width: float, height: float, what: str) -> Any:
    """A matplotlib figure of ``width`` x ``height`` inches on the Agg canvas (no pyplot)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"{what} needs matplotlib: pip install matplotlib (the [draw] extra of rlfleet-placement, "
            "e.g. pip install './packages/placement[draw]' from a clone)"
        ) from exc
    fig: Any = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)  # attaches itself to the figure
    return fig


def save(fig: Any, path: Path) -> Path:
    fmt = image_format(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format=fmt, bbox_inches="tight")
    return path


def _label_box(text: str, x: float, y: float) -> Box:
    w, h = 0.85 * CHAR * len(text) + 0.2, 0.34
    return Box(x - w / 2, y - h / 2, w, h)


def _overlap(a: Box, b: Box) -> float:
    dx = min(a.right, b.right) - max(a.x, b.x)
    dy = min(a.top, b.top) - max(a.y, b.y)
    return dx * dy if dx > 0 and dy > 0 else 0.0


@dataclass
class Picture:
    """Boxes (with the column each is in) and the edges routed between them."""

    boxes: dict[str, Box]
    column_of: dict[str, int]
    frames: Mapping[str, str] = field(default_factory=dict)  # an endpoint box -> the box holding it
    edges: list[Edge] = field(default_factory=list)
    lanes: int = 0
    labels: list[Box] = field(default_factory=list)

    def _span(self, column: int) -> tuple[float, float]:
        inside = [b for k, b in self.boxes.items() if self.column_of.get(k) == column]
        return min(b.x for b in inside), max(b.right for b in inside)

    @property
    def top(self) -> float:
        return max(b.top for b in self.boxes.values())

    def route(self, edge: Edge, out_y: float, in_y: float) -> None:
        """Route ``edge`` between two boxes of different frames: through the gap between their
        columns when the destination's is the next one, else over the top in a lane of its own."""
        a, b = self.boxes[edge.src], self.boxes[edge.dst]
        ca, cb = self.column_of[edge.src], self.column_of[edge.dst]
        out_x, in_x = self._span(ca)[1] + PAD, self._span(cb)[0] - PAD
        if cb == ca + 1:
            edge.points = [(a.right, out_y), (out_x, out_y), (in_x, in_y), (b.x, in_y)]
            self._label(edge, 1)
            return
        self.lanes += 1
        lane_x, lane_y = 0.22 * self.lanes, self.top + 0.5 + 0.3 * self.lanes
        edge.points = [
            (a.right, out_y),
            (out_x + lane_x, out_y),
            (out_x + lane_x, lane_y),
            (in_x - lane_x, lane_y),
            (in_x - lane_x, in_y),
            (b.x, in_y),
        ]
        self._label(edge, 2)

    def bracket(self, edge: Edge, side: int, depth: float, label: bool) -> None:
        """Route ``edge`` between two boxes of one frame: a bracket ``depth`` out of their
        ``side`` (-1 left, +1 right), its label (when asked) just outside it."""
        a, b = self.boxes[edge.src], self.boxes[edge.dst]
        x = a.x if side < 0 else a.right
        ya, yb = a.y + a.h / 2, b.y + b.h / 2
        edge.points = [(x, ya), (x + side * depth, ya), (x + side * depth, yb), (x, yb)]
        if label:
            width = _label_box(edge.label, 0, 0).w
            cx = x + side * (depth + 0.08 + width / 2)
            self._place(edge, [(cx, ya + t * (yb - ya)) for t in (0.5, 0.3, 0.7, 0.15, 0.85)])

    def _label(self, edge: Edge, segment: int) -> None:
        (x1, y1), (x2, y2) = edge.points[segment], edge.points[segment + 1]
        ts = (0.5, 0.35, 0.65, 0.25, 0.75, 0.42, 0.58)
        self._place(edge, [(x1 + t * (x2 - x1), y1 + t * (y2 - y1)) for t in ts])

    def _place(self, edge: Edge, spots: Sequence[tuple[float, float]]) -> None:
        def cost(spot: tuple[float, float]) -> float:
            box = _label_box(edge.label, *spot)
            return sum(_overlap(box, other) for other in [*self.labels, *self.boxes.values()])

        best = min(spots, key=cost)  # the first spot overlapping nothing, else the least overlap
        best = next((s for s in spots if cost(s) == 0), best)
        edge.label_at = best
        self.labels.append(_label_box(edge.label, *best))

    def through(self, edge: Edge, steps: int = 40) -> set[str]:
        """Boxes the edge crosses besides its own two and the frames holding them."""
        own = {edge.src, edge.dst, self.frames.get(edge.src, ""), self.frames.get(edge.dst, "")}
        hit: set[str] = set()
        for (x1, y1), (x2, y2) in zip(edge.points, edge.points[1:], strict=False):
            for k in range(steps + 1):
                px, py = x1 + (x2 - x1) * k / steps, y1 + (y2 - y1) * k / steps
                hit.update(n for n, b in self.boxes.items() if n not in own and b.holds(px, py))
        return hit

    def draw(self, ax: Any, arrow: float = 9) -> None:
        """The edges (lines with an arrowhead) and their labels on ``ax``."""
        from matplotlib.patches import FancyArrowPatch

        for e in self.edges:
            xs, ys = zip(*e.points, strict=True)
            ax.plot(xs[:-1], ys[:-1], color=e.colour, lw=1.1, alpha=0.9, zorder=2, solid_joinstyle="round")
            tail = FancyArrowPatch(
                e.points[-2], e.points[-1], arrowstyle="-|>", mutation_scale=arrow, color=e.colour, lw=1.1
            )
            tail.set_zorder(2)
            ax.add_patch(tail)
            if e.label_at is not None:
                ax.text(
                    *e.label_at,
                    e.label,
                    fontsize=7,
                    color=e.colour,
                    ha="center",
                    va="center",
                    zorder=5,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": e.colour, "lw": 0.4},
                )

    def extent(self) -> tuple[float, float, float, float]:
        """(x0, x1, y0, y1) holding every box, edge and label."""
        pts = [p for e in self.edges for p in e.points]
        xs = [b.x for b in self.boxes.values()] + [b.right for b in self.boxes.values()] + [p[0] for p in pts]
        ys = [b.y for b in self.boxes.values()] + [b.top for b in self.boxes.values()] + [p[1] for p in pts]
        xs += [b.x for b in self.labels] + [b.right for b in self.labels]
        ys += [b.y for b in self.labels] + [b.top for b in self.labels]
        return min(xs) - 0.3, max(xs) + 0.3, min(ys) - 0.3, max(ys) + 0.3


def ports(count: int, centre: float, height: float) -> list[float]:
    """``count`` port heights spread over the middle of a side of height ``height``."""
    if count <= 1:
        return [centre] * count
    span = 0.7 * height
    return [centre + span / 2 - span * i / (count - 1) for i in range(count)]
