"""`PolicyGroup.calibrate`: the cost model's terms measured on the cluster the group runs on: a
prior from the terms measured on their own (`CostModel.with_measured_terms`: the Ray control round
trip, a trainer's host copy terms, the broadcast protocol's rate over one of the plan's groups),
fitted to a few real syncs of the group and any measured elsewhere here (`fit_cost_model`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import ray

from rlfleet.placement import CostModel, SyncPlan, SyncReport, fit_cost_model
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.policygroup.driver._submitter import is_remote

if TYPE_CHECKING:
    from rlfleet.policygroup.driver._group import PolicyGroup

PROBE_BYTES = 16 << 20
ROUNDS = 5


def control_round_trip(group: PolicyGroup) -> float:
    """Median seconds of one no-op call and its answer, over every worker."""
    times = []
    for p in group.train_list + group.eval_list:
        for _ in range(ROUNDS):
            start = time.perf_counter()
            ray.get(p.is_alive.remote(), timeout=group.config.rpc_timeout_s) if is_remote(p) else p.is_alive()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def broadcast_rate(group: PolicyGroup) -> float | None:
    """Bytes per second the broadcast protocol moves from a trainer to one remote receiver
    (gloo sends one copy per receiver), over the plan's first broadcast group; None without one."""
    plan, groups = group.sync_plan, group._sync.wiring.groups
    steps = set() if plan is None else {(s.src, *s.dst) for s in plan.steps}
    members = next((g for g in groups if g in steps), None)
    if plan is None or members is None:
        return None
    gid, src_rank = groups[members]
    by_pid, timeout = group._processes.by_pid(), group.config.sync_timeout_s
    remote = sum(plan.process(m).node != plan.process(members[0]).node for m in members[1:])
    seconds = []
    for r in range(3):
        version = int(time.time() * 1000) + r  # new to every receiver's discarding consumer
        args = (gid, src_rank, PROBE_BYTES, version, timeout)
        refs = [by_pid[m].probe_broadcast.remote(*args) for m in members]
        seconds.append(ray.get(refs, timeout=timeout + 30)[0])
    return float(PROBE_BYTES * max(1, remote) / statistics.median(seconds[1:]))


def calibrate(
    group: PolicyGroup, syncs: int = 3, extra: Sequence[tuple[SyncReport, SyncPlan]] = ()
) -> CostModel:
    """The terms measured on their own, fitted to `syncs` real syncs of the group (the first, which
    pays one-time costs, left out) and the `extra` measured syncs (other plans on this cluster)."""
    if group.weight_buffer_strategy is None or group.sync_plan is None:
        raise PolicyGroupError("calibrate: wire the group first (init_placement_info, init_weight_buffer)")
    rtt = control_round_trip(group)
    terms = group._calls.call_all(group.train_list[:1], "probe_copy_terms")[0]  # weightsync's names
    rate = broadcast_rate(group) if all(is_remote(p) for p in group.train_list + group.eval_list) else None
    model = (group.config.cost_model or CostModel()).with_measured_terms(
        control_round_trip_s=rtt, broadcast_bytes_per_s=rate, **terms
    )
    pairs: list[tuple[SyncReport, SyncPlan]] = []
    for i in range(syncs + 1 if syncs > 0 and group.eval_list else 0):
        report, plan = group.sync_weights(), group.sync_plan
        if i and report is not None and report.ok and plan is not None:
            pairs.append((report, plan))
    pairs += extra
    if not pairs:
        return model
    # the probe measured the host copy rate directly: one more equation of the fit, not discarded
    anchors = {"memcpy_s_per_byte": 1.0 / terms["memcpy_bytes_per_s"]}
    return fit_cost_model([r for r, _ in pairs], [p for _, p in pairs], model, anchors=anchors)
