"""Pieces of the transfer planner: the placement seen through the topology, range splitting,
relay-tree shapes (the pipeline estimate that picks them)."""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.placement._errors import PlacementError
from rlfleet.placement.place._placement import Placement
from rlfleet.placement.topology._topology import Topology

__all__ = ["Feed", "View", "blocks", "check_bytes", "choose_trees", "feed", "levels", "snap", "split"]

Feed = list[tuple[str, int, int]]  # (feeder, lo, hi): the byte range a feeder sends into one tree


def check_bytes(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlacementError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass
class View:
    """The placement seen through the topology: device vertices, in topology order."""

    topology: Topology
    placement: Placement
    order: dict[str, int] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    receivers: list[str] = field(default_factory=list)
    needy_by_node: dict[str, list[str]] = field(default_factory=dict)
    source_nodes: list[str] = field(default_factory=list)
    rail_cache: dict[str, list[tuple[str, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.placement.validate(self.topology)
        self.order = {d.vertex: i for i, d in enumerate(self.topology.devices())}
        vertex = {w.worker_id: f"{w.node}/{w.device}" for w in self.placement.workers}
        self.sources = sorted({vertex[w.worker_id] for w in self.placement.train}, key=self.order.__getitem__)
        self.receivers = sorted(
            {vertex[w.worker_id] for w in self.placement.eval}, key=self.order.__getitem__
        )
        src_set = set(self.sources)
        for r in self.receivers:
            if r not in src_set:
                self.needy_by_node.setdefault(r.split("/", 1)[0], []).append(r)
        self.source_nodes = list(dict.fromkeys(s.split("/", 1)[0] for s in self.sources))
        if self.needy_by_node and not self.sources:
            raise PlacementError("placement has eval workers but no train worker to send weights from")

    def rails(self, node: str) -> list[tuple[str, float]]:
        """NIC endpoints of ``node`` whose traffic uses their own NIC, with that NIC's bandwidth."""
        cached = self.rail_cache.get(node)
        if cached is not None:
            return cached
        out: dict[str, float] = {}
        for port in self.topology.ports(node):
            if port.local in out:
                continue
            used = self.topology.nearest_port(port.local)
            if used is not None and used.local == port.local:
                out[port.local] = used.bandwidth
        self.rail_cache[node] = list(out.items())
        return self.rail_cache[node]


def split(lo: int, hi: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Split ``[lo, hi)`` into contiguous ranges proportional to ``weights`` (largest remainder)."""
    total = hi - lo
    wsum = float(sum(weights))
    exact = [total * w / wsum for w in weights]
    sizes = [math.floor(x) for x in exact]
    short = total - sum(sizes)
    for i in sorted(range(len(weights)), key=lambda i: (sizes[i] - exact[i], i))[:short]:
        sizes[i] += 1
    out, cur = [], lo
    for size in sizes:
        out.append((cur, cur + size))
        cur += size
    return out


def levels(members: int, fanout: int) -> int:
    """Depth (levels) of a complete ``fanout``-ary tree holding ``members`` nodes."""
    if members <= 0:
        return 0
    if fanout == 1:
        return members
    levels, width, placed = 0, 1, 0
    while placed < members:
        placed += width
        width *= fanout
        levels += 1
    return levels


def snap(ranges: list[tuple[int, int]], points: Sequence[int]) -> list[tuple[int, int]]:
    """Move inner range boundaries onto nearby ``points`` (piece boundaries) so no sliver steps appear.

    A boundary moves at most 1/64 of the range it ends, so rail loads stay balanced.
    """
    if not points:
        return ranges
    cuts = [lo for lo, _hi in ranges[1:]]
    pts = sorted(set(points))
    snapped = []
    for cut, (lo, hi) in zip(cuts, ranges[:-1], strict=True):
        tol = (hi - lo) // 64
        j = bisect_left(pts, cut)
        near = [p for p in pts[max(0, j - 1) : j + 1] if abs(p - cut) <= tol]
        snapped.append(min(near, key=lambda p: (abs(p - cut), p)) if near else cut)
    bounds = [ranges[0][0], *snapped, ranges[-1][1]]
    for i in range(1, len(bounds)):  # keep boundaries monotone
        bounds[i] = max(bounds[i], bounds[i - 1])
    return list(itertools.pairwise(bounds))


def choose_trees(
    view: View,
    pure: list[str],
    feeders: list[str],
    model_bytes: int,
    bucket_bytes: int,
    relay: str,
    max_fanout: int,
) -> tuple[int, int, str]:
    """Pick (trees, fanout) minimising the pipeline estimate; returns a description too.

    Estimate = bandwidth term (feeders' NICs shared by the trees; an eval node's ingress; a relay's
    egress shared by its children) + (depth - 1) bucket hops + per-level latency.
    """
    rails = {n: view.rails(n) for n in pure}
    for n, r in rails.items():
        if not r:
            raise PlacementError(f"node {n!r} holds eval workers but has no link to other nodes")
    ingress = min(sum(bw for _, bw in r) for r in rails.values())
    nics: dict[tuple[str, str], float] = {}
    for f in feeders:
        port = view.topology.nearest_port(f)
        if port is not None:
            nics.setdefault((port.local, port.remote), port.bandwidth)
    source_bw = sum(nics.values())
    if source_bw <= 0:
        raise PlacementError(
            f"no train device has a link to other nodes, but eval-only nodes {pure[:3]!r} need the weights"
        )
    latency = 2 * max(p.latency for n in pure for p in view.topology.ports(n))
    n_eval = len(pure)
    if relay == "direct":  # every rollout node straight from the feeders, as the seed's broadcasts
        candidates = [(n_eval, 1)]
    else:
        fanouts = range(1, max_fanout + 1) if relay == "auto" else (1,)
        candidates = [(c, k) for c in range(1, n_eval + 1) for k in fanouts]
    best: tuple[float, int, int] | None = None
    for trees, k in candidates:
        depth = levels(math.ceil(n_eval / trees), k)
        bw_term = max(model_bytes * trees / source_bw, model_bytes / ingress)
        if depth > 1:
            bw_term = max(bw_term, min(k, math.ceil(n_eval / trees) - 1) * model_bytes / ingress)
        estimate = bw_term + (depth - 1) * k * min(bucket_bytes, model_bytes) / ingress + depth * latency
        if best is None or estimate < best[0]:
            best = (estimate, trees, k)
    assert best is not None
    _, trees, k = best
    depth = levels(math.ceil(n_eval / trees), k)
    shape = "chain" if k == 1 else f"{k}-ary tree"
    return trees, k, f"{trees} {shape}{'s' if trees > 1 else ''} over {n_eval} eval nodes, depth {depth}"


def feed(feeders: Sequence[str], trees: int, model_bytes: int) -> list[Feed]:
    """Each tree's feed: the trees' copies laid end to end and cut into one equal run per feeder.

    Every feeder then sends ``trees / len(feeders)`` of a model (no feeder idles while another
    sends twice its share, which disjoint groups of unequal size did), and consecutive feeders
    (one node's, in topology order) feed the same trees, so a trainer node serves as few rollout
    nodes as it can. Cuts fall on exact multiples of the model where they can, so no tree gets a
    one-byte sliver from rounding.
    """
    count = len(feeders)
    out: list[Feed] = [[] for _ in range(trees)]
    for f, feeder in enumerate(feeders):
        lo, hi = f * trees * model_bytes // count, (f + 1) * trees * model_bytes // count
        while lo < hi:
            tree = lo // model_bytes
            end = min(hi, (tree + 1) * model_bytes)
            out[tree].append((feeder, lo - tree * model_bytes, end - tree * model_bytes))
            lo = end
    return out


def blocks(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``items`` cut into ``parts`` contiguous blocks whose sizes differ by at most one."""
    q, r = divmod(len(items), parts)
    out, cur = [], 0
    for i in range(parts):
        size = q + (1 if i < r else 0)
        out.append(list(items[cur : cur + size]))
        cur += size
    return out
