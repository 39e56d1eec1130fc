"""`PolicyGroup.calibrate`: the cost model's terms measured on the cluster the group runs on.

First the terms on their own: the Ray control round trip (a no-op call to every worker, timed by
the driver), a trainer's host copy rate and its seconds per tensor and per bucket (small
syncs through a real node buffer in its process: weightsync's `measure_copy_terms`), and the
broadcast protocol's rate between a trainer and the rollout workers of one of the plan's
broadcast groups (one probe version, discarded by the receivers). Those give the prior model;
then a few real syncs of the group (and any measured elsewhere on the cluster), each with its
`SyncReport`, are fitted with `CostModel.fit` (non-negative least squares over every measured
phase), which refines what the real syncs exercise. One calibration prices every plan on this
cluster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import ray

from rlfleet.placement import CostModel, SyncPlan, SyncReport
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.policygroup._submitter import is_remote

if TYPE_CHECKING:
    from rlfleet.policygroup._group import PolicyGroup

PROBE_BYTES = 16 << 20
ROUNDS = 5


def control_round_trip(group: PolicyGroup) -> float:
    """Median seconds of one no-op call and its answer, over every worker."""
    times = []
    for p in group.train_list + group.eval_list:
        for _ in range(ROUNDS):
            start = time.perf_counter()
            if is_remote(p):
                ray.get(p.is_alive.remote(), timeout=group.config.rpc_timeout_s)
            else:
                p.is_alive()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def broadcast_rate(group: PolicyGroup) -> float | None:
    """Bytes per second the broadcast protocol moves from a trainer to one remote receiver
    (gloo sends one copy per receiver), over the plan's first broadcast group; None without one."""
    plan = group.sync_plan
    wiring = group._sync.wiring
    groups = [g for g in wiring.groups if plan is not None and g in {(s.src, *s.dst) for s in plan.steps}]
    if plan is None or not groups:
        return None
    members = groups[0]
    gid, src_rank = wiring.groups[members]
    by_pid = group._processes.by_pid()
    remote = sum(plan.process(m).node != plan.process(members[0]).node for m in members[1:])
    seconds = []
    for r in range(3):
        version = int(time.time() * 1000) + r  # new to every receiver's discarding consumer
        refs = [
            by_pid[m].probe_broadcast.remote(gid, src_rank, PROBE_BYTES, version, group.config.sync_timeout_s)
            for m in members
        ]
        seconds.append(ray.get(refs, timeout=group.config.sync_timeout_s + 30)[0])
    return float(PROBE_BYTES * max(1, remote) / statistics.median(seconds[1:]))


def prior(group: PolicyGroup) -> CostModel:
    """The terms measured on their own (see the module docstring)."""
    base = group.config.cost_model or CostModel()
    rtt = control_round_trip(group)
    terms = group._calls.call_all(group.train_list[:1], "probe_copy_terms")[0]
    rate = broadcast_rate(group) if all(is_remote(p) for p in group.train_list + group.eval_list) else None
    changes = {
        "control_round_trip_s": rtt,
        "memcpy_bytes_per_s": terms["memcpy_bytes_per_s"],
        "load_bytes_per_s": terms["memcpy_bytes_per_s"],
        "per_tensor_s": terms["per_tensor_s"],
        "per_bucket_s": terms["per_bucket_s"],
    }
    if rate is not None:  # the protocol's rate as measured: efficiency is in it
        changes.update(inter_node_bytes_per_s=rate, intra_node_bytes_per_s=rate, protocol_efficiency=1.0)
    source = (
        f"calibrate(): control round trip {rtt * 1e3:.3g} ms, "
        f"memcpy {terms['memcpy_bytes_per_s'] / 1e9:.3g} GB/s, "
        f"{terms['per_tensor_s'] * 1e6:.3g} us/tensor, {terms['per_bucket_s'] * 1e6:.3g} us/bucket"
        + ("" if rate is None else f", broadcast {rate / 1e9:.3g} GB/s")
    )
    return base.replace(source=source, **changes)


def measure_syncs(group: PolicyGroup, syncs: int) -> list[tuple[SyncReport, SyncPlan]]:
    """`syncs` real syncs of the group and the plan each ran (the first one after wiring, which
    pays one-time costs, is left out)."""
    out = []
    for i in range(syncs + 1):
        report = group.sync_weights()
        plan = group.sync_plan
        if i and report is not None and report.ok and plan is not None:
            out.append((report, plan))
    return out


def calibrate(
    group: PolicyGroup, syncs: int = 3, extra: Sequence[tuple[SyncReport, SyncPlan]] = ()
) -> CostModel:
    """The prior model fitted to `syncs` real syncs of the group and the `extra` measured syncs
    (other plans on the same cluster; see the module docstring)."""
    if group.weight_buffer_strategy is None or group.sync_plan is None:
        raise PolicyGroupError("calibrate: wire the group first (init_placement_info, init_weight_buffer)")
    model = prior(group)
    pairs = [*(measure_syncs(group, syncs) if syncs > 0 and group.eval_list else []), *extra]
    if not pairs:
        return model
    fitted = model.fit([r for r, _ in pairs], [p for _, p in pairs])
    fit = fitted.source.split(";")[0].removeprefix("CostModel.fit: ")
    return fitted.replace(source=f"{model.source}; then CostModel.fit: {fit}")
