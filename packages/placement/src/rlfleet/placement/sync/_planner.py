"""`plan_sync` (our plan) and `seed_sync_plan` (the seed's round-robin plan), both executable.

Rules `plan_sync` follows (what policygroup executes):

* A node with a trainer and rollout workers: one node-local step written by the node's first
  trainer (by id), read by its rollout workers: through the node's shared buffer (mode "bind"
  for Shared, "copy" otherwise) or, when writer and readers are GPU processes and ``cuda_ipc``
  is on, through CUDA IPC (``cuda_ipc="force"``: every same-node reader, GPU or not, for
  executors that test the IPC step on CPU processes with a host stand-in for the device slots).
  A "cuda_ipc" step always carries every bucket from one writer: it is never split into shares.
* A node with rollout workers and no trainer: fan-out "node_buffer" (default for Shared) makes
  its first rollout worker (by id) a broadcast destination that writes the node buffer, read by
  the others after the broadcasts land; fan-out "direct" (default otherwise) makes every rollout
  worker of the node a broadcast destination.
* Senders "all": the trainers (data-parallel replicas, each holding the full weights) split the
  buckets into disjoint, contiguous shares balanced by bytes; trainer k broadcasts its share to
  every cross-node destination in one group ``(trainer_k, *destinations)``. Senders "one": the
  first trainer sends every bucket.
* Sharded rollout workers are broadcast destinations like Double and keep only their shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement._public import public
from rlfleet.placement.cost._model import CostModel
from rlfleet.placement.place._seed import (
    build_transfer_info_for_colocated,
    build_transfer_info_for_disaggregated,
)
from rlfleet.placement.sync._cost import PlanContext, lower_bound, price_steps
from rlfleet.placement.sync._plan import SYNC_STRATEGIES, NodeBuffer, SyncPlan, SyncProcess, SyncStep
from rlfleet.placement.sync._topology import cost_for_topology
from rlfleet.placement.topology._topology import Topology

__all__ = ["FANOUTS", "SENDERS", "plan_sync", "seed_sync_plan", "split_shares"]

SENDERS: tuple[str, ...] = ("all", "one")
FANOUTS: tuple[str, ...] = ("auto", "node_buffer", "direct")

FALLBACK_SOURCE = (
    "fallback: no topology and no cost model given; every node is priced with CostModel() "
    "defaults (one 1.25 GB/s NIC per node, 10 GB/s inside a node)"
)


def _check_inputs(
    processes: Sequence[SyncProcess], bucket_bytes: Sequence[int], strategy: str
) -> tuple[tuple[SyncProcess, ...], tuple[int, ...]]:
    if isinstance(bucket_bytes, int):  # weightsync's bucket_bytes is a cap; here it is every size
        raise SyncPlanError(
            f"bucket_bytes is the size of each bucket of the layout (a list, e.g. "
            f"[b.nbytes for b in layout.buckets]), got the int {bucket_bytes}: for uniform buckets "
            f"pass [{bucket_bytes}] * n"
        )
    procs = tuple(processes)
    if not procs:
        raise SyncPlanError("no processes: a plan needs trainers to send and rollout workers to receive")
    seen: set[str] = set()
    for i, p in enumerate(procs):
        if not isinstance(p, SyncProcess):
            raise SyncPlanError(f"processes[{i}] must be a SyncProcess, got {type(p).__name__}")
        if p.id in seen:
            raise SyncPlanError(f"duplicate process id {p.id!r}")
        seen.add(p.id)
    if strategy not in SYNC_STRATEGIES:
        raise SyncPlanError(f"strategy must be one of {list(SYNC_STRATEGIES)}, got {strategy!r}")
    sizes = tuple(bucket_bytes)
    if not sizes:
        raise SyncPlanError("no buckets: bucket_bytes is empty, so there is nothing to move")
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise SyncPlanError(f"bucket_bytes[{i}] must be a non-negative int, got {size!r}")
    if not any(p.role == "rollout" for p in procs):
        ids = [p.id for p in procs]
        raise SyncPlanError(f"no rollout worker among the processes {ids}: nobody to send the weights to")
    if not any(p.role == "trainer" for p in procs):
        raise SyncPlanError("rollout workers but no trainer: nobody holds the weights to send")
    if strategy != "Sharded" and any(p.shard is not None for p in procs):
        bad = next(p.id for p in procs if p.shard is not None)
        raise SyncPlanError(
            f"process {bad!r} carries a shard, but the strategy is {strategy!r}, not 'Sharded'"
        )
    return procs, sizes


def _check_tensors(bucket_tensors: Sequence[int] | None, n: int) -> tuple[int, ...] | None:
    if bucket_tensors is None:
        return None
    tensors = tuple(bucket_tensors)
    if len(tensors) != n or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tensors):
        raise SyncPlanError(
            f"bucket_tensors must hold {n} non-negative ints (one per bucket), got {tensors!r}"
        )
    return tensors


def _pricing(
    procs: Sequence[SyncProcess], topology: Topology | None, cost: CostModel | None
) -> tuple[CostModel, str]:
    if topology is not None:
        priced = cost_for_topology(cost or CostModel(), topology, [p.node for p in procs])
        return priced, f"topology: {topology.source}"
    if cost is not None:
        return cost, f"no topology: rates from the cost model ({cost.source})"
    return CostModel(), FALLBACK_SOURCE


@public
def split_shares(bucket_bytes: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """Contiguous runs of bucket indices, one per part, balanced by bytes.

    Part ``k`` ends at the bucket boundary nearest to ``(k + 1) / parts`` of the bytes (ties: the
    earlier one), leaving at least one bucket for each later part while buckets remain.
    """
    n = len(bucket_bytes)
    total = sum(bucket_bytes)
    prefix = [0]
    for size in bucket_bytes:
        prefix.append(prefix[-1] + size)
    shares: list[tuple[int, ...]] = []
    start = 0
    for k in range(parts):
        if k == parts - 1:
            end = n
        else:
            goal = total * (k + 1) / parts
            lo, hi = min(start + 1, n), max(min(start + 1, n), n - (parts - 1 - k))
            end = min(range(lo, hi + 1), key=lambda e: (abs(prefix[e] - goal), e))
        shares.append(tuple(range(start, end)))
        start = end
    return shares


def _by_node(procs: Sequence[SyncProcess]) -> dict[str, list[SyncProcess]]:
    out: dict[str, list[SyncProcess]] = {}
    for p in procs:
        out.setdefault(p.node, []).append(p)
    return out


@dataclass
class _Builder:
    """Steps and node buffers of one plan, appended in execution order."""

    sizes: tuple[int, ...]
    mode: Literal["bind", "copy"]
    cuda_ipc: bool | Literal["force"]
    steps: list[SyncStep] = field(default_factory=list)
    buffers: list[NodeBuffer] = field(default_factory=list)

    def add(
        self,
        transport: str,
        src: str,
        dst: Sequence[str],
        node: str | None,
        buckets: tuple[int, ...],
        after: tuple[int, ...] = (),
    ) -> int:
        nbytes = sum(self.sizes[b] for b in buckets)
        self.steps.append(SyncStep(len(self.steps), transport, src, tuple(dst), node, buckets, nbytes, after))
        return len(self.steps) - 1

    def fan_out(
        self, node: str, writer: SyncProcess, readers: Sequence[SyncProcess], after: tuple[int, ...]
    ) -> None:
        """The node-local fan-out from ``writer``: CUDA IPC for GPU readers of a GPU writer (when
        on), the node buffer for the rest (a buffer is listed even without readers: the writer
        lands there)."""
        every = tuple(range(len(self.sizes)))
        force = self.cuda_ipc == "force"
        ipc = [r.id for r in readers if force or (self.cuda_ipc and writer.gpu and r.gpu)]
        host = [r.id for r in readers if r.id not in ipc]
        if ipc:
            self.add("cuda_ipc", writer.id, ipc, node, every, after)
        if host:
            self.add("node_buffer", writer.id, host, node, every, after)
        if host or not ipc:
            self.buffers.append(NodeBuffer(node, writer.id, tuple(host), self.mode))


def _destinations(
    by_node: Mapping[str, list[SyncProcess]], fanout: str
) -> tuple[list[SyncProcess], dict[str, SyncProcess]]:
    """Broadcast destinations on nodes without a trainer, and each such node's buffer writer."""
    destinations: list[SyncProcess] = []
    writers: dict[str, SyncProcess] = {}
    for node, members in by_node.items():
        rollouts = sorted((p for p in members if p.role == "rollout"), key=lambda p: p.id)
        if not rollouts or any(p.role == "trainer" for p in members):
            continue
        if fanout == "node_buffer":
            writers[node] = rollouts[0]
            destinations.append(rollouts[0])
        else:
            destinations.extend(rollouts)
    return destinations, writers


