"""Topology-aware weight-transfer planning, and the seed's plan costed the same way.

Our plan (``plan_transfer``), in three parts:

1. **Many senders.** A copy is one full model landing on a node: one per relay-tree head and one
   per mixed (train+eval) node. Each copy is fed by a group of train devices that split it into
   disjoint, equal byte ranges (within one byte), so there is no rank-0 funnel: a mixed node by its
   own train devices, the trees by the train devices of train-only nodes, cut into equal groups.
2. **Relay trees across eval nodes.** Nodes holding only eval workers form ``C`` trees of fan-out
   ``k`` (chains when ``k == 1``). A node's bytes are split over its NICs (rails) in proportion to
   bandwidth; each rail lands its range on the NIC's device and forwards it, bucket by bucket, to the
   matching rail of each child, so a node's ingress carries the model once. ``C`` and ``k`` come from
   the pipeline formula (bandwidth term + tree depth * bucket time), evaluated for every candidate.
3. **One intra-node fan-out per node.** Each landed range is read by every other eval device of the
   node over its best intra-node path (NVLink through CUDA IPC; PCIe from a host-side shared buffer
   when the NIC hangs off the host), so every eval device receives each byte exactly once.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from rlfleet.placement._cost import RawStep, build_plan
from rlfleet.placement._errors import PlacementError
from rlfleet.placement._placement import Placement
from rlfleet.placement._plan import TransferPlan
from rlfleet.placement._seed import (
    WEIGHT_BUFFER_STRATEGIES,
    build_transfer_info_for_colocated,
    build_transfer_info_for_disaggregated,
)
from rlfleet.placement._topology import Topology

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "RELAY_MODES",
    "cost_transfer_info",
    "plan_transfer",
    "seed_plan",
]

DEFAULT_BUCKET_BYTES = 64 * 2**20
RELAY_MODES: tuple[str, ...] = ("auto", "chain", "direct")


def _check_bytes(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlacementError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass
class _View:
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


def _split(lo: int, hi: int, weights: Sequence[float]) -> list[tuple[int, int]]:
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


def _levels(members: int, fanout: int) -> int:
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


def _snap(ranges: list[tuple[int, int]], points: Sequence[int]) -> list[tuple[int, int]]:
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


def _choose_trees(
    view: _View,
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
    max_trees = min(n_eval, len(feeders))
    if relay == "direct":
        candidates = [(max_trees, 1)]
    else:
        fanouts = range(1, max_fanout + 1) if relay == "auto" else (1,)
        candidates = [(c, k) for c in range(1, max_trees + 1) for k in fanouts]
    best: tuple[float, int, int] | None = None
    for trees, k in candidates:
        depth = _levels(math.ceil(n_eval / trees), k)
        bw_term = max(model_bytes * trees / source_bw, model_bytes / ingress)
        if depth > 1:
            bw_term = max(bw_term, min(k, math.ceil(n_eval / trees) - 1) * model_bytes / ingress)
        estimate = bw_term + (depth - 1) * k * min(bucket_bytes, model_bytes) / ingress + depth * latency
        if best is None or estimate < best[0]:
            best = (estimate, trees, k)
    assert best is not None
    _, trees, k = best
    depth = _levels(math.ceil(n_eval / trees), k)
    shape = "chain" if k == 1 else f"{k}-ary tree"
    return trees, k, f"{trees} {shape}{'s' if trees > 1 else ''} over {n_eval} eval nodes, depth {depth}"


def _blocks(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``items`` cut into ``parts`` contiguous blocks whose sizes differ by at most one."""
    q, r = divmod(len(items), parts)
    out, cur = [], 0
    for i in range(parts):
        size = q + (1 if i < r else 0)
        out.append(list(items[cur : cur + size]))
        cur += size
    return out


