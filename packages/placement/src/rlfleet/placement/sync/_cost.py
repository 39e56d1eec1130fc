"""Pricing a sync plan's steps with a `CostModel`, and its lower bound.

Every phase of a step is linear in `LINEAR_PARAMS` (`step_features` gives the coefficients), so the
same code prices a plan and calibrates a model from measured phases:

* pack (sender): a trainer handles each tensor (``per_tensor_s``); every bucket costs
  ``per_bucket_s``; the bytes are copied once: device to host into a node buffer from a GPU,
  a device copy into a bucket on a GPU, a memcpy on a CPU. A rollout worker relaying a node
  buffer it received into copies nothing more: the broadcast landed in that buffer.
* wire: the step's bytes on its busiest resource, with every step of the same wave (steps
  that start together) loading the same resources: a node's NICs in and out (NCCL on GPUs
  spreads a broadcast's channels over all of a node's NICs and enters each node once; gloo on
  CPUs sends from the root to each peer over one TCP connection, a peer on the root's own node
  through the machine's loopback), or a process's intra-node link.
  Plus one latency per hop.
* land (slowest receiver): each tensor handled again (views bound, or applied), and the bytes
  it keeps copied once (its shard for a Sharded receiver; nothing for a "bind" reader).
* control: two round trips per step (begin, commit vote).

A step takes ``pipeline_seconds([pack, wire, land], buckets) + control`` and starts when the
steps in its ``after`` ended and its sender finished its previous step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rlfleet.placement.cost._model import CostModel, pipeline_seconds
from rlfleet.placement.sync._plan import SyncPlan, SyncProcess, SyncStep

__all__ = ["CONTROL_ROUND_TRIPS", "PlanContext", "lower_bound", "price_steps", "step_features"]

CONTROL_ROUND_TRIPS = 2

Features = dict[str, dict[str, float]]


@dataclass
class PlanContext:
    """What pricing needs besides the steps."""

    procs: dict[str, SyncProcess]
    bucket_bytes: tuple[int, ...]
    bucket_tensors: tuple[int, ...] | None
    strategy: str
    cost: CostModel
    modes: Mapping[str, str] = field(default_factory=dict)  # node -> "bind" | "copy"
    #: Node -> the machine whose NICs its traffic crosses (the node itself unless shared).
    host_of: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.host_of = {p.node: p.host for p in self.procs.values()}

    @classmethod
    def of(cls, plan: SyncPlan, cost: CostModel | None = None) -> PlanContext:
        return cls(
            {p.id: p for p in plan.processes},
            plan.bucket_bytes,
            plan.bucket_tensors,
            plan.strategy,
            cost or plan.cost,
            {b.node: b.mode for b in plan.node_buffers},
        )

    def tensors(self, buckets: Sequence[int]) -> int:
        if self.bucket_tensors is None:
            return len(buckets)
        return sum(self.bucket_tensors[b] for b in buckets)

    def needed(self, pid: str, nbytes: int) -> float:
        shard = self.procs[pid].shard
        return nbytes / shard[1] if shard is not None else float(nbytes)


def _waves(steps: Sequence[SyncStep]) -> list[int]:
    """Which steps run at the same time: a step starts after the steps in its `after` and after
    its sender's previous step (a sender runs its steps one after the other, so they never
    share its links)."""
    waves: list[int] = []
    last_of: dict[str, int] = {}
    for s in steps:
        before = [waves[a] for a in s.after]
        if s.src in last_of:
            before.append(waves[last_of[s.src]])
        waves.append(1 + max(before, default=-1))
        last_of[s.src] = len(waves) - 1
    return waves


def _resources(ctx: PlanContext, step: SyncStep) -> list[tuple[tuple[str, str], float, str, int]]:
    """(resource, bytes, class, links) a step puts on the wire; class is "inter" or "intra".

    A GPU broadcast (NCCL ring) and an object-store fetch cross each node once; a CPU broadcast
    (gloo) sends one copy from the root to every peer.
    """
    procs, src = ctx.procs, ctx.procs[step.src]
    if step.transport == "node_buffer":
        return []
    nbytes = float(step.nbytes)
    if step.transport == "cuda_ipc":
        return [(("intra", d), nbytes, "intra", 1) for d in step.dst]
    if not (src.gpu or step.transport == "object_store"):
        return _tcp_resources(ctx, step)
    local = [d for d in step.dst if procs[d].node == src.node]
    remote = {procs[d].node for d in step.dst if procs[d].node != src.node}
    out = [(("intra", d), nbytes, "intra", 1) for d in local]
    if local:  # one copy leaves the sender (an NCCL ring, or one fetch from the object store)
        out.append((("intra", step.src), nbytes, "intra", 1))
    if remote:
        links = ctx.cost.nics_per_node if step.transport != "object_store" else 1
        out.append((("egress", src.host), nbytes, "inter", links))
        hosts = {node: ctx.host_of[node] for node in remote}  # nodes of one machine share its NICs
        out.extend((("ingress", hosts[node]), nbytes, "inter", links) for node in remote)
    return out


def _tcp_resources(ctx: PlanContext, step: SyncStep) -> list[tuple[tuple[str, str], float, str, int]]:
    """A CPU broadcast (gloo): the root sends one copy to every peer over TCP, a peer on its own
    node included (gloo has no shared-memory path: that copy crosses the machine's loopback, in
    the same kernel network stack, on the same cores, as the copies that leave it)."""
    nbytes, src = float(step.nbytes), ctx.procs[step.src]
    peers: dict[str, int] = {}
    for d in step.dst:
        host = ctx.host_of[ctx.procs[d].node]
        peers[host] = peers.get(host, 0) + 1
    out = [(("egress", src.host), nbytes * len(step.dst), "inter", 1)]
    out.extend((("ingress", host), nbytes * count, "inter", 1) for host, count in peers.items())
    return out


def _wire_features(ctx: PlanContext, steps: Sequence[SyncStep]) -> list[tuple[dict[str, float], int]]:
    """Per step: the wire phase's coefficients, and its hop count."""
    waves = _waves(steps)
    loads: dict[tuple[int, tuple[str, str]], float] = {}
    per_step = [_resources(ctx, s) for s in steps]
    for wave, res in zip(waves, per_step, strict=True):
        for key, nbytes, _cls, _links in res:
            loads[(wave, key)] = loads.get((wave, key), 0.0) + nbytes
    values = ctx.cost.linear_values()
    out: list[tuple[dict[str, float], int]] = []
    for wave, res in zip(waves, per_step, strict=True):
        best: dict[str, float] = {}
        best_time = -1.0
        for key, _nbytes, cls, links in res:
            param = f"{cls}_s_per_byte"
            coef = loads[(wave, key)] / links
            if coef * values[param] > best_time:
                best, best_time = {param: coef}, coef * values[param]
        hops = 0
        if res:
            hops = 2 if any(k[0] == "ingress" for k, *_ in res) else 1
        out.append((best, hops))
    return out


