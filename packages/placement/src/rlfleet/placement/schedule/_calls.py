"""The calls an executor makes to run a `SyncPlan`, and the `SyncReport` their timings make.

Each step becomes calls on the processes taking part, in plan order (policygroup runs them):

* ``node_buffer``: a trainer writer ``publish``es the version into the node's buffer, then every
  reader ``stage``s it out (after the publish); a rollout writer filled the buffer in its
  receive (a step of ``after``), so only the readers are called;
* ``broadcast`` and ``p2p``: the sender ``send``s its buckets; a rollout worker ``receive``s
  every group step addressed to it in one call (one part per sender, scheduled at the last of
  them), since an endpoint takes a version once;
* ``cuda_ipc``: the writer, a trainer, ``ipc_send``s through its channel to the step's readers
  while each reader ``ipc_receive``s, together like a broadcast.

A step waits for the calls serving its ``after`` steps and its sender's previous step (those
scheduled before it); a receive waits for what its parts wait for. A step's measured time runs
from when it could start (the sync's start, or its dependencies' end) to its last call's end;
what its own phases do not explain is control (the executor's calls).

The contract with the worker that runs the calls is typed here: each call kind's worker method
returns a `CallResult` (wall-clock ``t0``/``t1``, its phases, its value, for a receive one
`PartResult` per sender, and for a sending call what it put on the wire, a `WireResult`), and
`sync_report` reads exactly those fields. A step whose sender says nothing of its bytes sent
the full version of its buckets (the plan's bytes): only a sender that reports a delta base
sent less, and the step's receivers are then listed as having received the delta.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, get_args

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement._public import public
from rlfleet.placement.sync._plan import GROUP_TRANSPORTS, SyncPlan, SyncStep
from rlfleet.placement.sync._report import StepReport, SyncReport

__all__ = [
    "CALL_KINDS",
    "CallKind",
    "CallResult",
    "GroupPart",
    "PartResult",
    "PlannedCall",
    "WireResult",
    "schedule_calls",
    "sync_report",
]

CallKind = Literal["publish", "send", "receive", "stage", "ipc_send", "ipc_receive"]
CALL_KINDS: tuple[CallKind, ...] = get_args(CallKind)


class PartResult(TypedDict, total=False):
    """One sender's part of a receive: its span (``time.time()``), its land and commit."""

    t0: float
    t1: float
    land: float
    commit: float


class CallTimes(TypedDict):
    """The fields every step call returns: wall-clock start and end, and its phases in seconds
    (names from `MEASURED_PHASES`)."""

    t0: float
    t1: float
    phases: dict[str, float]


class WireResult(TypedDict, total=False):
    """What a sending call put on its transport: ``bytes`` sent, ``full_bytes`` of the full
    version of its buckets, ``base`` the version a delta was against (None: full) and
    ``lacking`` the receivers (process ids) that did not hold the base offered."""

    bytes: int
    full_bytes: int
    base: int | None
    lacking: list[str]


class CallResult(CallTimes, total=False):
    """What a worker's step call returns to the executor (plain data: it crosses Ray): its
    times and phases, its value (bytes moved, the version applied), for a receive one
    `PartResult` per sender id, and for a send what went on the wire (`WireResult`)."""

    value: Any
    parts: dict[str, PartResult]
    wire: WireResult


for _typed in (PartResult, CallTimes, WireResult, CallResult):
    public(_typed)  # help() and tracebacks name the package root (a TypedDict takes no decorator)


@public
@dataclass(frozen=True)
class GroupPart:
    """One group step a send or receive takes part in: its members (sender first) and buckets
    (None: all)."""

    step: int
    sender: str
    members: tuple[str, ...]
    buckets: tuple[int, ...] | None


@public
@dataclass(frozen=True)
class PlannedCall:
    """One call of a sync: `kind` on process `pid`, serving `steps`, after the calls `waits`.

    `waits` are indices of earlier calls in the schedule. The arguments, as plain data: `parts`
    the group steps of a send (its own) or a receive (one per sender); `node` the step's node
    (whose buffer a publish or stage uses); `readers` a cuda_ipc channel's (its ipc_send and every ipc_receive
    carry them) and `reader` an ipc_receive's index among them.
    """

    kind: CallKind
    pid: str
    steps: tuple[int, ...]
    waits: tuple[int, ...] = ()
    node: str | None = None
    parts: tuple[GroupPart, ...] = ()
    readers: tuple[str, ...] = ()
    reader: int | None = None