@public
def plan_sync(
    processes: Sequence[SyncProcess],
    bucket_bytes: Sequence[int],
    strategy: str,
    *,
    topology: Topology | None = None,
    cost: CostModel | None = None,
    senders: Literal["all", "one"] = "all",
    fanout: Literal["auto", "node_buffer", "direct"] = "auto",
    layout_digest: str | None = None,
    cuda_ipc: bool | Literal["force"] = True,
    bucket_tensors: Sequence[int] | None = None,
) -> SyncPlan:
    """Our plan for one version (see the module docstring), priced and validated.

    ``topology`` (optional) gives the link rates (its nodes must include every process's node);
    ``cost`` the other terms. Without either the plan is priced on documented defaults and
    ``topology_source`` says so. ``bucket_tensors[i]`` is the number of tensors in bucket ``i``.
    ``cuda_ipc=False`` keeps GPU processes of a node on the node buffer; ``cuda_ipc="force"``
    makes every same-node fan-out a "cuda_ipc" step, GPU or not (a test and diagnostic mode).
    """
    procs, sizes = _check_inputs(processes, bucket_bytes, strategy)
    tensors = _check_tensors(bucket_tensors, len(sizes))
    if not (isinstance(cuda_ipc, bool) or cuda_ipc == "force"):
        raise SyncPlanError(f"cuda_ipc must be True, False or 'force', got {cuda_ipc!r}")
    if senders not in SENDERS:
        raise SyncPlanError(f"senders must be one of {list(SENDERS)}, got {senders!r}")
    if fanout not in FANOUTS:
        raise SyncPlanError(f"fanout must be one of {list(FANOUTS)}, got {fanout!r}")
    if fanout == "auto":
        fanout = "node_buffer" if strategy == "Shared" else "direct"
    priced_cost, source = _pricing(procs, topology, cost)
    by_node = _by_node(procs)
    trainers = sorted((p for p in procs if p.role == "trainer"), key=lambda p: p.id)
    build = _Builder(sizes, "bind" if strategy == "Shared" else "copy", cuda_ipc)
    destinations, writers = _destinations(by_node, fanout)
    if destinations:
        chosen = trainers if senders == "all" else trainers[:1]
        for trainer, share in zip(chosen, split_shares(sizes, len(chosen)), strict=True):
            if share:
                build.add("broadcast", trainer.id, [d.id for d in destinations], None, share)
    broadcasts = [s.index for s in build.steps]
    for node, members in by_node.items():
        node_trainers = sorted((p for p in members if p.role == "trainer"), key=lambda p: p.id)
        rollouts = sorted((p for p in members if p.role == "rollout"), key=lambda p: p.id)
        if node_trainers and rollouts:
            build.fan_out(node, node_trainers[0], rollouts, ())
        elif node in writers:
            writer = writers[node]
            after = tuple(i for i in broadcasts if writer.id in build.steps[i].dst)
            build.fan_out(node, writer, [r for r in rollouts if r.id != writer.id], after)
    return _finish(
        "rlfleet", strategy, procs, sizes, tensors, build, priced_cost, source, layout_digest, False
    )


