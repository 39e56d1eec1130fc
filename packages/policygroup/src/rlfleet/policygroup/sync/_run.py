"""One version through a `SyncPlan` on Ray: placement's `schedule_calls` become worker calls, each
taking the refs of the calls it waits for (Ray runs it once they are done; local objects run in
order), and placement's `sync_report` turns their timings into the `SyncReport`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import ray

from rlfleet import placement
from rlfleet.policygroup._errors import PolicyGroupError
from rlfleet.policygroup.driver._calls import Calls, Outcome, Policy
from rlfleet.policygroup.worker import STEP_CALLS


@dataclass
class Execution:
    """The calls of one version through a plan: placement's description, the policy, the ref."""

    plan: placement.SyncPlan
    version: int
    deadline_at: float
    planned: tuple[placement.PlannedCall, ...]
    calls: list[tuple[Policy, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.time)


def start(
    plan: placement.SyncPlan,
    version: int,
    deadline_at: float,
    policies: Mapping[str, Policy],
    invoke: Callable[..., Any],
    groups: Mapping[tuple[str, ...], tuple[str, int]],
    buffers: Mapping[str, str],
    ipc: Mapping[str, Any] | None = None,
) -> Execution:
    """Start every call of `version` through `plan`: `groups[(src, *dst)]` is (group id, sender's
    rank); `buffers` a node buffer's name per node; `ipc` a cuda_ipc channel's options."""
    try:
        run = Execution(plan, version, deadline_at, placement.schedule_calls(plan))
    except placement.SyncPlanError as exc:
        raise PolicyGroupError(f"sync v{version}: {exc}") from None
    channels: dict[int, Any] = {}  # cuda_ipc step -> its writer's channel
    for call in run.planned:
        policy, step, v, at = policies[call.pid], call.steps[0], version, deadline_at
        after = [r for i in call.waits if isinstance(r := run.calls[i][1], ray.ObjectRef)]
        parts = [_part(groups, p) for p in call.parts]
        if call.kind == "ipc_send":
            channels[step] = invoke(policy, "sync_ipc_channel", list(call.readers), **(ipc or {}))
            if not isinstance(channels[step], ray.ObjectRef):
                raise PolicyGroupError(f"sync v{v}: step {step} (cuda_ipc) needs Ray actors")
        if call.kind in ("publish", "stage") and call.node not in buffers:
            raise PolicyGroupError(f"sync v{v}: no node buffer on node {call.node!r} (step {step})")
        args = step_args(call, v, at, parts, buffers, channels.get(step))
        run.calls.append((policy, invoke(policy, STEP_CALLS[call.kind].__name__, *args, *after)))
    return run


def step_args(
    call: placement.PlannedCall,
    version: int,
    deadline_at: float,
    parts: list[dict[str, Any]],
    buffers: Mapping[str, str],
    channel: Any,
) -> tuple[Any, ...]:
    """The arguments of `call`'s worker method (`STEP_CALLS[call.kind]`), before the refs it
    waits for: the contract a test checks against each method's signature."""
    v, at = version, deadline_at
    if call.kind == "send":
        return (parts[0]["group"], v, parts[0]["buckets"], at)
    if call.kind == "receive":
        return (parts, v, at)
    if call.kind == "stage":
        return (buffers[call.node or ""], v, at)
    if call.kind == "ipc_send":
        return (channel, v, at)
    if call.kind == "ipc_receive":
        return (channel, call.reader, v, at)
    return (v, at)  # publish


def _part(groups: Mapping[tuple[str, ...], tuple[str, int]], part: placement.GroupPart) -> dict[str, Any]:
    """A group step's part of a receive (a send takes its group id): group, sender's rank, buckets."""
    if (found := groups.get(m := part.members)) is None:
        raise PolicyGroupError(f"step {part.step}: no communication group for {m}; call init_comm_group()")
    buckets = None if part.buckets is None else list(part.buckets)
    return {"group": found[0], "src_rank": found[1], "sender": part.sender, "buckets": buckets}


def outcomes(run: Execution, calls: Calls, what: str) -> list[tuple[Policy, Outcome]]:
    """Wait for every call until the sync's deadline (plus a margin for the answers to come back)."""
    results = calls.gather(run.calls, max(0.0, run.deadline_at - time.time()) + 5.0, what)
    return [(p, r) for (p, _), r in zip(run.calls, results, strict=True)]


def report(
    run: Execution,
    results: list[tuple[Policy, Outcome]],
    error: str | None,
    pid_of_rank: Mapping[int, str] | None = None,
) -> placement.SyncReport:
    """The measured steps (every step whose calls all succeeded) next to the plan's predictions,
    with what each sender put on the wire (`pid_of_rank`: the world's ranks by process id, to name
    the receivers a sender found lacking its base)."""
    timings = [
        _named(cast(placement.CallResult, v), pid_of_rank or {})
        if err is None and isinstance(v, Mapping)
        else None
        for _, (v, err) in results
    ]
    return placement.sync_report(
        run.plan, run.planned, timings, version=run.version, started=run.started, error=error
    )


def _named(timing: placement.CallResult, pid_of_rank: Mapping[int, str]) -> placement.CallResult:
    """A broadcast's `WireResult` names the receivers that lacked the base by world rank
    (``lacking_ranks``, all a worker knows); the report names processes (``lacking``, which a
    CUDA IPC writer gives itself: its readers are process ids)."""
    wire = timing.get("wire")
    if wire is None:
        return timing
    sent: dict[str, Any] = dict(wire)
    ranks = [int(r) for r in sent.pop("lacking_ranks", [])]
    named = [pid_of_rank.get(r, f"rank {r}") for r in ranks]
    sent["lacking"] = [str(p) for p in sent.get("lacking", [])] + named
    return {**timing, "wire": cast(placement.WireResult, sent)}
