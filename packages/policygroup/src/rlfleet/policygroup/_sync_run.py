"""One version through a `SyncPlan`: each step becomes Ray calls, and their timings a `SyncReport`.

Steps map to calls one to one, in plan order. A step starts once the steps in its ``after``
and its sender's previous step are done; the calls say so by taking those calls' results as
arguments (Ray runs a call when its arguments are ready; local objects run in plan order):

* ``node_buffer``: a trainer writer publishes (`sync_publish`), then every reader takes the
  version from the node's buffer (`sync_stage`); a rollout writer filled the buffer in its
  receive (a step of ``after``), so only the readers are called;
* ``broadcast`` (and ``p2p``, a broadcast to one): the sender sends its buckets
  (`sync_send`); a rollout worker receives all the broadcast steps addressed to it in one call
  (`sync_receive`, one part per sender), since an endpoint takes a version once;
* ``cuda_ipc``: the writer (a trainer) names its IPC channel to the step's readers
  (`sync_ipc_channel`: made at first use, kept while the readers stay), then sends the version
  through it (`sync_ipc_send`) while every reader, given the channel's name, attaches if it is
  new and receives into its endpoint (`sync_ipc_receive`): writer and readers run together,
  like a broadcast's. A cuda_ipc step carries every bucket from one writer (placement never
  splits it into shares) and needs Ray actors (the channel joins processes).

Every call gets the sync's one deadline and returns its start, end and phases; a step's
measured time runs from when it could start (the sync's start, or its dependencies' end) to
its last call's end, and what its own phases do not explain is the control plane (Ray calls).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from rlfleet.placement import GROUP_TRANSPORTS, StepReport, SyncPlan, SyncReport, SyncStep
from rlfleet.policygroup._calls import Calls, Outcome, Policy
from rlfleet.policygroup._errors import PolicyGroupError


@dataclass
class Call:
    """One Ray call (or local call) of a sync, and the steps it serves."""

    policy: Policy
    pid: str
    kind: str  # publish | send | receive | stage | ipc_send | ipc_receive
    ref: Any
    steps: tuple[int, ...]


@dataclass
class Execution:
    """The calls of one version through a plan, and how they map back to its steps."""

    plan: SyncPlan
    version: int
    deadline_at: float
    started: float = field(default_factory=time.time)
    calls: list[Call] = field(default_factory=list)
    by_step: dict[int, list[Call]] = field(default_factory=dict)
    waits: dict[int, list[Any]] = field(default_factory=dict)  # step -> refs it waits for

    def add(self, call: Call) -> Call:
        self.calls.append(call)
        for s in call.steps:
            self.by_step.setdefault(s, []).append(call)
        return call

    def deps(self, step: SyncStep, previous: Mapping[str, int]) -> list[Any]:
        """Refs of the calls this step waits for: its ``after`` steps and its sender's previous step."""
        wanted = list(step.after)
        if step.src in previous:
            wanted.append(previous[step.src])
        refs: list[Any] = []
        for s in dict.fromkeys(wanted):
            refs.extend(c.ref for c in self.by_step.get(s, []))
        return [r for r in refs if isinstance(r, ray.ObjectRef)]


def start(
    plan: SyncPlan,
    version: int,
    deadline_at: float,
    policies: Mapping[str, Policy],
    invoke: Callable[..., Any],
    groups: Mapping[tuple[str, ...], tuple[str, int]],
    buffers: Mapping[str, str],
    ipc: Mapping[str, Any] | None = None,
) -> Execution:
    """Start every call of `version` through `plan` (see the module docstring).

    `groups[(src, *dst)]` is (group id, the sender's world rank) of a broadcast step; `buffers`
    the node buffer's name per node; `ipc` what a cuda_ipc step's channel is made with (backend
    "cuda", or "host": the same protocol over host shared memory, a test mode; the group's
    bucket_bytes; checksums)."""
    run = Execution(plan, version, deadline_at)
    every = len(plan.bucket_bytes)
    previous: dict[str, int] = {}  # sender -> its last step so far
    parts: dict[str, list[SyncStep]] = {}
    for step in plan.steps:
        if step.transport in GROUP_TRANSPORTS:
            for d in step.dst:
                parts.setdefault(d, []).append(step)
    last_part = {d: steps[-1].index for d, steps in parts.items()}
    for step in plan.steps:
        deps = run.waits[step.index] = run.deps(step, previous)
        if step.transport in GROUP_TRANSPORTS:
            gid, _ = _group(groups, step)
            buckets = None if len(step.buckets) == every else list(step.buckets)
            ref = invoke(policies[step.src], "sync_send", gid, version, buckets, deadline_at, *deps)
            run.add(Call(policies[step.src], step.src, "send", ref, (step.index,)))
            for d in step.dst:
                if last_part[d] == step.index:
                    _receive(run, d, parts[d], policies, invoke, groups)
        elif step.transport == "node_buffer":
            name = buffers.get(step.node or "")
            if name is None:
                raise PolicyGroupError(
                    f"sync v{version}: no node buffer on node {step.node!r} (step {step.index})"
                )
            if plan.process(step.src).role == "trainer":
                ref = invoke(policies[step.src], "sync_publish", version, deadline_at, *deps)
                deps = [*deps, ref] if isinstance(ref, ray.ObjectRef) else deps
                run.add(Call(policies[step.src], step.src, "publish", ref, (step.index,)))
            for r in step.dst:
                ref = invoke(policies[r], "sync_stage", name, version, deadline_at, *deps)
                run.add(Call(policies[r], r, "stage", ref, (step.index,)))
        elif step.transport == "cuda_ipc":
            _ipc(run, step, deps, policies, invoke, ipc or {})
        else:
            raise PolicyGroupError(
                f"sync v{version}: step {step.index} uses transport {step.transport!r}, "
                "which policygroup does not run"
            )
        previous[step.src] = step.index
    return run