def _finish(
    name: str,
    strategy: str,
    procs: tuple[SyncProcess, ...],
    sizes: tuple[int, ...],
    tensors: tuple[int, ...] | None,
    build: _Builder,
    cost: CostModel,
    source: str,
    layout_digest: str | None,
    colocated: bool,
) -> SyncPlan:
    modes = {b.node: b.mode for b in build.buffers}
    ctx = PlanContext({p.id: p for p in procs}, sizes, tensors, strategy, cost, modes)
    priced, end = price_steps(ctx, build.steps)
    plan = SyncPlan(
        strategy=strategy,
        processes=procs,
        bucket_bytes=sizes,
        layout_digest=layout_digest,
        steps=tuple(priced),
        node_buffers=tuple(build.buffers),
        predicted_seconds=end,
        lower_bound_seconds=lower_bound(ctx),
        cost=cost,
        topology_source=source,
        name=name,
        bucket_tensors=tensors,
        colocated=colocated,
    )
    plan.validate()
    return plan


@public
def seed_sync_plan(
    processes: Sequence[SyncProcess],
    bucket_bytes: Sequence[int],
    strategy: str,
    *,
    topology: Topology | None = None,
    cost: CostModel | None = None,
    layout_digest: str | None = None,
    bucket_tensors: Sequence[int] | None = None,
    colocated: bool = False,
) -> SyncPlan:
    """The seed's plan as an executable SyncPlan, priced with the same model as ours.

    One step per item of ``build_transfer_info_for_disaggregated`` (trainers before rollout
    workers, nodes in first-seen order, as the seed builds ``placement_info``), every step
    carrying every bucket (the seed sends the whole model per item): a cross-node item is a
    broadcast (with Shared, to the node's first rollout worker, which then fills the node buffer
    for the others); an intra-node item is a broadcast on the node, or with Shared the trainer
    filling the node buffer. "Sharded" is planned as "Double", as the seed cannot plan it.
    ``colocated=True`` pairs rollout worker ``i`` with trainer ``i``
    (``build_transfer_info_for_colocated``): one step each, CUDA IPC on GPUs, a point-to-point
    handoff otherwise.
    """
    procs, sizes = _check_inputs(processes, bucket_bytes, strategy)
    tensors = _check_tensors(bucket_tensors, len(sizes))
    priced_cost, source = _pricing(procs, topology, cost)
    trainers = [p for p in procs if p.role == "trainer"]
    rollouts = [p for p in procs if p.role == "rollout"]
    every = tuple(range(len(sizes)))
    seed_strategy = "Double" if strategy == "Sharded" else strategy
    build = _Builder(sizes, "bind" if seed_strategy == "Shared" else "copy", False)
    if colocated:
        for item in build_transfer_info_for_colocated(trainers, rollouts)["all"]:
            src, dst = item["sender"], item["receiver"]
            build.add("cuda_ipc" if src.gpu and dst.gpu else "p2p", src.id, [dst.id], src.node, every)
    else:
        info = _placement_info(procs)
        for node, items in build_transfer_info_for_disaggregated(info, seed_strategy).items():
            for item in items:
                _seed_item(build, node, item, info, seed_strategy == "Shared")
    return _finish(
        "seed", strategy, procs, sizes, tensors, build, priced_cost, source, layout_digest, colocated
    )


