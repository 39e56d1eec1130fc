"""Pricing paper plans (ours and the seed's) with a `CostModel` on a topology, and the lower bound.

Model (simple enough to compare plans for clusters we cannot run):

* every step is a flow along its route; all steps of a sync run concurrently, pipelined;
* a link direction carrying ``L`` bytes at bandwidth ``B`` is busy ``L / (B * e)`` seconds (``e``:
  the cost model's protocol efficiency); flows sharing it get bandwidth in proportion to their
  bytes, so a step's rate is ``nbytes / max(L / (B * e))`` over its links;
* every bucket-sized chunk a step carries costs ``per_bucket_s``, overlapped with the wire (a
  step is double-buffered), so a chunk takes the longer of the two; a colocated handoff (a
  receiver on its trainer's device) is a device copy at ``load_bytes_per_s``, not free;
* the model moves in waves of ``bucket_bytes``: every step carries its share of each wave
  (``bucket_bytes * nbytes / model_bytes``; the seed's whole-model broadcasts carry whole buckets)
  and forwards a wave once it landed at its source, so the first wave lands one wave-time (plus
  route latency) after it landed at the source, and the last byte no sooner than one wave-time
  after the last byte landed there. Through a relay chain this gives
  ``total / bw_bottleneck + (depth - 1) * bucket / bw + latencies``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rlfleet.placement._public import public
from rlfleet.placement.cost._model import CostModel
from rlfleet.placement.cost._profiles import HARDWARE_PROFILES
from rlfleet.placement.paper._plan import LinkLoad, TransferPlan, TransferStep
from rlfleet.placement.topology._topology import Topology

__all__ = ["DEFAULT_PAPER_COST", "RawStep", "build_plan", "lower_bound_seconds"]

#: What prices a paper plan when no cost model is given: the H100 profile's efficiency and
#: overheads (link rates always come from the topology).
DEFAULT_PAPER_COST = HARDWARE_PROFILES["H100"]

# (src, dst, offset, nbytes, after)
RawStep = tuple[str, str, int, int, "int | None"]


def build_plan(
    topology: Topology,
    raw: Sequence[RawStep],
    *,
    name: str,
    model_bytes: int,
    bucket_bytes: int,
    sources: Sequence[str],
    receivers: Sequence[str],
    relay: str,
    cost: CostModel = DEFAULT_PAPER_COST,
) -> TransferPlan:
    """Route every raw step, load the links, and time the pipeline."""
    efficiency = cost.protocol_efficiency
    link_of = topology.link
    routes = [topology.route(src, dst) for src, dst, _o, _n, _a in raw]
    loads: dict[tuple[str, str], int] = {}
    for (_s, _d, _o, nbytes, _a), route in zip(raw, routes, strict=True):
        for link in route:
            loads[link] = loads.get(link, 0) + nbytes
    # per directed link: (seconds busy, latency, bandwidth, kind)
    info: dict[tuple[str, str], tuple[float, float, float, str]] = {}
    link_loads: list[LinkLoad] = []
    for (u, v), nbytes in loads.items():
        edge = link_of(u, v)
        info[(u, v)] = (nbytes / (edge.bandwidth * efficiency), edge.latency, edge.bandwidth, edge.kind)
        link_loads.append(LinkLoad(u, v, edge.kind, nbytes, edge.bandwidth, edge.latency))

    steps: list[TransferStep] = []
    chunks: list[int] = []  # each step's share of one bucket-sized wave of the model
    node_of = topology.node_of
    owner = {v: node_of(v) for v in {x for src, dst, *_ in raw for x in (src, dst)}}
    for index, ((src, dst, offset, nbytes, after), route) in enumerate(zip(raw, routes, strict=True)):
        if after is not None and not 0 <= after < index:
            raise ValueError(f"step {index}: 'after' must name an earlier step, got {after}")
        if route:
            duration, latency, slowest_bw, kind = 0.0, 0.0, math.inf, ""
            for link in route:
                busy, lat, bw, link_kind = info[link]
                latency += lat
                if busy > duration:
                    duration = busy
                if bw < slowest_bw:
                    slowest_bw, kind = bw, link_kind
            if owner[src] != owner[dst]:
                kind = "network"
            per_byte = duration / nbytes if nbytes else 0.0
        else:  # a colocated handoff: a device copy
            per_byte, latency, kind = 1.0 / cost.load_bytes_per_s, 0.0, "local"
        chunk = min(nbytes, max(1, bucket_bytes * nbytes // model_bytes))
        per_byte = max(per_byte, cost.per_bucket_s / chunk)  # bucket overheads overlap the wire
        if after is None:
            ready_first = ready_last = 0.0
            stage = 0
        else:
            prev = steps[after]
            delta = offset - prev.offset
            ready_first = _arrival(prev, chunks[after], delta + chunk)
            ready_last = _arrival(prev, chunks[after], delta + nbytes)
            stage = prev.stage + 1
        first = ready_first + chunk * per_byte + latency
        finish = max(ready_first + nbytes * per_byte, ready_last + chunk * per_byte) + latency
        steps.append(TransferStep(index, stage, src, dst, offset, nbytes, kind, after, route, first, finish))
        chunks.append(chunk)
    predicted = max((s.finish_seconds for s in steps), default=0.0)
    return TransferPlan(
        name=name,
        model_bytes=model_bytes,
        bucket_bytes=bucket_bytes,
        steps=tuple(steps),
        link_loads=tuple(link_loads),
        predicted_seconds=predicted,
        lower_bound_seconds=lower_bound_seconds(topology, model_bytes, sources, receivers),
        sources=tuple(sources),
        receivers=tuple(receivers),
        relay=relay,
    )


def _arrival(step: TransferStep, chunk: int, upto: int) -> float:
    """When the first ``upto`` bytes of ``step`` have landed (linear between first and last bucket)."""
    if upto <= chunk:
        return step.first_seconds
    if upto >= step.nbytes:
        return step.finish_seconds
    frac = (upto - chunk) / (step.nbytes - chunk)
    return step.first_seconds + frac * (step.finish_seconds - step.first_seconds)


@public
def lower_bound_seconds(
    topology: Topology, model_bytes: int, sources: Sequence[str], receivers: Sequence[str]
) -> float:
    """A time no plan can beat, from three cuts:

    every receiver device that is not itself a source takes in ``model_bytes`` through its own links
    (after at least one link latency); every receiving node without a source takes them in through
    its NICs (its tightest ingress); and if any such node exists, one copy must leave the source
    nodes through their NICs.
    """
    src_set = set(sources)
    src_nodes = list(dict.fromkeys(topology.node_of(s) for s in sources))  # ordered: float sums repeat
    bound = 0.0
    remote = False
    seen_nodes: set[str | None] = set()
    for r in receivers:
        if r in src_set:
            continue
        dev_in = topology.device_ingress_bandwidth(r)
        bound = max(bound, model_bytes / dev_in + topology.min_link_latency(r) if dev_in > 0 else math.inf)
        node = topology.node_of(r)
        if node in src_nodes or node in seen_nodes or node is None:
            continue
        seen_nodes.add(node)
        remote = True
        ingress = topology.ingress_bandwidth(node)
        ports = topology.ports(node)
        floor = min((p.latency for p in ports), default=0.0)
        bound = max(bound, model_bytes / ingress + floor if ingress > 0 else math.inf)
    if remote:
        egress = sum(topology.ingress_bandwidth(n) for n in src_nodes if n is not None)
        bound = max(bound, model_bytes / egress if egress > 0 else math.inf)
    return bound