def _group(groups: Mapping[tuple[str, ...], tuple[str, int]], step: SyncStep) -> tuple[str, int]:
    try:
        return groups[(step.src, *step.dst)]
    except KeyError:
        raise PolicyGroupError(
            f"step {step.index}: no communication group for {(step.src, *step.dst)}; call init_comm_group()"
        ) from None


def _ipc(
    run: Execution,
    step: SyncStep,
    deps: list[Any],
    policies: Mapping[str, Policy],
    invoke: Callable[..., Any],
    options: Mapping[str, Any],
) -> None:
    """A cuda_ipc step: the writer's channel, its send, and every reader's receive (together)."""
    if run.plan.process(step.src).role != "trainer":
        raise PolicyGroupError(
            f"sync v{run.version}: step {step.index} relays a received version by CUDA IPC "
            f"({step.src}); policygroup sends by CUDA IPC from trainers only (relays fill a node buffer)"
        )
    writer = policies[step.src]
    channel = invoke(writer, "sync_ipc_channel", list(step.dst), **options)
    if not isinstance(channel, ray.ObjectRef):
        raise PolicyGroupError(f"sync v{run.version}: step {step.index} (cuda_ipc) needs Ray actors")
    ref = invoke(writer, "sync_ipc_send", channel, run.version, run.deadline_at, *deps)
    run.add(Call(writer, step.src, "ipc_send", ref, (step.index,)))
    for index, r in enumerate(step.dst):
        ref = invoke(policies[r], "sync_ipc_receive", channel, index, run.version, run.deadline_at, *deps)
        run.add(Call(policies[r], r, "ipc_receive", ref, (step.index,)))


def _receive(
    run: Execution,
    pid: str,
    steps: list[SyncStep],
    policies: Mapping[str, Policy],
    invoke: Callable[..., Any],
    groups: Mapping[tuple[str, ...], tuple[str, int]],
) -> None:
    every = len(run.plan.bucket_bytes)
    parts = []
    deps: list[Any] = []
    for step in steps:
        gid, src_rank = _group(groups, step)
        buckets = None if len(step.buckets) == every else list(step.buckets)
        parts.append({"group": gid, "src_rank": src_rank, "sender": step.src, "buckets": buckets})
        deps.extend(run.waits[step.index])
    ref = invoke(policies[pid], "sync_receive", parts, run.version, run.deadline_at, *dict.fromkeys(deps))
    run.add(Call(policies[pid], pid, "receive", ref, tuple(s.index for s in steps)))


def outcomes(run: Execution, calls: Calls, what: str) -> list[tuple[Policy, Outcome]]:
    """Wait for every call until the sync's deadline (plus a margin for the answers to come back)."""
    timeout = max(0.0, run.deadline_at - time.time()) + 5.0
    results = calls.gather([(c.policy, c.ref) for c in run.calls], timeout, what)
    return [(c.policy, r) for c, r in zip(run.calls, results, strict=True)]


def report(run: Execution, results: list[tuple[Policy, Outcome]], error: str | None) -> SyncReport:
    """The measured steps (every step whose calls all succeeded) next to the plan's predictions."""
    value: dict[int, Mapping[str, Any]] = {}
    for (_, (result, err)), i in zip(results, range(len(run.calls)), strict=True):
        if err is None and isinstance(result, Mapping):
            value[i] = result
    index = {id(c): i for i, c in enumerate(run.calls)}
    ends: dict[int, float] = {}
    steps = []
    previous: dict[str, int] = {}
    for step in run.plan.steps:
        calls = run.by_step.get(step.index, [])
        timings = [value.get(index[id(c)]) for c in calls]
        deps = [*step.after, *([previous[step.src]] if step.src in previous else [])]
        previous[step.src] = step.index
        if not calls or any(t is None for t in timings) or any(d not in ends for d in deps):
            continue
        begin = max([run.started, *(ends[d] for d in deps)])
        phases, end = _phases(step, calls, [t for t in timings if t is not None])
        ends[step.index] = end
        measured = max(0.0, end - begin)
        phases["control"] = max(0.0, measured - _own(phases))
        steps.append(StepReport(step.index, measured, step.predicted_seconds, phases))
    return SyncReport(
        run.version,
        error is None,
        error,
        tuple(steps),
        max(0.0, time.time() - run.started),
        run.plan.predicted_seconds,
        run.plan.digest,
    )


def _own(phases: Mapping[str, float]) -> float:
    """The part of a step its processes spent working (wire overlaps land and commit)."""
    if "wire" in phases:
        return phases["wire"]
    return phases.get("pack", 0.0) + phases.get("land", 0.0)


def _phases(
    step: SyncStep, calls: list[Call], timings: list[Mapping[str, Any]]
) -> tuple[dict[str, float], float]:
    phases: dict[str, float] = {}
    end = 0.0
    for call, t in zip(calls, timings, strict=True):
        if call.kind == "receive":
            part = dict(t.get("parts", {})).get(step.src, {})
            end = max(end, float(part.get("t1", t["t1"])))
            for name in ("land", "commit"):
                phases[name] = max(phases.get(name, 0.0), float(part.get(name, 0.0)))
            wait = float(dict(t.get("phases", {})).get("wait_readers", 0.0))
            phases["wait_readers"] = max(phases.get("wait_readers", 0.0), wait)
            continue
        end = max(end, float(t["t1"]))
        for name, seconds in dict(t.get("phases", {})).items():
            phases[name] = max(phases.get(name, 0.0), float(seconds))
    return phases, end
