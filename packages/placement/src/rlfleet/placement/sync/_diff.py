"""`SyncPlan.diff`: what an executor must change between two plans.

When a worker dies, joins, is popped or converted, the executor rebuilds only what differs:
broadcast groups to create or destroy, node buffers whose writer or readers changed, steps that
appear or disappear. Steps are compared by what they do (transport, sender, destinations, node,
buckets), not by position or prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlfleet.placement._public import public

if TYPE_CHECKING:
    from rlfleet.placement.sync._plan import NodeBuffer, SyncPlan, SyncStep

__all__ = ["SyncPlanDiff", "diff_plans", "endpoint_needs", "nodes_to_rewire"]


@public
@dataclass(frozen=True)
class SyncPlanDiff:
    """Differences from a previous plan to a new one (each tuple in the new or old plan's order):
    ``new.diff(old)``; "added" is in ``new`` and not in ``old``."""

    processes_added: tuple[str, ...]
    processes_removed: tuple[str, ...]
    roles_changed: tuple[str, ...]
    steps_added: tuple[SyncStep, ...]
    steps_removed: tuple[SyncStep, ...]
    groups_added: tuple[tuple[str, ...], ...]
    groups_removed: tuple[tuple[str, ...], ...]
    node_buffers_changed: tuple[str, ...]
    strategy_changed: bool = False
    buckets_changed: bool = False
    #: The digests of the previous and the new plan: the diff goes from ``old`` to ``new``.
    old_digest: str = ""
    new_digest: str = ""

    @property
    def empty(self) -> bool:
        """True when the new plan executes exactly like the previous one."""
        return not (
            self.processes_added
            or self.processes_removed
            or self.roles_changed
            or self.steps_added
            or self.steps_removed
            or self.groups_added
            or self.groups_removed
            or self.node_buffers_changed
            or self.strategy_changed
            or self.buckets_changed
        )

    def summary(self) -> str:
        """One line saying which way it goes, e.g. ``from 1f2e3d4c to 9a8b7c6d: -1 process (r3),
        -2 steps, +1 group, node buffers changed on n2`` (first 8 hex digits of each digest)."""
        if self.empty:
            return "no change"
        parts: list[str] = []
        for sign, items in (
            ("+", (self.processes_added, self.steps_added, self.groups_added)),
            ("-", (self.processes_removed, self.steps_removed, self.groups_removed)),
        ):
            for label, found in zip(("process", "step", "group"), items, strict=True):
                if found:
                    plural = "" if len(found) == 1 else ("es" if label == "process" else "s")
                    named = f" ({', '.join(map(str, found))})" if label == "process" else ""
                    parts.append(f"{sign}{len(found)} {label}{plural}{named}")
        if self.roles_changed:
            parts.append(f"role changed: {', '.join(self.roles_changed)}")
        if self.node_buffers_changed:
            parts.append(f"node buffers changed on {', '.join(self.node_buffers_changed)}")
        if self.strategy_changed:
            parts.append("strategy changed")
        if self.buckets_changed:
            parts.append("buckets changed")
        way = f"from {self.old_digest[:8] or 'previous'} to {self.new_digest[:8] or 'new'}: "
        return way + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "processes_added": list(self.processes_added),
            "processes_removed": list(self.processes_removed),
            "roles_changed": list(self.roles_changed),
            "steps_added": [s.to_dict() for s in self.steps_added],
            "steps_removed": [s.to_dict() for s in self.steps_removed],
            "groups_added": [list(g) for g in self.groups_added],
            "groups_removed": [list(g) for g in self.groups_removed],
            "node_buffers_changed": list(self.node_buffers_changed),
            "strategy_changed": self.strategy_changed,
            "buckets_changed": self.buckets_changed,
            "old_digest": self.old_digest,
            "new_digest": self.new_digest,
        }


@public
def endpoint_needs(plan: SyncPlan) -> dict[str, dict[str, Any]]:
    """Per rollout worker: what its receive endpoint depends on (its node, the node buffer it
    writes or reads and how, its shard, the IPC channel it reads and among which readers)."""
    needs: dict[str, dict[str, Any]] = {p.id: {"node": p.node} for p in plan.rollouts}
    for buf in plan.node_buffers:
        for pid in (*buf.readers, buf.writer):
            if pid in needs:
                needs[pid]["buffer"] = (buf.writer, len(buf.readers), buf.mode)
    for p in plan.rollouts:
        if p.shard is not None:
            needs[p.id]["shard"] = p.shard
    for step in plan.steps:
        if step.transport == "cuda_ipc":
            for pid in step.dst:
                needs[pid]["ipc"] = (step.src, step.dst)
    return needs


@public
def nodes_to_rewire(old: SyncPlan | None, new: SyncPlan) -> set[str]:
    """Nodes of `new` whose node buffer or rollout endpoints an executor must rebuild, going from
    `old` (None: nothing is wired yet) to `new`; every node when the layout or strategy changed."""
    if old is None or old.layout_digest != new.layout_digest or old.strategy != new.strategy:
        return set(new.nodes)
    nodes = set(diff_plans(old, new).node_buffers_changed)
    before = endpoint_needs(old)
    for pid, need in endpoint_needs(new).items():
        if before.get(pid) != need:
            nodes.add(need["node"])
    return nodes & set(new.nodes)


def _buffers(plan: SyncPlan) -> dict[str, NodeBuffer]:
    return {b.node: b for b in plan.node_buffers}


def diff_plans(old: SyncPlan, new: SyncPlan) -> SyncPlanDiff:
    old_procs = {p.id: p for p in old.processes}
    new_procs = {p.id: p for p in new.processes}
    old_sigs = {s.signature() for s in old.steps}
    new_sigs = {s.signature() for s in new.steps}
    old_groups, new_groups = set(old.groups()), set(new.groups())
    old_bufs, new_bufs = _buffers(old), _buffers(new)
    changed_bufs = [n for n in dict.fromkeys([*old_bufs, *new_bufs]) if old_bufs.get(n) != new_bufs.get(n)]
    return SyncPlanDiff(
        processes_added=tuple(p for p in new_procs if p not in old_procs),
        processes_removed=tuple(p for p in old_procs if p not in new_procs),
        roles_changed=tuple(
            p for p in new_procs if p in old_procs and old_procs[p].role != new_procs[p].role
        ),
        steps_added=tuple(s for s in new.steps if s.signature() not in old_sigs),
        steps_removed=tuple(s for s in old.steps if s.signature() not in new_sigs),
        groups_added=tuple(g for g in new.groups() if g not in old_groups),
        groups_removed=tuple(g for g in old.groups() if g not in new_groups),
        node_buffers_changed=tuple(changed_bufs),
        strategy_changed=old.strategy != new.strategy,
        buckets_changed=old.bucket_bytes != new.bucket_bytes or old.layout_digest != new.layout_digest,
        old_digest=old.digest,
        new_digest=new.digest,
    )