def plan_transfer(
    topology: Topology,
    placement: Placement,
    model_bytes: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    buffer: str = "Shared",
    relay: str = "auto",
    max_fanout: int = 4,
) -> TransferPlan:
    """Plan one weight sync of ``model_bytes`` from the train workers to every eval worker.

    ``bucket_bytes`` is the pipelining unit (a relay forwards a bucket's bytes once they landed).
    ``buffer`` names the eval-side weight buffer ("None", "Double", "Shared"); bytes move the same
    way for all three (one landing per node, read by its local receivers) and only the staging
    differs, so it is validated, not modelled. ``relay``: "auto" (chains or trees, whichever the
    estimate favours), "chain" (fan-out 1), "direct" (as many trees as feeders allow, depth 1 when
    possible). Deterministic: equal inputs give an equal plan.
    """
    _check_bytes("model_bytes", model_bytes)
    _check_bytes("bucket_bytes", bucket_bytes)
    if buffer not in WEIGHT_BUFFER_STRATEGIES:
        raise PlacementError(f"buffer must be one of {list(WEIGHT_BUFFER_STRATEGIES)}, got {buffer!r}")
    if relay not in RELAY_MODES:
        raise PlacementError(f"relay must be one of {list(RELAY_MODES)}, got {relay!r}")
    if not isinstance(max_fanout, int) or isinstance(max_fanout, bool) or max_fanout < 1:
        raise PlacementError(f"max_fanout must be a positive int, got {max_fanout!r}")
    view = _View(topology, placement)
    raw: list[RawStep] = []

    def add(src: str, dst: str, lo: int, hi: int, after: int | None) -> int:
        raw.append((src, dst, lo, hi - lo, after))
        return len(raw) - 1

    source_set = set(view.sources)
    for r in view.receivers:  # colocated eval workers already hold the weights (CUDA IPC, no copy)
        if r in source_set:
            add(r, r, 0, model_bytes, None)

    src_nodes = set(view.source_nodes)
    mixed = [n for n in view.needy_by_node if n in src_nodes]
    pure = [n for n in view.needy_by_node if n not in src_nodes]
    by_node: dict[str, list[str]] = {}
    for s in view.sources:
        by_node.setdefault(s.split("/", 1)[0], []).append(s)

    def fan_out(node: str, holders: list[tuple[str, int, int, int | None]]) -> None:
        """Every needy eval device of ``node`` gets every held range once.

        Star (holder sends to all) when no holder would send more than one model's worth; else a
        chain through the devices, rotated per range so each device forwards about one model.
        """
        targets = view.needy_by_node[node]
        held: dict[str, int] = {}
        for v, lo, hi, _a in holders:
            held[v] = held.get(v, 0) + hi - lo
        star = max((n * sum(1 for d in targets if d != v) for v, n in held.items()), default=0)
        for j, (v, lo, hi, after) in enumerate(holders):
            if star <= model_bytes:
                for d in targets:
                    if d != v:
                        add(v, d, lo, hi, after)
            else:
                order = targets[j % len(targets) :] + targets[: j % len(targets)]
                cur, prev = v, after
                for d in order:
                    if d != v:
                        prev = add(cur, d, lo, hi, prev)
                        cur = d

    # Local copies: a mixed node's own train devices feed its eval devices over NVLink/PCIe.
    for node in mixed:
        pieces = _split(0, model_bytes, [1.0] * len(by_node[node]))
        local: list[tuple[str, int, int, int | None]] = [
            (s, lo, hi, None) for s, (lo, hi) in zip(by_node[node], pieces, strict=True) if hi > lo
        ]
        fan_out(node, local)
    description = f"{len(mixed)} local fan-out{'s' if len(mixed) != 1 else ''}" if mixed else ""

    if pure:
        mixed_set = set(mixed)
        free = [s for s in view.sources if s.split("/", 1)[0] not in mixed_set]
        feeders = free or list(view.sources)
        n_trees, fanout, tree_desc = _choose_trees(
            view, pure, feeders, model_bytes, bucket_bytes, relay, max_fanout
        )
        description = f"{description}; {tree_desc}" if description else tree_desc
        rail_cache: dict[tuple[str, str], list[tuple[str, int, int]]] = {}

        def rails_for(node: str, head: str, template: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
            """``node``'s NIC endpoints with the byte range each carries: the tree head's ranges when
            the NICs match the head's, so every hop forwards each range unchanged."""
            found = rail_cache.get((node, head))
            if found is None:
                rails = view.rails(node)
                if not rails:
                    raise PlacementError(f"node {node!r} holds eval workers but has no link to other nodes")
                if [bw for _, bw in rails] == [bw for _, bw in view.rails(head)]:
                    ranges = template
                else:
                    ranges = _snap(
                        _split(0, model_bytes, [bw for _, bw in rails]), [lo for lo, _ in template]
                    )
                found = [(v, lo, hi) for (v, _), (lo, hi) in zip(rails, ranges, strict=True) if hi > lo]
                rail_cache[(node, head)] = found
            return found

        def land(
            src: str, lo: int, hi: int, rails: list[tuple[str, int, int]], after: int | None
        ) -> list[int]:
            out = []
            for v, rlo, rhi in rails:
                a, b = max(lo, rlo), min(hi, rhi)
                if a < b:
                    out.append(add(src, v, a, b, after))
            return out

        forest = nx.DiGraph()
        for members, group in zip(_blocks(pure, n_trees), _blocks(feeders, n_trees), strict=True):
            head = members[0]
            forest.add_node(head)
            for j in range(1, len(members)):
                forest.add_edge(members[(j - 1) // fanout], members[j])
            # the group's sources split the model evenly; the head's rails split it by NIC bandwidth
            pieces = _split(0, model_bytes, [1.0] * len(group))
            head_rails = view.rails(head)
            if not head_rails:
                raise PlacementError(f"node {head!r} holds eval workers but has no link to other nodes")
            template = _snap(_split(0, model_bytes, [bw for _, bw in head_rails]), [lo for lo, _ in pieces])
            landed: dict[str, list[int]] = {head: []}
            for src, (lo, hi) in zip(group, pieces, strict=True):
                landed[head] += land(src, lo, hi, rails_for(head, head, template), None)
            for layer in nx.bfs_layers(forest, head):
                for node in layer:
                    for child in forest.successors(node):
                        child_rails = rails_for(child, head, template)
                        landed[child] = [
                            step
                            for a in landed[node]
                            for step in land(raw[a][1], raw[a][2], raw[a][2] + raw[a][3], child_rails, a)
                        ]
                    fan_out(node, [(raw[a][1], raw[a][2], raw[a][2] + raw[a][3], a) for a in landed[node]])

    return build_plan(
        topology,
        raw,
        name="rlfleet",
        model_bytes=model_bytes,
        bucket_bytes=bucket_bytes,
        sources=view.sources,
        receivers=view.receivers,
        relay=description or "none",
    )


def seed_plan(
    topology: Topology,
    placement: Placement,
    model_bytes: int,
    *,
    buffer: str = "Double",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> TransferPlan:
    """The seed's plan for this placement, costed like ours.

    Colocated placements use ``build_transfer_info_for_colocated``; others
    ``build_transfer_info_for_disaggregated(placement.placement_info(), buffer)``.
    """
    if placement.colocated:
        info: Mapping[Any, Sequence[Mapping[str, Any]]] = build_transfer_info_for_colocated(
            [w.worker_id for w in placement.train], [w.worker_id for w in placement.eval]
        )
    else:
        info = build_transfer_info_for_disaggregated(placement.placement_info(), buffer)
    return cost_transfer_info(
        topology, placement, info, model_bytes, buffer=buffer, bucket_bytes=bucket_bytes
    )


def cost_transfer_info(
    topology: Topology,
    placement: Placement,
    transfer_info: Mapping[Any, Sequence[Mapping[str, Any]]],
    model_bytes: int,
    *,
    buffer: str = "Double",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    name: str = "seed",
) -> TransferPlan:
    """Cost a seed-format ``transfer_info`` (worker ids as senders/receivers) with our link model.

    Each item is one ``dist.broadcast`` of the whole model from its sender: NCCL pipelines it as a
    chain through the receivers in order. With ``"Shared"``, the item's receiver (or, intra-node, the
    sender) fills the node's host-memory buffer and every other eval worker of that node loads from it.
    """
    _check_bytes("model_bytes", model_bytes)
    _check_bytes("bucket_bytes", bucket_bytes)
    view = _View(topology, placement)
    vertex: dict[Hashable, str] = {w.worker_id: f"{w.node}/{w.device}" for w in placement.workers}
    evals_on: dict[str, list[str]] = {}
    for r in view.receivers:
        evals_on.setdefault(r.split("/", 1)[0], []).append(r)
    raw: list[RawStep] = []

    def add(src: str, dst: str, after: int | None) -> int:
        raw.append((src, dst, 0, model_bytes, after))
        return len(raw) - 1

    def where(worker: Hashable, what: str) -> str:
        try:
            return vertex[worker]
        except (KeyError, TypeError):
            raise PlacementError(f"{what} {worker!r} is not a worker of the placement") from None

    items = 0
    for node_id, node_items in transfer_info.items():
        for i, item in enumerate(node_items):
            items += 1
            sender = where(item["sender"], f"sender of item {i} of {node_id!r}")
            receivers = item["receiver"]
            if not isinstance(receivers, (list, tuple)):
                receivers = [receivers]
            targets = [where(r, f"receiver of item {i} of {node_id!r}") for r in receivers]
            if buffer == "Shared" and item.get("intra_node") and not targets:
                host = sender.split("/", 1)[0]
                staged = add(sender, host, None)
                for d in evals_on.get(host, []):
                    add(host, d, staged)
            elif buffer == "Shared" and len(targets) == 1 and not item.get("intra_node", True):
                first = add(sender, targets[0], None)
                host = targets[0].split("/", 1)[0]
                staged = add(targets[0], host, first)
                for d in evals_on.get(host, []):
                    if d != targets[0]:
                        add(host, d, staged)
            else:
                prev: int | None = None
                cur = sender
                for t in targets:
                    prev = add(cur, t, prev)
                    cur = t
    return build_plan(
        topology,
        raw,
        name=name,
        model_bytes=model_bytes,
        bucket_bytes=bucket_bytes,
        sources=view.sources,
        receivers=view.receivers,
        relay=f"seed: {items} broadcast(s), buffer {buffer}",
    )
