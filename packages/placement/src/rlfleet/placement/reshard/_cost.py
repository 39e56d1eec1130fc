"""Pricing a `ReshardPlan` on a cluster of identical GPU nodes, and its lower bound.

Ranks sit node-major, ``gpus_per_node`` to a node: training rank ``r`` on GPU ``r % n`` of node
``r // n``; generation rank ``g`` on the same GPU as training rank ``g`` when ``colocated``, else on
the nodes after the training ones. Every move goes point to point to each of its destinations:
on the same GPU a device copy, on the same node over NVLink, otherwise out of the sender's NIC
(one per GPU) and into the receiver's, through both nodes' NICs. Each resource is busy for its
bytes over its rate (line rate times the protocol efficiency), at least ``per_bucket_s`` per
message it carries (overlapped, as in a double-buffered transfer); the plan takes the busiest
resource's time plus the first bucket's trip through two hops.

The bound is physical: each node takes in the bytes its generation ranks need (distinct shards
once) less everything the node's training ranks hold, through its NICs at line rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlfleet.placement._errors import ReshardError
from rlfleet.placement._public import public
from rlfleet.placement.cost._model import CostModel
from rlfleet.placement.reshard._plan import ReshardPlan
from rlfleet.placement.reshard._specs import DTYPE_SIZES

__all__ = ["ReshardCost", "price_reshard", "reshard_lower_bound"]


@public
@dataclass(frozen=True)
class ReshardCost:
    """A reshard plan's predicted time, lower bound, and the resource that sets the time."""

    predicted_seconds: float
    lower_bound_seconds: float
    busiest: str


def _placer(plan: ReshardPlan, gpus_per_node: int, colocated: bool) -> tuple[int, int]:
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ReshardError(f"gpus_per_node must be a positive int, got {gpus_per_node!r}")
    if colocated and plan.gen.world_size > plan.train.world_size:
        raise ReshardError(
            f"colocated: {plan.gen.world_size} generation ranks do not fit on {plan.train.world_size} GPUs"
        )
    offset = 0 if colocated else math.ceil(plan.train.world_size / gpus_per_node) * gpus_per_node
    return offset, gpus_per_node


@public
def price_reshard(
    plan: ReshardPlan,
    cost: CostModel,
    *,
    gpus_per_node: int = 8,
    colocated: bool = False,
    bucket_bytes: int = 64 * 2**20,
) -> ReshardCost:
    """Predicted seconds of ``plan`` priced with ``cost`` (see the module docstring); a move is
    streamed in ``bucket_bytes`` pieces."""
    offset, n = _placer(plan, gpus_per_node, colocated)
    busy: dict[tuple[str, int], float] = {}
    messages: dict[tuple[str, int], int] = {}
    nic = cost.inter_node_bytes_per_s * cost.protocol_efficiency
    rates = {
        "copy": cost.load_bytes_per_s,
        "nvlink_out": cost.intra_node_bytes_per_s * cost.protocol_efficiency,
        "nvlink_in": cost.intra_node_bytes_per_s * cost.protocol_efficiency,
        "nic_out": nic,
        "nic_in": nic,
        "node_out": nic * cost.nics_per_node,
        "node_in": nic * cost.nics_per_node,
    }

    def load(kind: str, where: int, nbytes: int) -> None:
        busy[(kind, where)] = busy.get((kind, where), 0.0) + nbytes
        messages[(kind, where)] = messages.get((kind, where), 0) + 1

    for m in plan.moves:
        src = m.src
        for g in m.dsts:
            dst = offset + g
            if src == dst:
                load("copy", src, m.nbytes)
            elif src // n == dst // n:
                load("nvlink_out", src, m.nbytes)
                load("nvlink_in", dst, m.nbytes)
            else:
                hops = (("nic_out", src), ("nic_in", dst), ("node_out", src // n), ("node_in", dst // n))
                for kind, where in hops:
                    load(kind, where, m.nbytes)
    worst, seconds = "nothing", 0.0
    for key, nbytes in busy.items():
        t = max(nbytes / rates[key[0]], messages[key] * cost.per_bucket_s)
        if t > seconds:
            worst, seconds = f"{key[0]} {key[1]}", t
    first = min(max((m.nbytes for m in plan.moves), default=0), bucket_bytes)
    seconds += 2 * cost.latency_s + first / nic  # the first bucket's trip before the pipe is full
    return ReshardCost(seconds, reshard_lower_bound(plan, cost, gpus_per_node=n, colocated=colocated), worst)


@public
def reshard_lower_bound(
    plan: ReshardPlan, cost: CostModel, *, gpus_per_node: int = 8, colocated: bool = False
) -> float:
    """Physical bound: per node, needed bytes (distinct shards once) less all it holds, over its NICs."""
    offset, n = _placer(plan, gpus_per_node, colocated)
    need: dict[int, dict[tuple[int, int], int]] = {}
    for g in range(plan.gen.world_size):
        tp, pp, _dp = plan.gen.coords(g)
        need.setdefault((offset + g) // n, {})[(tp, pp)] = plan.own_shard_bytes(g)
    held: dict[int, int] = {}
    for r in range(plan.train.world_size):
        local = plan.local_params("train", r)
        size = sum(math.prod(shape) * DTYPE_SIZES[dtype] for _name, shape, dtype in local)
        held[r // n] = held.get(r // n, 0) + size
    ingress = cost.inter_node_bytes_per_s * cost.nics_per_node
    bound = 0.0
    for node, shards in need.items():
        missing = max(0, sum(shards.values()) - held.get(node, 0))
        if missing:
            bound = max(bound, missing / ingress + cost.latency_s)
    return bound
