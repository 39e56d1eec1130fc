"""Topology-aware weight-transfer planning on paper (`plan_transfer`).

Our plan, in three parts:

1. **Many senders.** A copy is one full model landing on a node: one per relay-tree head and one
   per mixed (trainer + rollout) node. A mixed node's copy is split by its own trainers into
   equal byte ranges. The trees' copies are laid end to end and cut into one equal run per
   feeder (trainers of trainer-only nodes, and the idle NIC-owning devices there, which a
   trainer hands their ranges over NVLink, as NCCL reaches an idle NIC): every feeder sends the
   same bytes, and one node's feeders feed the same trees, so a trainer node serves as few
   rollout nodes as it can (no rank-0 funnel, no feeder sending twice another's share). When
   every trainer shares its node with rollout workers, the trees are fed through all of those
   nodes' NICs: the rollout workers there forward what they received over NVLink.
2. **Relay trees across rollout-only nodes.** They form ``C`` trees of fan-out ``k`` (chains when
   ``k == 1``). A node's bytes are split over its NICs (rails) in proportion to bandwidth; each
   rail lands its range on the NIC's device and forwards it, bucket by bucket, to the matching rail
   of each child, so a node's ingress carries the model once. ``C`` and ``k`` come from the
   pipeline formula (bandwidth term + tree depth * bucket time), evaluated for every candidate.
3. **One intra-node fan-out per node.** Each landed range is read by every other rollout device of
   the node over its best intra-node path, so every rollout device receives each byte exactly once.

The plan is priced with a `CostModel` (`_cost.build_plan`): link rates from the topology, times the
protocol efficiency, per-bucket overheads, and a device copy for a colocated handoff.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from rlfleet.placement._errors import PlacementError
from rlfleet.placement._public import public
from rlfleet.placement.cost._model import CostModel
from rlfleet.placement.paper._cost import DEFAULT_PAPER_COST, RawStep, build_plan
from rlfleet.placement.paper._parts import Feed, View, blocks, check_bytes, choose_trees, feed, snap, split
from rlfleet.placement.paper._plan import TransferPlan
from rlfleet.placement.place._placement import Placement
from rlfleet.placement.place._seed import SEED_BUFFER_STRATEGIES
from rlfleet.placement.topology._topology import Topology

__all__ = ["DEFAULT_BUCKET_BYTES", "RELAY_MODES", "plan_transfer"]

DEFAULT_BUCKET_BYTES = 64 * 2**20
RELAY_MODES: tuple[str, ...] = ("auto", "chain", "direct")

Held = tuple[str, int, int, "int | None"]  # (device, lo, hi, step that brought it)


class _Planner:
    """Raw steps of one plan, and what each rollout device of a mixed node received."""

    def __init__(self, view: View, model_bytes: int) -> None:
        self.view = view
        self.model_bytes = model_bytes
        self.raw: list[RawStep] = []
        self.landed_at: dict[str, list[tuple[int, int, int]]] = {}
        self.rail_cache: dict[tuple[str, str], list[tuple[str, int, int]]] = {}
        #: an idle device with its own NIC on a trainer-only node -> the trainer that lends it bytes
        self.lenders: dict[str, str] = {}

    def add(self, src: str, dst: str, lo: int, hi: int, after: int | None) -> int:
        self.raw.append((src, dst, lo, hi - lo, after))
        index = len(self.raw) - 1
        self.landed_at.setdefault(dst, []).append((lo, hi, index))
        return index

    def fan_out(self, node: str, holders: Sequence[Held], leads: Sequence[tuple[str, int, int]] = ()) -> None:
        """Every needy rollout device of ``node`` gets every held range once.

        Star (holder sends to all) when no device holder would send more than one model's worth
        (a host holder, the node's NIC landing, reaches each device over that device's own PCIe
        link, so it always does); else a chain through the devices, rotated per range so each
        device forwards about one model. A chain starts with the devices in ``leads`` that forward
        the range to other nodes (so their NICs start at once), then the rest.
        """
        targets = self.view.needy_by_node[node]
        held: dict[str, int] = {}
        for v, lo, hi, _a in holders:
            held[v] = held.get(v, 0) + hi - lo
        devices = self.view.order
        sends = [n * sum(1 for d in targets if d != v) for v, n in held.items() if v in devices]
        star = max(sends, default=0)
        for j, (v, lo, hi, after) in enumerate(holders):
            if star <= self.model_bytes or v not in devices:
                for d in targets:
                    if d != v:
                        self.add(v, d, lo, hi, after)
                continue
            first = [d for d, llo, lhi in leads if llo < hi and lo < lhi and d in targets]
            order = list(dict.fromkeys([*first, *targets[j % len(targets) :], *targets[: j % len(targets)]]))
            cur, prev = v, after
            for d in order:
                if d != v:
                    prev = self.add(cur, d, lo, hi, prev)
                    cur = d

    def holdings(self, device: str) -> list[tuple[int, int, int | None]]:
        """Ranges ``device`` can send: everything for a trainer, what landed for a relay."""
        if device in self.view.sources:
            return [(0, self.model_bytes, None)]
        return sorted(self.landed_at.get(device, []))

    def supply(
        self, device: str, lo: int, hi: int, rails: list[tuple[str, int, int]]
    ) -> list[tuple[int, int, int | None]]:
        """What ``device`` can send of ``[lo, hi)`` towards ``rails``: an idle NIC's device first
        takes the range over NVLink from a trainer of its node (as NCCL reaches an idle NIC), one
        piece per rail so each piece goes on as soon as it arrived."""
        lender = self.lenders.get(device)
        if lender is not None:
            cuts = [(max(lo, rlo), min(hi, rhi)) for _v, rlo, rhi in rails if max(lo, rlo) < min(hi, rhi)]
            return [(a, b, self.add(lender, device, a, b, None)) for a, b in cuts]
        held = self.holdings(device)
        return [(max(a, lo), min(b, hi), after) for a, b, after in held if max(a, lo) < min(b, hi)]

    def rails_for(self, node: str, head: str, template: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
        """``node``'s NIC endpoints with the byte range each carries: the tree head's ranges when
        the NICs match the head's, so every hop forwards each range unchanged."""
        found = self.rail_cache.get((node, head))
        if found is None:
            rails = self.view.rails(node)
            if not rails:
                raise PlacementError(f"node {node!r} holds eval workers but has no link to other nodes")
            if [bw for _, bw in rails] == [bw for _, bw in self.view.rails(head)]:
                ranges = template
            else:
                ranges = snap(split(0, self.model_bytes, [bw for _, bw in rails]), [lo for lo, _ in template])
            found = [(v, lo, hi) for (v, _), (lo, hi) in zip(rails, ranges, strict=True) if hi > lo]
            self.rail_cache[(node, head)] = found
        return found

    def land(
        self, src: str, lo: int, hi: int, rails: list[tuple[str, int, int]], after: int | None
    ) -> list[int]:
        out = []
        for v, rlo, rhi in rails:
            a, b = max(lo, rlo), min(hi, rhi)
            if a < b:
                out.append(self.add(src, v, a, b, after))
        return out

    def tree(self, members: list[str], feeds: Feed, fanout: int) -> None:
        """One relay tree over ``members`` (rollout-only nodes), fed the ranges in ``feeds``."""
        raw = self.raw
        head = members[0]
        forest = nx.DiGraph()
        forest.add_node(head)
        for j in range(1, len(members)):
            forest.add_edge(members[(j - 1) // fanout], members[j])
        # the feeders' ranges cover the model once; the head's rails split it by NIC bandwidth
        head_rails = self.view.rails(head)
        if not head_rails:
            raise PlacementError(f"node {head!r} holds eval workers but has no link to other nodes")
        template = snap(split(0, self.model_bytes, [bw for _, bw in head_rails]), [lo for _, lo, _ in feeds])
        landed: dict[str, list[int]] = {head: []}
        head_in = self.rails_for(head, head, template)
        for src, plo, phi in feeds:
            for lo, hi, after in self.supply(src, plo, phi, head_in):
                landed[head] += self.land(src, lo, hi, head_in, after)
        for layer in nx.bfs_layers(forest, head):
            for node in layer:
                for child in forest.successors(node):
                    child_rails = self.rails_for(child, head, template)
                    landed[child] = [
                        step
                        for a in landed[node]
                        for step in self.land(raw[a][1], raw[a][2], raw[a][2] + raw[a][3], child_rails, a)
                    ]
                self.fan_out(node, [(raw[a][1], raw[a][2], raw[a][2] + raw[a][3], a) for a in landed[node]])


def _feeders(view: View, mixed: list[str]) -> tuple[list[str], dict[str, str]]:
    """Devices that feed the relay trees, and the trainer each idle one borrows its bytes from.

    Trainers on trainer-only nodes, with the devices of those nodes that own a NIC and hold no
    worker (a trainer hands them ranges over NVLink, so every NIC of the node sends, as the
    seed's NCCL broadcasts do); failing those, every device of a mixed node that owns a NIC
    (rollout workers there forward what they received).
    """
    mixed_set = set(mixed)
    free = [s for s in view.sources if s.split("/", 1)[0] not in mixed_set]
    if free:
        busy = {*view.sources, *view.receivers}
        lenders: dict[str, str] = {}
        for node in dict.fromkeys(s.split("/", 1)[0] for s in free):
            trainers = [s for s in free if s.split("/", 1)[0] == node]
            idle = [v for v, _bw in view.rails(node) if v in view.order and v not in busy]
            lenders.update((v, trainers[k % len(trainers)]) for k, v in enumerate(idle))
        return sorted([*free, *lenders], key=view.order.__getitem__), lenders
    needy = {d for n in mixed for d in view.needy_by_node[n]}
    sources = set(view.sources)
    out = [v for n in mixed for v, _bw in view.rails(n) if v in sources or v in needy]
    return out or list(view.sources), {}


@public
def plan_transfer(
    topology: Topology,
    placement: Placement,
    model_bytes: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    buffer: str = "Shared",
    relay: str = "auto",
    max_fanout: int = 4,
    cost: CostModel | None = None,
) -> TransferPlan:
    """Plan one weight sync of ``model_bytes`` from the train workers to every eval worker.

    ``bucket_bytes`` is the pipelining unit (a relay forwards a bucket's bytes once they landed).
    ``buffer`` names the eval-side weight buffer ("None", "Double", "Shared"); bytes move the same
    way for all three (one landing per node, read by its local receivers) and only the staging
    differs, so it is validated, not modelled. ``relay``: "auto" (chains or trees, whichever the
    estimate favours), "chain" (fan-out 1), "direct" (every rollout-only node fed straight from
    the feeders, depth 1: the seed's constraint, and never slower than the seed's plan). ``cost``
    prices the plan (link rates always come from the topology; default: the H100 profile's
    efficiency and overheads). Deterministic: equal inputs give an equal plan.
    """
    check_bytes("model_bytes", model_bytes)
    check_bytes("bucket_bytes", bucket_bytes)
    if buffer not in SEED_BUFFER_STRATEGIES:
        raise PlacementError(f"buffer must be one of {list(SEED_BUFFER_STRATEGIES)}, got {buffer!r}")
    if relay not in RELAY_MODES:
        raise PlacementError(f"relay must be one of {list(RELAY_MODES)}, got {relay!r}")
    if not isinstance(max_fanout, int) or isinstance(max_fanout, bool) or max_fanout < 1:
        raise PlacementError(f"max_fanout must be a positive int, got {max_fanout!r}")
    view = View(topology, placement)
    planner = _Planner(view, model_bytes)
    source_set = set(view.sources)
    for r in view.receivers:  # colocated: a device copy from the trainer's weights (CUDA IPC)
        if r in source_set:
            planner.add(r, r, 0, model_bytes, None)
    src_nodes = set(view.source_nodes)
    mixed = [n for n in view.needy_by_node if n in src_nodes]
    pure = [n for n in view.needy_by_node if n not in src_nodes]
    by_node: dict[str, list[str]] = {}
    for s in view.sources:
        by_node.setdefault(s.split("/", 1)[0], []).append(s)
    trees: list[tuple[list[str], Feed]] = []
    leads: list[tuple[str, int, int]] = []  # (feeder, lo, hi): what each tree feeder forwards
    description, fanout = "", 1
    if pure:
        feeders, planner.lenders = _feeders(view, mixed)
        n_trees, fanout, description = choose_trees(
            view, pure, feeders, model_bytes, bucket_bytes, relay, max_fanout
        )
        trees = list(zip(blocks(pure, n_trees), feed(feeders, n_trees, model_bytes), strict=True))
        leads = [lead for _members, feeds in trees for lead in feeds]
    for node in mixed:  # a mixed node's own trainers feed its rollout devices over NVLink/PCIe
        here = [lead for lead in leads if lead[0].split("/", 1)[0] == node]
        cuts = sorted({b for _f, lo, hi in here for b in (lo, hi)})
        held: list[Held] = []
        pieces = split(0, model_bytes, [1.0] * len(by_node[node]))
        for s, (lo, hi) in zip(by_node[node], pieces, strict=True):
            inner = [c for c in cuts if lo < c < hi]
            held += [(s, a, b, None) for a, b in zip([lo, *inner], [*inner, hi], strict=True) if b > a]
        planner.fan_out(node, held, here)
    if mixed:
        local = f"{len(mixed)} local fan-out{'s' if len(mixed) != 1 else ''}"
        description = f"{local}; {description}" if description else local
    for members, feeds in trees:
        planner.tree(members, feeds, fanout)
    return build_plan(
        topology,
        planner.raw,
        name="rlfleet",
        model_bytes=model_bytes,
        bucket_bytes=bucket_bytes,
        sources=view.sources,
        receivers=view.receivers,
        relay=description or "none",
        cost=cost or DEFAULT_PAPER_COST,
    )