def _pack(ctx: PlanContext, step: SyncStep) -> dict[str, float]:
    src = ctx.procs[step.src]
    f: dict[str, float] = {"per_bucket_s": float(len(step.buckets))}
    if src.role == "trainer":
        f["per_tensor_s"] = float(ctx.tensors(step.buckets))
    elif step.transport == "node_buffer":
        return f  # the relay's broadcast already landed in the node buffer
    if step.transport == "node_buffer":
        f["d2h_s_per_byte" if src.gpu else "memcpy_s_per_byte"] = float(step.nbytes)
    elif step.transport == "object_store" or not src.gpu:
        f["memcpy_s_per_byte"] = float(step.nbytes)
    else:
        f["load_s_per_byte"] = float(step.nbytes)
    return f


def _land(ctx: PlanContext, step: SyncStep) -> dict[str, float]:
    """The slowest destination's land phase."""
    worst: dict[str, float] = {}
    worst_time = -1.0
    values = ctx.cost.linear_values()
    for d in step.dst:
        proc = ctx.procs[d]
        f: dict[str, float] = {"per_tensor_s": float(ctx.tensors(step.buckets))}
        need = ctx.needed(d, step.nbytes)
        if step.transport == "node_buffer":
            if ctx.modes.get(proc.node, "copy") == "copy":
                f["h2d_s_per_byte" if proc.gpu else "memcpy_s_per_byte"] = need
        elif step.transport == "object_store":
            f["memcpy_s_per_byte"] = need
        elif step.transport != "cuda_ipc" and ctx.strategy != "Shared":
            f["load_s_per_byte" if proc.gpu else "memcpy_s_per_byte"] = need
        t = sum(c * values[p] for p, c in f.items())
        if t > worst_time:
            worst, worst_time = f, t
    return worst