def _placement_info(procs: Sequence[SyncProcess]) -> dict[str, dict[str, list[SyncProcess]]]:
    info: dict[str, dict[str, list[SyncProcess]]] = {}
    for role, key in (("trainer", "train_policies"), ("rollout", "eval_policies")):
        for p in procs:
            if p.role == role:
                info.setdefault(p.node, {"train_policies": [], "eval_policies": []})[key].append(p)
    return info


def _seed_item(
    build: _Builder,
    node: str,
    item: Mapping[str, Any],
    info: Mapping[str, Mapping[str, list[SyncProcess]]],
    shared: bool,
) -> None:
    every = tuple(range(len(build.sizes)))
    sender: SyncProcess = item["sender"]
    receivers: list[SyncProcess] = list(item["receiver"])
    if shared and item["intra_node"]:
        readers = tuple(r.id for r in info[node]["eval_policies"])
        build.add("node_buffer", sender.id, readers, node, every)
        build.buffers.append(NodeBuffer(node, sender.id, readers, "bind"))
        return
    if not receivers:
        return
    first = build.add("broadcast", sender.id, [r.id for r in receivers], None, every)
    if shared:
        head = receivers[0]
        readers = tuple(r.id for r in info[head.node]["eval_policies"] if r.id != head.id)
        if readers:
            build.add("node_buffer", head.id, readers, head.node, every, (first,))
        build.buffers.append(NodeBuffer(head.node, head.id, readers, "bind"))
