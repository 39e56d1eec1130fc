"""Transfer plans as data: steps (who sends which bytes to whom), per-link loads and predicted time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from rlfleet.placement._public import public

__all__ = ["LinkLoad", "TransferPlan", "TransferStep"]


@public
class TransferStep(NamedTuple):
    """Move bytes ``[offset, offset + nbytes)`` of the flat model from ``src`` to ``dst``.

    ``after`` is the step that brought these bytes to ``src`` (``None``: ``src`` is a trainer); the
    step forwards them bucket by bucket as they land. ``stage`` is the hop count from a trainer.
    ``links`` are the directed links crossed; ``kind`` is ``"local"`` (no link: same device),
    ``"network"`` (crosses nodes) or the kind of the slowest link inside a node.
    ``first_seconds``/``finish_seconds``: when the first bucket / the last byte lands at ``dst``.
    ``id`` is the step's position in ``TransferPlan.steps``.
    """

    id: int
    stage: int
    src: str
    dst: str
    offset: int
    nbytes: int
    kind: str
    after: int | None
    links: tuple[tuple[str, str], ...]
    first_seconds: float
    finish_seconds: float

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@public
class LinkLoad(NamedTuple):
    """Bytes one direction of one link carries in the whole plan."""

    src: str
    dst: str
    kind: str
    nbytes: int
    bandwidth: float
    latency: float

    @property
    def seconds(self) -> float:
        """Time the link is busy: no plan using it this way can finish sooner."""
        return self.nbytes / self.bandwidth


@public
@dataclass(frozen=True)
class TransferPlan:
    """One weight sync on paper: steps, link loads, ``predicted_seconds`` and ``lower_bound_seconds``."""

    name: str
    model_bytes: int
    bucket_bytes: int
    steps: tuple[TransferStep, ...]
    link_loads: tuple[LinkLoad, ...]
    predicted_seconds: float
    lower_bound_seconds: float
    sources: tuple[str, ...]
    receivers: tuple[str, ...]
    relay: str

    @property
    def stages(self) -> int:
        return 1 + max((s.stage for s in self.steps), default=-1)

    def received(self) -> dict[str, list[tuple[int, int]]]:
        """Byte ranges each vertex receives, sorted (a receiver should get ``[0, model_bytes)`` once)."""
        out: dict[str, list[tuple[int, int]]] = {}
        for s in self.steps:
            out.setdefault(s.dst, []).append((s.offset, s.end))
        for ranges in out.values():
            ranges.sort()
        return out

    def shares_by_node(self) -> dict[str, dict[str, int]]:
        """``{node: {source: bytes}}``: what each source injects into each node's copy of the model.

        Only steps leaving a source count (not relays); ranges a source sends to several devices of
        one node (a fan-out) count once.
        """
        per: dict[str, dict[str, list[tuple[int, int]]]] = {}
        sources = set(self.sources)
        for s in self.steps:
            if s.after is None and s.src in sources and s.kind != "local":
                per.setdefault(s.dst.split("/", 1)[0], {}).setdefault(s.src, []).append((s.offset, s.end))
        return {node: {src: _union_size(r) for src, r in by_src.items()} for node, by_src in per.items()}

    def sender_shares(self) -> dict[str, int]:
        """Bytes each source injects in total (sum of :meth:`shares_by_node` over nodes)."""
        shares = dict.fromkeys(self.sources, 0)
        for by_src in self.shares_by_node().values():
            for src, n in by_src.items():
                shares[src] += n
        return shares

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data."""
        return {
            "name": self.name,
            "model_bytes": self.model_bytes,
            "bucket_bytes": self.bucket_bytes,
            "predicted_seconds": self.predicted_seconds,
            "lower_bound_seconds": self.lower_bound_seconds,
            "relay": self.relay,
            "sources": list(self.sources),
            "receivers": list(self.receivers),
            "steps": [
                {
                    "id": s.id,
                    "stage": s.stage,
                    "src": s.src,
                    "dst": s.dst,
                    "offset": s.offset,
                    "nbytes": s.nbytes,
                    "kind": s.kind,
                    "after": s.after,
                    "links": [list(link) for link in s.links],
                    "first_seconds": s.first_seconds,
                    "finish_seconds": s.finish_seconds,
                }
                for s in self.steps
            ],
            "link_loads": [
                {
                    "src": ln.src,
                    "dst": ln.dst,
                    "kind": ln.kind,
                    "nbytes": ln.nbytes,
                    "bandwidth": ln.bandwidth,
                    "latency": ln.latency,
                }
                for ln in self.link_loads
            ],
        }

    def to_dot(self) -> str:
        """Graphviz DOT: nodes as clusters, one edge per (src, dst, stage) coloured by stage."""
        from rlfleet.placement.paper._render import plan_to_dot

        return plan_to_dot(self)

    def draw(self, path: str | Path) -> Path:
        """Draw the plan's nodes to ``path``: PNG, SVG(Z) or PDF by its suffix, another suffix
        refused (needs matplotlib: ``rlfleet-placement[draw]``)."""
        from rlfleet.placement.paper._render import draw_plan

        return draw_plan(self, Path(path))


def _union_size(ranges: list[tuple[int, int]]) -> int:
    total, cur_lo, cur_hi = 0, None, None
    for lo, hi in sorted(ranges):
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None and cur_lo is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None and cur_lo is not None:
        total += cur_hi - cur_lo
    return total