def step_features(ctx: PlanContext, steps: Sequence[SyncStep]) -> list[Features]:
    """Per step, per phase: coefficients of `LINEAR_PARAMS` (see the module docstring)."""
    wires = _wire_features(ctx, steps)
    out: list[Features] = []
    for step, (wire, hops) in zip(steps, wires, strict=True):
        wire = dict(wire)
        if hops:
            wire["latency_s"] = float(hops)
        out.append(
            {
                "pack": _pack(ctx, step),
                "wire": wire,
                "land": _land(ctx, step),
                "control": {"control_round_trip_s": float(CONTROL_ROUND_TRIPS)},
            }
        )
    return out


def _evaluate(features: Features, values: Mapping[str, float]) -> dict[str, float]:
    return {phase: sum(c * values[p] for p, c in coefs.items()) for phase, coefs in features.items()}


def price_steps(ctx: PlanContext, steps: Sequence[SyncStep]) -> tuple[list[SyncStep], float]:
    """The steps with their phases, durations and ends filled in; and the plan's end."""
    values = ctx.cost.linear_values()
    ends: list[float] = []
    sender_free: dict[str, float] = {}
    priced: list[SyncStep] = []
    for step, feats in zip(steps, step_features(ctx, steps), strict=True):
        phases = _evaluate(feats, values)
        seconds = pipeline_seconds([phases["pack"], phases["wire"], phases["land"]], len(step.buckets))
        seconds += phases["control"]
        start = max([sender_free.get(step.src, 0.0), *(ends[a] for a in step.after)])
        end = start + seconds
        ends.append(end)
        sender_free[step.src] = end
        priced.append(dataclasses.replace(step, predicted_seconds=seconds, predicted_end=end, phases=phases))
    return priced, max(ends, default=0.0)


def lower_bound(ctx: PlanContext) -> float:
    """Seconds no plan can beat: bytes each receiver needs over nominal rates, no software term.

    Cuts: every node holding rollout workers but no trainer takes in the bytes its workers need
    (a Sharded worker: its shard; distinct shards add up to at most the whole) through its NICs
    at line rate; one copy of those bytes leaves the trainers' nodes through theirs; a rollout
    worker that copies (not "bind") takes its bytes through its own intra-node link.
    """
    cost = ctx.cost
    total = float(sum(ctx.bucket_bytes))
    if total == 0:
        return 0.0
    trainer_nodes = {p.node for p in ctx.procs.values() if p.role == "trainer"}
    by_node: dict[str, list[SyncProcess]] = {}
    for p in ctx.procs.values():
        if p.role == "rollout":
            by_node.setdefault(p.node, []).append(p)
    bound, remote_need = 0.0, 0.0
    ingress: dict[str, tuple[float, bool]] = {}  # machine -> (bytes its nodes take in, all GPU)
    for node, workers in by_node.items():
        gpu = all(w.gpu for w in workers)
        shards = {w.shard for w in workers}
        need = total if None in shards else min(total, sum(total / s[1] for s in shards if s is not None))
        for w in workers:
            if ctx.strategy != "Shared" or node not in trainer_nodes:
                per_proc = ctx.needed(w.id, int(total))
                bound = max(bound, per_proc / cost.intra_node_bytes_per_s)
        if node in trainer_nodes:
            continue
        seen, all_gpu = ingress.get(ctx.host_of[node], (0.0, True))
        ingress[ctx.host_of[node]] = (seen + need, all_gpu and gpu)
        remote_need = max(remote_need, need)
    for need, gpu in ingress.values():
        nics = cost.nics_per_node if gpu else 1
        bound = max(bound, need / (nics * cost.inter_node_bytes_per_s) + cost.latency_s)
    if remote_need and trainer_nodes:
        trainer_gpu = all(p.gpu for p in ctx.procs.values() if p.role == "trainer")
        machines = {ctx.host_of[n] for n in trainer_nodes}
        egress = len(machines) * (cost.nics_per_node if trainer_gpu else 1) * cost.inter_node_bytes_per_s
        bound = max(bound, remote_need / egress)
    return bound if math.isfinite(bound) else 0.0