def _step_deps(step: SyncStep, previous: Mapping[str, int]) -> list[int]:
    """The steps `step` waits for: its ``after`` and its sender's previous step."""
    return [*step.after, *([previous[step.src]] if step.src in previous else [])]


class _Schedule:
    """The calls scheduled so far and the steps each serves (a receive serves several)."""

    def __init__(self, plan: SyncPlan) -> None:
        self.plan = plan
        self.calls: list[PlannedCall] = []
        self.serving: dict[int, list[int]] = {}  # step -> indices of its calls so far
        self.waits: dict[int, tuple[int, ...]] = {}  # step -> calls it waits for

    def add(self, call: PlannedCall) -> int:
        index = len(self.calls)
        self.calls.append(call)
        for s in call.steps:
            self.serving.setdefault(s, []).append(index)
        return index

    def wait_for(self, step: SyncStep, previous: Mapping[str, int]) -> None:
        calls = [i for s in dict.fromkeys(_step_deps(step, previous)) for i in self.serving.get(s, [])]
        self.waits[step.index] = tuple(dict.fromkeys(calls))

    def part(self, step: SyncStep) -> GroupPart:
        every = len(step.buckets) == len(self.plan.bucket_bytes)
        return GroupPart(step.index, step.src, (step.src, *step.dst), None if every else step.buckets)

    def group_step(self, step: SyncStep, receiving: Mapping[str, list[SyncStep]]) -> None:
        waits = self.waits[step.index]
        self.add(PlannedCall("send", step.src, (step.index,), waits, parts=(self.part(step),)))
        for d in step.dst:
            parts = receiving[d]
            if parts[-1].index == step.index:
                waits = tuple(dict.fromkeys(i for p in parts for i in self.waits[p.index]))
                made = tuple(self.part(p) for p in parts)
                self.add(PlannedCall("receive", d, tuple(p.index for p in parts), waits, parts=made))

    def node_buffer_step(self, step: SyncStep) -> None:
        waits = self.waits[step.index]
        if self.plan.process(step.src).role == "trainer":
            published = self.add(PlannedCall("publish", step.src, (step.index,), waits, node=step.node))
            waits = (*waits, published)
        for r in step.dst:
            self.add(PlannedCall("stage", r, (step.index,), waits, node=step.node))

    def ipc_step(self, step: SyncStep) -> None:
        if self.plan.process(step.src).role != "trainer":
            raise SyncPlanError(
                f"step {step.index} relays a received version by CUDA IPC ({step.src}); a sync "
                "sends by CUDA IPC from trainers only (relays fill a node buffer)"
            )
        waits, readers, steps = self.waits[step.index], step.dst, (step.index,)
        self.add(PlannedCall("ipc_send", step.src, steps, waits, node=step.node, readers=readers))
        for index, r in enumerate(readers):
            self.add(
                PlannedCall("ipc_receive", r, steps, waits, node=step.node, readers=readers, reader=index)
            )


@public
def schedule_calls(plan: SyncPlan) -> tuple[PlannedCall, ...]:
    """Every call that runs `plan`, in the order to start them (see the module docstring).

    Raises SyncPlanError naming the step an executor cannot run: a relay's cuda_ipc step, or a
    transport other than node_buffer, broadcast, p2p and cuda_ipc."""
    schedule = _Schedule(plan)
    receiving: dict[str, list[SyncStep]] = {}
    for step in plan.steps:
        if step.transport in GROUP_TRANSPORTS:
            for d in step.dst:
                receiving.setdefault(d, []).append(step)
    previous: dict[str, int] = {}  # sender -> its last step so far
    for step in plan.steps:
        schedule.wait_for(step, previous)
        if step.transport in GROUP_TRANSPORTS:
            schedule.group_step(step, receiving)
        elif step.transport == "node_buffer":
            schedule.node_buffer_step(step)
        elif step.transport == "cuda_ipc":
            schedule.ipc_step(step)
        else:
            raise SyncPlanError(
                f"step {step.index} uses transport {step.transport!r}, which a sync does not run "
                f"(it runs node_buffer, {', '.join(GROUP_TRANSPORTS)} and cuda_ipc)"
            )
        previous[step.src] = step.index
    return tuple(schedule.calls)


