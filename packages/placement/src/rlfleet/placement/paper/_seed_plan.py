"""The seed's transfer plan (`seed_plan`), or any seed-format ``transfer_info`` (`cost_transfer_info`),
on paper and priced the way the seed runs it.

Each item is one ``dist.broadcast`` of the whole model from its sender to its receivers. NCCL runs
a broadcast as rings, one per channel, and spreads its channels over the NICs of the GPUs in the
group (reaching a NIC of the sending node over NVLink when the sender's own is busy), so a
broadcast to every GPU of a node enters it through all of that node's NICs: the model is split
into one range per channel, each range enters the node on its own rail and goes round the node's
receivers over NVLink. A two-rank group (the seed's "Shared" item: one receiver per node) has one
receiving GPU and so one rail. With "Shared", that receiver then fills the node's host-memory
buffer, which every other rollout worker of the node reads.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from rlfleet.placement._errors import PlacementError
from rlfleet.placement._public import public
from rlfleet.placement.cost._model import CostModel
from rlfleet.placement.paper._cost import DEFAULT_PAPER_COST, RawStep, build_plan
from rlfleet.placement.paper._parts import View, check_bytes, split
from rlfleet.placement.paper._plan import TransferPlan
from rlfleet.placement.paper._transfer import DEFAULT_BUCKET_BYTES
from rlfleet.placement.place._placement import Placement
from rlfleet.placement.place._seed import (
    build_transfer_info_for_colocated,
    build_transfer_info_for_disaggregated,
)
from rlfleet.placement.topology._topology import Topology

__all__ = ["cost_transfer_info", "seed_plan"]

Add = Callable[[str, str, int, int, "int | None"], int]


@public
def seed_plan(
    topology: Topology,
    placement: Placement,
    model_bytes: int,
    *,
    buffer: str = "Double",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    cost: CostModel | None = None,
) -> TransferPlan:
    """The seed's plan for this placement, priced like ours.

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
        topology, placement, info, model_bytes, buffer=buffer, bucket_bytes=bucket_bytes, cost=cost
    )


def _rotate(items: Sequence[str], k: int) -> list[str]:
    if not items:
        return []
    k %= len(items)
    return [*items[k:], *items[:k]]


def _broadcast(add: Add, view: View, sender: str, targets: Sequence[str], model_bytes: int) -> None:
    """One NCCL broadcast: a ring per channel, channels spread over the receiving nodes' rails."""
    src_node = sender.split("/", 1)[0]
    by_node: dict[str, list[str]] = {}
    for t in targets:
        by_node.setdefault(t.split("/", 1)[0], []).append(t)
    remote = [n for n in by_node if n != src_node]
    entries = {n: [v for v, _bw in view.rails(n) if v in by_node[n]] for n in remote}
    channels = min((len(e) for e in entries.values()), default=1) or 1
    receivers = set(view.receivers)
    out_rails = [v for v, _bw in view.rails(src_node) if v == sender or v not in receivers] or [sender]
    weights = [1.0] * channels
    for i, (lo, hi) in enumerate(split(0, model_bytes, weights)):
        if hi <= lo:
            continue
        cur, prev = sender, None
        for d in _rotate(by_node.get(src_node, []), i):
            prev, cur = add(cur, d, lo, hi, prev), d
        if remote and cur == sender and out_rails[i % len(out_rails)] != sender:
            cur_rail = out_rails[i % len(out_rails)]
            prev, cur = add(sender, cur_rail, lo, hi, prev), cur_rail  # over NVLink to an idle NIC
        for n in remote:
            entry = entries[n][i % len(entries[n])] if entries[n] else by_node[n][0]
            prev, cur = add(cur, entry, lo, hi, prev), entry
            hop_prev, hop_cur = prev, cur
            for d in _rotate([t for t in by_node[n] if t != entry], i):
                hop_prev, hop_cur = add(hop_cur, d, lo, hi, hop_prev), d


@public
def cost_transfer_info(
    topology: Topology,
    placement: Placement,
    transfer_info: Mapping[Any, Sequence[Mapping[str, Any]]],
    model_bytes: int,
    *,
    buffer: str = "Double",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    name: str = "seed",
    cost: CostModel | None = None,
) -> TransferPlan:
    """Price a seed-format ``transfer_info`` (worker ids as senders/receivers) as the seed runs it.

    Each item is one NCCL broadcast of the whole model (see the module docstring). With
    ``"Shared"``, the item's receiver (or, intra-node, the sender) fills the node's host-memory
    buffer and every other eval worker of that node loads from it.
    """
    check_bytes("model_bytes", model_bytes)
    check_bytes("bucket_bytes", bucket_bytes)
    view = View(topology, placement)
    vertex: dict[Hashable, str] = {w.worker_id: f"{w.node}/{w.device}" for w in placement.workers}
    evals_on: dict[str, list[str]] = {}
    for r in view.receivers:
        evals_on.setdefault(r.split("/", 1)[0], []).append(r)
    raw: list[RawStep] = []

    def add(src: str, dst: str, lo: int, hi: int, after: int | None) -> int:
        raw.append((src, dst, lo, hi - lo, after))
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
                staged = add(sender, host, 0, model_bytes, None)
                for d in evals_on.get(host, []):
                    add(host, d, 0, model_bytes, staged)
            elif buffer == "Shared" and len(targets) == 1 and not item.get("intra_node", True):
                first = add(sender, targets[0], 0, model_bytes, None)
                host = targets[0].split("/", 1)[0]
                staged = add(targets[0], host, 0, model_bytes, first)
                for d in evals_on.get(host, []):
                    if d != targets[0]:
                        add(host, d, 0, model_bytes, staged)
            else:
                _broadcast(add, view, sender, targets, model_bytes)
    return build_plan(
        topology,
        raw,
        name=name,
        model_bytes=model_bytes,
        bucket_bytes=bucket_bytes,
        sources=view.sources,
        receivers=view.receivers,
        relay=f"seed: {items} broadcast(s), buffer {buffer}",
        cost=cost or DEFAULT_PAPER_COST,
    )
