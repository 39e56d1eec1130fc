"""schedule_calls: the calls each kind of step becomes and what each waits for; sync_report: the
measured steps, phases and control from the calls' timings, a failed call leaving out its step
and the steps that wait for it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from sync_processes import BUCKETS, R, T, cluster

from rlfleet.placement import (
    CALL_KINDS,
    CallResult,
    GroupPart,
    PlannedCall,
    SyncPlan,
    SyncPlanError,
    plan_sync,
    schedule_calls,
    seed_sync_plan,
    sync_report,
)


def relay_plan() -> SyncPlan:
    """t0 broadcasts to r1 and r3, which fill their nodes' buffers; t0 fills n0's for r0."""
    return plan_sync(cluster(1), BUCKETS, "Double", fanout="node_buffer")


def ipc_plan() -> SyncPlan:
    procs = [T("t0", "n0"), T("t1", "n1"), R("r0", "n0"), R("r1", "n0"), R("r2", "n2")]
    return plan_sync(procs, BUCKETS, "Double", cuda_ipc="force")


def shape(calls: tuple[PlannedCall, ...]) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    return [(c.kind, c.pid, c.steps, c.waits) for c in calls]


def test_a_trainer_writer_publishes_then_its_readers_stage_and_a_relay_calls_only_readers() -> None:
    plan = plan_sync(cluster(2), BUCKETS, "Shared")
    assert [(s.transport, s.src, s.after) for s in plan.steps] == [
        ("broadcast", "t0", ()),
        ("broadcast", "t1", ()),
        ("node_buffer", "t0", ()),
        ("node_buffer", "r1", (0, 1)),
        ("node_buffer", "r3", (0, 1)),
    ]
    calls = schedule_calls(plan)
    assert shape(calls) == [
        ("send", "t0", (0,), ()),
        ("send", "t1", (1,), ()),
        ("receive", "r1", (0, 1), ()),
        ("receive", "r3", (0, 1), ()),
        ("publish", "t0", (2,), (0, 2, 3)),  # after t0's previous step: its send and its receives
        ("stage", "r0", (2,), (0, 2, 3, 4)),  # and after the publish
        ("stage", "r2", (3,), (0, 2, 3, 1)),  # the relay r1 filled n1's buffer in its receive
        ("stage", "r4", (4,), (0, 2, 3, 1)),
        ("stage", "r5", (4,), (0, 2, 3, 1)),
    ]
    assert [c.node for c in calls[4:]] == ["n0", "n0", "n1", "n2", "n2"]
    assert {c.kind for c in calls} <= set(CALL_KINDS)


def test_a_relay_receives_once_and_its_readers_wait_for_that_receive() -> None:
    calls = schedule_calls(relay_plan())
    assert shape(calls) == [
        ("send", "t0", (0,), ()),
        ("receive", "r1", (0,), ()),
        ("receive", "r3", (0,), ()),
        ("publish", "t0", (1,), (0, 1, 2)),
        ("stage", "r0", (1,), (0, 1, 2, 3)),
        ("stage", "r2", (2,), (0, 1, 2)),
        ("stage", "r4", (3,), (0, 1, 2)),
        ("stage", "r5", (3,), (0, 1, 2)),
    ]
    assert calls[0].parts == (GroupPart(0, "t0", ("t0", "r1", "r3"), None),)  # every bucket: "all"
    assert calls[1].parts == calls[0].parts


def test_several_senders_into_one_receiver_make_one_receive_with_a_part_per_sender() -> None:
    plan = plan_sync(cluster(2), BUCKETS, "Double")
    calls = schedule_calls(plan)
    sends = [c for c in calls if c.kind == "send"]
    assert [(c.pid, c.parts[0].buckets) for c in sends] == [("t0", (0, 1, 2)), ("t1", (3, 4, 5))]
    receives = [c for c in calls if c.kind == "receive"]
    assert [c.pid for c in receives] == ["r1", "r2", "r3", "r4", "r5"]  # one call each
    members = ("r1", "r2", "r3", "r4", "r5")
    for call in receives:
        assert call.steps == (0, 1)
        assert call.parts == (
            GroupPart(0, "t0", ("t0", *members), (0, 1, 2)),
            GroupPart(1, "t1", ("t1", *members), (3, 4, 5)),
        )
    # scheduled at the last of its parts: after both sends
    assert [c.kind for c in calls[:2]] == ["send", "send"]


def test_p2p_pairs_are_a_send_and_a_receive_each() -> None:
    procs = [T("t0", "n0"), T("t1", "n0"), R("r0", "n0"), R("r1", "n0")]
    plan = seed_sync_plan(procs, BUCKETS, "Double", colocated=True)
    assert {s.transport for s in plan.steps} == {"p2p"}
    calls = schedule_calls(plan)
    assert shape(calls) == [
        ("send", "t0", (0,), ()),
        ("receive", "r0", (0,), ()),
        ("send", "t1", (1,), ()),
        ("receive", "r1", (1,), ()),
    ]
    assert [c.parts[0].members for c in calls if c.kind == "send"] == [("t0", "r0"), ("t1", "r1")]
    assert calls[3].parts == (GroupPart(1, "t1", ("t1", "r1"), None),)


def test_cuda_ipc_writer_and_readers_run_together_after_the_writers_previous_step() -> None:
    plan = ipc_plan()
    assert [(s.transport, s.src, s.dst) for s in plan.steps][2] == ("cuda_ipc", "t0", ("r0", "r1"))
    calls = schedule_calls(plan)
    assert shape(calls)[3:] == [
        ("ipc_send", "t0", (2,), (0, 2)),  # t0's send of step 0 and r2's receive (serving step 0)
        ("ipc_receive", "r0", (2,), (0, 2)),
        ("ipc_receive", "r1", (2,), (0, 2)),
    ]
    assert {c.readers for c in calls[3:]} == {("r0", "r1")}
    assert [c.reader for c in calls[3:]] == [None, 0, 1]
    assert {c.node for c in calls[3:]} == {"n0"}


def _replaced(plan: SyncPlan, position: int, **changes: Any) -> SyncPlan:
    steps = list(plan.steps)
    steps[position] = dataclasses.replace(steps[position], **changes)
    return dataclasses.replace(plan, steps=tuple(steps))


def test_steps_an_executor_cannot_run_are_named() -> None:
    relay = relay_plan()
    with pytest.raises(SyncPlanError, match=r"step 2 relays a received version by CUDA IPC \(r1\)"):
        schedule_calls(_replaced(relay, 2, transport="cuda_ipc"))
    with pytest.raises(SyncPlanError, match="step 1 uses transport 'object_store'"):
        schedule_calls(_replaced(relay, 1, transport="object_store"))


@pytest.mark.parametrize("strategy", ["None", "Double", "Shared"])
@pytest.mark.parametrize("trainers", [1, 2, 3])
def test_every_call_waits_only_for_earlier_calls_and_every_step_is_served(
    strategy: str, trainers: int
) -> None:
    plan = plan_sync(cluster(trainers), BUCKETS, strategy)
    calls = schedule_calls(plan)
    assert all(w < i for i, c in enumerate(calls) for w in c.waits)
    assert {s for c in calls for s in c.steps} == {s.index for s in plan.steps}
    receivers = [c.pid for c in calls if c.kind == "receive"]
    assert len(receivers) == len(set(receivers))  # an endpoint takes a version once


# --------------------------------------------------------------------------- report
STARTED = 100.0


def relay_timings() -> list[CallResult | None]:
    """What the relay plan's calls return (`CallResult`s): start and end, phases, a receive's
    parts per sender."""
    return [
        {"t0": 100.0, "t1": 101.0, "phases": {"pack": 0.2, "wire": 0.6}},  # send t0
        {
            "t0": 100.0,
            "t1": 101.2,
            "parts": {"t0": {"t1": 101.1, "land": 0.3, "commit": 0.05}},
            "phases": {"wait_readers": 0.02},
        },
        {  # receive r3
            "t0": 100.0,
            "t1": 101.3,
            "parts": {"t0": {"t1": 101.25, "land": 0.4, "commit": 0.1}},
            "phases": {},
        },
        {"t0": 101.0, "t1": 101.5, "phases": {"pack": 0.2}},  # publish t0
        {"t0": 101.5, "t1": 101.7, "phases": {"land": 0.1}},  # stage r0
        {"t0": 101.5, "t1": 101.6, "phases": {"land": 0.25}},  # stage r2
        {"t0": 101.5, "t1": 102.0, "phases": {"land": 0.3}},  # stage r4
        {"t0": 101.5, "t1": 101.9, "phases": {"land": 0.5}},  # stage r5
    ]


def test_report_measures_each_step_from_when_it_could_start() -> None:
    plan = relay_plan()
    calls = schedule_calls(plan)
    report = sync_report(plan, calls, relay_timings(), version=7, started=STARTED, error=None, finished=102.5)
    assert (report.version, report.ok, report.error, report.plan_digest) == (7, True, None, plan.digest)
    assert report.measured_seconds == pytest.approx(2.5)
    assert report.predicted_seconds == plan.predicted_seconds
    assert report.matches(plan)
    by = {s.index: s for s in report.steps}
    # step 0: from the start to the last part's end; its own time is the wire's, the rest control
    assert by[0].measured_seconds == pytest.approx(1.25)
    assert by[0].phases == pytest.approx(
        {"pack": 0.2, "wire": 0.6, "land": 0.4, "commit": 0.1, "wait_readers": 0.02, "control": 0.65}
    )
    # step 1 waits for t0's step 0 (it ended at 101.25): publish pack + stage land, the rest control
    assert by[1].measured_seconds == pytest.approx(0.45)
    assert by[1].phases == pytest.approx({"pack": 0.2, "land": 0.1, "control": 0.15})
    assert by[2].measured_seconds == pytest.approx(0.35)
    assert by[2].phases == pytest.approx({"land": 0.25, "control": 0.1})
    assert by[3].measured_seconds == pytest.approx(0.75)  # the slowest reader ends the step
    assert by[3].phases == pytest.approx({"land": 0.5, "control": 0.25})
    assert [s.predicted_seconds for s in report.steps] == [s.predicted_seconds for s in plan.steps]


def test_a_failed_call_leaves_out_its_step_and_the_steps_that_wait_for_it() -> None:
    plan = relay_plan()
    calls = schedule_calls(plan)
    timings = relay_timings()
    timings[5] = None  # stage r2 failed: only its step
    report = sync_report(plan, calls, timings, version=3, started=STARTED, error="r2: boom", finished=103.0)
    assert (report.ok, report.error) == (False, "r2: boom")
    assert [s.index for s in report.steps] == [0, 1, 3]
    assert not report.matches(plan)
    timings = relay_timings()
    timings[1] = None  # r1's receive: step 0, then t0's next step and both relays' steps
    report = sync_report(plan, calls, timings, version=3, started=STARTED, error="r1: boom")
    assert report.steps == ()
    assert "FAILED (r1: boom)" in report.summary()


def test_a_receive_without_its_part_ends_with_the_call_and_control_is_never_negative() -> None:
    plan = seed_sync_plan([T("t0", "n0"), R("r0", "n0")], BUCKETS, "Double", colocated=True)
    calls = schedule_calls(plan)
    assert [c.kind for c in calls] == ["send", "receive"]
    timings: list[dict[str, Any] | None] = [
        {"t1": 100.5, "phases": {"pack": 0.1, "land": 0.9}},  # more work than the step's time
        {"t1": 100.8, "phases": {}},
    ]
    [step] = sync_report(plan, calls, timings, version=1, started=STARTED, error=None).steps
    assert step.measured_seconds == pytest.approx(0.8)
    assert step.phases == pytest.approx(
        {"pack": 0.1, "land": 0.9, "commit": 0.0, "wait_readers": 0.0, "control": 0.0}
    )


def test_report_needs_one_timing_per_call() -> None:
    plan = relay_plan()
    with pytest.raises(SyncPlanError, match="7 timings for 8 calls"):
        sync_report(plan, schedule_calls(plan), relay_timings()[:7], version=1, started=STARTED, error=None)