@public
def sync_report(
    plan: SyncPlan,
    calls: Sequence[PlannedCall],
    timings: Sequence[CallResult | None],
    *,
    version: int,
    started: float,
    error: str | None,
    finished: float | None = None,
) -> SyncReport:
    """The measured steps of `plan` next to its predictions, from what each call returned.

    `timings[i]` is call i's `CallResult`, None where it failed. A step is measured when all its
    calls and all the steps it waits for were;
    `started` and `finished` (default: now) are ``time.time()`` values of the sync."""
    if len(timings) != len(calls):
        raise SyncPlanError(f"sync report: {len(timings)} timings for {len(calls)} calls")
    serving: dict[int, list[int]] = {}
    for i, call in enumerate(calls):
        for s in call.steps:
            serving.setdefault(s, []).append(i)
    ends: dict[int, float] = {}
    steps: list[StepReport] = []
    previous: dict[str, int] = {}
    for step in plan.steps:
        mine = serving.get(step.index, [])
        deps = _step_deps(step, previous)
        previous[step.src] = step.index
        got = [t for t in (timings[i] for i in mine) if t is not None]
        if not mine or len(got) < len(mine) or any(d not in ends for d in deps):
            continue
        begin = max([started, *(ends[d] for d in deps)])
        phases, ends[step.index] = _phases(step, [calls[i] for i in mine], got)
        measured = max(0.0, ends[step.index] - begin)
        phases["control"] = max(0.0, measured - _own(phases))
        moved = _moved(plan, step, [calls[i] for i in mine], got)
        steps.append(StepReport(step.index, measured, step.predicted_seconds, phases, **moved))
    now = time.time() if finished is None else finished
    return SyncReport(
        version,
        error is None,
        error,
        tuple(steps),
        max(0.0, now - started),
        plan.predicted_seconds,
        plan.digest,
    )


_SENDING: tuple[CallKind, ...] = ("send", "publish", "ipc_send")


def _moved(
    plan: SyncPlan, step: SyncStep, calls: Sequence[PlannedCall], timings: Sequence[CallResult]
) -> dict[str, Any]:
    """A step's bytes and who got what: its sender's `WireResult`, else the plan's full bytes."""
    full = sum(plan.bucket_bytes[b] for b in step.buckets)
    wire: WireResult = {}
    for call, t in zip(calls, timings, strict=True):
        if call.kind in _SENDING and call.pid == step.src:
            wire = t.get("wire", {})
    sent, base = int(wire.get("bytes", full)), wire.get("base")
    lacking = tuple(str(p) for p in wire.get("lacking", ()))
    return {
        "bytes_on_wire": sent,
        "full_bytes": int(wire.get("full_bytes", full)),
        "delta_base": None if base is None else int(base),
        "delta_receivers": step.dst if base is not None else (),
        "full_receivers": () if base is not None else step.dst,
        "lacking_base": lacking,
    }


def _own(phases: Mapping[str, float]) -> float:
    """The part of a step its processes spent working (wire overlaps land and commit)."""
    if "wire" in phases:
        return phases["wire"]
    return phases.get("pack", 0.0) + phases.get("land", 0.0)


def _phases(
    step: SyncStep, calls: Sequence[PlannedCall], timings: Sequence[CallResult]
) -> tuple[dict[str, float], float]:
    """A step's phases (the longest of each over its calls) and its end (its last call's)."""
    phases: dict[str, float] = {}
    end = 0.0
    for call, t in zip(calls, timings, strict=True):
        if call.kind == "receive":
            part: PartResult = t.get("parts", {}).get(step.src, {})
            end = max(end, float(part.get("t1", t["t1"])))
            phases["land"] = max(phases.get("land", 0.0), float(part.get("land", 0.0)))
            phases["commit"] = max(phases.get("commit", 0.0), float(part.get("commit", 0.0)))
            wait = float(t["phases"].get("wait_readers", 0.0))
            phases["wait_readers"] = max(phases.get("wait_readers", 0.0), wait)
            continue
        end = max(end, float(t["t1"]))
        for name, seconds in t["phases"].items():
            phases[name] = max(phases.get(name, 0.0), float(seconds))
    return phases, end
