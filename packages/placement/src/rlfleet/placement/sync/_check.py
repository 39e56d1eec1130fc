"""`SyncPlan.validate`: every way a plan can be unexecutable, each with an error naming the culprit.

Checked, in order: the strategy and the processes (unique ids, a trainer when there are
rollouts); bucket sizes; each step (position, transport, known ids, bucket indices, byte count,
``after`` naming earlier steps, a node-local step staying on its node, a broadcast group without
its sender); senders holding what they send (a trainer holds everything; anyone else only what
the steps in its ``after`` closure delivered to it, so a read of a node buffer before the
broadcasts that fill it is caught); the trainers' shares of a destination being disjoint; every
rollout receiving every bucket exactly once; node buffers agreeing with their steps.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement.sync._plan import SYNC_STRATEGIES, TRANSPORTS

if TYPE_CHECKING:
    from rlfleet.placement.sync._plan import SyncPlan, SyncProcess, SyncStep

__all__ = ["validate_plan"]

_LOCAL = ("node_buffer", "cuda_ipc")


def validate_plan(plan: SyncPlan) -> None:
    procs = _check_processes(plan)
    _check_buckets(plan)
    for position, step in enumerate(plan.steps):
        _check_step(plan, position, step, procs)
    _check_holdings(plan, procs)
    _check_shares(plan, procs)
    _check_coverage(plan, procs)
    _check_node_buffers(plan, procs)


def _check_processes(plan: SyncPlan) -> dict[str, SyncProcess]:
    if plan.strategy not in SYNC_STRATEGIES:
        raise SyncPlanError(f"strategy must be one of {list(SYNC_STRATEGIES)}, got {plan.strategy!r}")
    procs: dict[str, SyncProcess] = {}
    for p in plan.processes:
        if p.id in procs:
            raise SyncPlanError(f"duplicate process id {p.id!r}")
        procs[p.id] = p
    if any(p.role == "rollout" for p in plan.processes) and not any(
        p.role == "trainer" for p in plan.processes
    ):
        raise SyncPlanError("the plan has rollout workers but no trainer to send weights from")
    return procs


def _check_buckets(plan: SyncPlan) -> None:
    for i, size in enumerate(plan.bucket_bytes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise SyncPlanError(f"bucket {i}: size must be a non-negative int, got {size!r}")
    tensors = plan.bucket_tensors
    if tensors is not None and len(tensors) != len(plan.bucket_bytes):
        raise SyncPlanError(f"bucket_tensors has {len(tensors)} entries for {len(plan.bucket_bytes)} buckets")


def _check_step(plan: SyncPlan, position: int, step: SyncStep, procs: dict[str, SyncProcess]) -> None:
    where = f"step {step.index}"
    if step.index != position:
        raise SyncPlanError(f"{where} sits at position {position}: a step's index must be its position")
    if step.transport not in TRANSPORTS:
        raise SyncPlanError(f"{where}: unknown transport {step.transport!r} (known: {list(TRANSPORTS)})")
    for pid in (step.src, *step.dst):
        if pid not in procs:
            raise SyncPlanError(f"{where}: unknown process id {pid!r}")
    if not step.dst:
        raise SyncPlanError(f"{where}: no destination")
    if step.src in step.dst or len(set(step.dst)) != len(step.dst):
        raise SyncPlanError(f"{where}: a destination is repeated or is the sender {step.src!r}")
    if step.transport == "p2p" and len(step.dst) != 1:
        raise SyncPlanError(f"{where}: a p2p step has exactly one destination, got {len(step.dst)}")
    n = len(plan.bucket_bytes)
    bad = [b for b in step.buckets if not 0 <= b < n]
    if bad:
        raise SyncPlanError(f"{where}: bucket index(es) {bad} outside 0..{n - 1}")
    if len(set(step.buckets)) != len(step.buckets):
        raise SyncPlanError(f"{where}: a bucket is listed twice")
    expected = sum(plan.bucket_bytes[b] for b in step.buckets)
    if step.nbytes != expected:
        raise SyncPlanError(f"{where}: nbytes {step.nbytes} but its buckets hold {expected}")
    for a in step.after:
        if not 0 <= a < step.index:
            raise SyncPlanError(f"{where}: after names step {a}, which is not an earlier step")
    if step.transport in _LOCAL:
        nodes = {procs[pid].node for pid in (step.src, *step.dst)}
        if step.node is None or nodes != {step.node}:
            raise SyncPlanError(
                f"{where}: a {step.transport} step stays on its node {step.node!r}, but it joins "
                f"processes on {sorted(nodes)}"
            )


def _check_holdings(plan: SyncPlan, procs: dict[str, SyncProcess]) -> None:
    """A non-trainer sender holds a bucket only if a step in its ``after`` closure delivered it."""
    closure: list[set[int]] = []
    for step in plan.steps:
        deps: set[int] = set()
        for a in step.after:
            deps |= {a} | closure[a]
        closure.append(deps)
        if procs[step.src].role == "trainer":
            continue
        held = {b for d in deps if step.src in plan.steps[d].dst for b in plan.steps[d].buckets}
        missing = sorted(set(step.buckets) - held)
        if missing:
            earlier = [
                s.index
                for s in plan.steps[: step.index]
                if step.src in s.dst and set(s.buckets) & set(missing)
            ]
            hint = (
                f"; it gets them in step(s) {earlier}, which 'after' must list (a read before the node "
                "buffer is filled)"
                if earlier
                else ""
            )
            raise SyncPlanError(
                f"step {step.index}: sender {step.src!r} does not hold bucket(s) {missing[:8]} it sends{hint}"
            )


def _check_shares(plan: SyncPlan, procs: dict[str, SyncProcess]) -> None:
    """Trainers sending to the same destination send disjoint shares."""
    sent: dict[str, dict[int, str]] = {}
    for step in plan.steps:
        if procs[step.src].role != "trainer":
            continue
        for d in step.dst:
            owners = sent.setdefault(d, {})
            for b in step.buckets:
                if b in owners and owners[b] != step.src:
                    raise SyncPlanError(
                        f"shares not disjoint: trainers {owners[b]!r} and {step.src!r} both send bucket {b} "
                        f"to {d!r}"
                    )
                owners[b] = step.src


def _check_coverage(plan: SyncPlan, procs: dict[str, SyncProcess]) -> None:
    """Every rollout gets every bucket exactly once."""
    need = set(range(len(plan.bucket_bytes)))
    got = plan.receives()
    for p in plan.processes:
        if p.role != "rollout":
            continue
        counts = Counter(got.get(p.id, []))
        twice = sorted(b for b, c in counts.items() if c > 1)
        if twice:
            raise SyncPlanError(f"rollout {p.id!r} gets bucket(s) {twice[:8]} more than once")
        missing = sorted(need - set(counts))
        if missing:
            raise SyncPlanError(
                f"rollout {p.id!r} misses bucket(s) {missing[:8]}"
                + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
            )
    trainers_fed = sorted(p for p in got if procs[p].role == "trainer")
    if trainers_fed:
        raise SyncPlanError(f"trainer(s) {trainers_fed} are destinations: trainers only send")


def _check_node_buffers(plan: SyncPlan, procs: dict[str, SyncProcess]) -> None:
    seen: set[str] = set()
    for buf in plan.node_buffers:
        where = f"node buffer of {buf.node!r}"
        if buf.node in seen:
            raise SyncPlanError(f"{where} is listed twice")
        seen.add(buf.node)
        for pid in (buf.writer, *buf.readers):
            if pid not in procs:
                raise SyncPlanError(f"{where}: unknown process id {pid!r}")
            if procs[pid].node != buf.node:
                raise SyncPlanError(f"{where}: process {pid!r} runs on {procs[pid].node!r}")
        steps = [s for s in plan.steps if s.transport == "node_buffer" and s.node == buf.node]
        readers = {d for s in steps for d in s.dst}
        if any(s.src != buf.writer for s in steps) or readers != set(buf.readers):
            raise SyncPlanError(
                f"{where}: writer {buf.writer!r} / readers {sorted(buf.readers)} do not match its steps "
                f"(writers {sorted({s.src for s in steps})}, readers {sorted(readers)})"
            )
    orphan = sorted({s.node for s in plan.steps if s.transport == "node_buffer"} - seen, key=str)
    if orphan:
        raise SyncPlanError(f"node_buffer step(s) on node(s) {orphan} without a NodeBuffer entry")
