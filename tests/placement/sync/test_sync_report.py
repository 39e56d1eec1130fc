"""SyncReport / StepReport: plain data with a one-line summary and a check against the plan."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from rlfleet.placement import (
    WALL_PHASES,
    CostModel,
    StepReport,
    SyncPlanError,
    SyncProcess,
    SyncReport,
    plan_sync,
    predict_sync_wall,
    schedule_calls,
    sync_report,
)

PROCS = [
    SyncProcess("t0", "trainer", "n0"),
    SyncProcess("r0", "rollout", "n0"),
    SyncProcess("r1", "rollout", "n1"),
    SyncProcess("r2", "rollout", "n1"),
]


def executed(plan_steps: int, digest: str, measured: float = 0.41) -> SyncReport:
    steps = tuple(
        StepReport(i, 0.1, 0.09, {"pack": 0.01, "wire": 0.05, "land": 0.02, "commit": 0.01, "control": 0.01})
        for i in range(plan_steps)
    )
    return SyncReport(3, True, None, steps, measured, 0.38, digest)


def test_summary_is_one_line() -> None:
    report = executed(4, "d")
    assert report.summary() == "v3 ok 0.41 s measured / 0.38 s predicted (1.08x), 4 steps"
    failed = dataclasses.replace(report, ok=False, error="IncompleteSyncError: t1 sent nothing")
    assert failed.summary().startswith("v3 FAILED (IncompleteSyncError: t1 sent nothing) 0.41 s measured")
    assert "\n" not in failed.summary()


def test_matches_only_the_plan_it_executed() -> None:
    plan = plan_sync(PROCS, [2**20] * 4, "Shared")
    report = executed(len(plan.steps), plan.digest)
    assert report.matches(plan)
    assert not dataclasses.replace(report, steps=report.steps[:-1]).matches(plan)  # a step skipped
    other = plan_sync(PROCS, [2**20] * 4, "Double")
    assert not report.matches(other)  # a different plan
    assert not executed(len(plan.steps), "stale").matches(plan)


def test_round_trip_and_checks() -> None:
    report = executed(2, "abc")
    assert SyncReport.from_dict(json.loads(report.to_json())) == report
    with pytest.raises(SyncPlanError, match="unknown phase\\(s\\) \\['apply'\\]"):
        StepReport(0, 1.0, 1.0, {"apply": 0.5})
    with pytest.raises(SyncPlanError, match="measured_seconds must be a non-negative finite"):
        StepReport(0, -1.0, 1.0)
    with pytest.raises(SyncPlanError, match="failed sync report must carry its error"):
        SyncReport(1, False, None, (), 0.0, 0.0, "d")
    with pytest.raises(SyncPlanError, match="malformed sync report"):
        SyncReport.from_dict({"version": 1})


def test_the_whole_sync_adds_up_and_round_trips() -> None:
    """The steps are not the whole sync: the report carries the caller's wall time, phases that
    add up to it, and the prediction of all of it."""
    plan = plan_sync(PROCS, [2**20] * 4, "Double")
    report = executed(len(plan.steps), plan.digest)
    phases = {"prepare": 0.02, "steps": 0.41, "collect": 0.01, "apply": 0.06}
    whole = report.with_wall(phases, 0.45)
    assert whole.wall_seconds == pytest.approx(0.5)
    assert whole.wall_ratio == pytest.approx(0.5 / 0.45)
    assert SyncReport.from_dict(json.loads(whole.to_json())) == whole
    assert whole.summary().endswith("; whole sync 0.5 s / 0.45 s predicted")
    with pytest.raises(SyncPlanError, match=r"add up to 0\.500000 s, not the wall time 0\.700000 s"):
        dataclasses.replace(whole, wall_seconds=0.7)
    with pytest.raises(SyncPlanError, match=r"unknown wall phase\(s\) \['drain'\]"):
        report.with_wall({"drain": 0.1})
    assert report.wall_seconds is None  # an executor that does not time the whole sync
    assert report.wall_ratio is None


@pytest.mark.parametrize("strategy", ["None", "Double", "Shared", "Sharded"])
def test_the_predicted_whole_sync_covers_checks_steps_answers_and_the_rolling_apply(strategy: str) -> None:
    procs = [*PROCS, SyncProcess("r3", "rollout", "n1")]
    if strategy == "Sharded":  # each rollout worker keeps its node's i-th of n
        procs = [
            *PROCS[:1],
            SyncProcess("r0", "rollout", "n0", shard=(0, 1)),
            *[SyncProcess(f"r{i}", "rollout", "n1", shard=(i - 1, 3)) for i in (1, 2, 3)],
        ]
    plan = plan_sync(procs, [2**20] * 4, strategy)
    model = CostModel(control_round_trip_s=0.01, load_bytes_per_s=2**22)  # 4 MiB/s: 1 s per copy
    staged = predict_sync_wall(plan, model, apply=False)
    whole = predict_sync_wall(plan, model)
    assert tuple(whole) == WALL_PHASES
    assert whole["steps"] == staged["steps"] == plan.predicted_seconds
    assert whole["prepare"] == whole["collect"] == 0.01
    assert staged["apply"] == 0.0
    swaps = {"None": 0, "Double": 4, "Shared": 4, "Sharded": 2}[strategy]  # Sharded: a node at a time
    copy = 1.0 if strategy in ("Double", "Sharded") else 0.0
    assert whole["apply"] == pytest.approx(swaps * (0.01 + copy))


def test_async_fields_say_the_serving_stall_and_the_versions_skipped() -> None:
    report = dataclasses.replace(executed(2, "abc"), serving_stall_seconds=0.0021, skipped_versions=(2, 1))
    assert report.skipped_versions == (1, 2)
    assert report.summary().endswith("; serving stall 2.1 ms; skipped v1, v2")
    assert SyncReport.from_dict(json.loads(report.to_json())) == report
    older = {
        k: v
        for k, v in executed(1, "x").to_dict().items()
        if k not in ("serving_stall_seconds", "skipped_versions")
    }
    assert SyncReport.from_dict(older) == executed(1, "x")  # a report written before these fields
    with pytest.raises(SyncPlanError, match=r"skipped_versions must be ints older than version 3, got \[3\]"):
        dataclasses.replace(report, skipped_versions=(3,))
    with pytest.raises(SyncPlanError, match="serving_stall_seconds must be a non-negative"):
        dataclasses.replace(report, serving_stall_seconds=-1.0)


def test_a_step_says_what_it_moved_and_the_report_sums_it() -> None:
    """Issue 27: bytes on the wire beside the full version's, the base of a delta, and which
    receivers got the delta and which the full version (and which lacked the base)."""
    delta = StepReport(0, 0.1, 0.09, {"wire": 0.05}, 1_200_000, 4_800_000, 3, ("r1", "r2"))
    full = StepReport(1, 0.1, 0.09, {"land": 0.05}, 4_800_000, 4_800_000, None, (), ("r0",), ("r0",))
    report = SyncReport(4, True, None, (delta, full), 0.2, 0.18, "d")
    assert delta.is_delta
    assert not full.is_delta
    assert (report.bytes_on_wire, report.full_bytes) == (6_000_000, 9_600_000)
    assert (report.delta_receivers, report.full_receivers) == (("r1", "r2"), ("r0",))
    assert (
        report.moved()
        == "6 MB on the wire of 9.6 MB full; delta from v3 to r1, r2; full to r0 (r0 lacked the base)"
    )
    assert report.summary().endswith("2 steps; " + report.moved())
    assert "\n" not in report.summary()
    assert SyncReport.from_dict(json.loads(report.to_json())) == report
    assert executed(2, "d").moved() == ""  # an executor that says nothing of bytes: nothing said
    older = executed(1, "x").to_dict()
    for step in older["steps"]:
        for name in ("bytes_on_wire", "full_bytes", "delta_base", "delta_receivers", "full_receivers"):
            del step[name]
    assert SyncReport.from_dict(older) == executed(1, "x")  # a report written before these fields


def test_what_a_step_moved_is_checked() -> None:
    with pytest.raises(
        SyncPlanError, match=r"step report 0: bytes_on_wire must be a non-negative int, got -1"
    ):
        StepReport(0, 0.1, 0.1, bytes_on_wire=-1)
    with pytest.raises(SyncPlanError, match=r"delta_receivers \['r1'\] without a delta_base"):
        StepReport(0, 0.1, 0.1, delta_receivers=("r1",))
    with pytest.raises(SyncPlanError, match=r"\['r1'\] listed as receiving both"):
        StepReport(0, 0.1, 0.1, delta_base=2, delta_receivers=("r1",), full_receivers=("r1",))
    with pytest.raises(SyncPlanError, match="full_receivers must be a sequence of process ids"):
        StepReport(0, 0.1, 0.1, full_receivers="r1")  # type: ignore[arg-type]


def test_sync_report_carries_what_each_sender_put_on_the_wire() -> None:
    """A broadcast sender that reports a delta: its receivers got the delta; a step whose sender
    says nothing (the node buffer's publish) sent the full version of its buckets."""
    plan = plan_sync(PROCS, [2**20] * 4, "Double")
    calls = schedule_calls(plan)
    assert [(c.kind, c.pid) for c in calls] == [
        ("send", "t0"), ("receive", "r1"), ("receive", "r2"), ("publish", "t0"), ("stage", "r0"),
    ]  # fmt: skip
    timings: list[Any] = [{"t0": 100.0, "t1": 100.5, "phases": {}} for _ in calls]
    timings[0]["wire"] = {"bytes": 65_000, "full_bytes": 2**22, "base": 1, "lacking": []}
    report = sync_report(plan, calls, timings, version=2, started=100.0, error=None, finished=101.0)
    by = {s.index: s for s in report.steps}
    assert (by[0].bytes_on_wire, by[0].full_bytes, by[0].delta_base) == (65_000, 2**22, 1)
    assert (by[0].delta_receivers, by[0].full_receivers) == (("r1", "r2"), ())
    assert (by[1].bytes_on_wire, by[1].full_bytes, by[1].delta_base) == (2**22, 2**22, None)
    assert (by[1].delta_receivers, by[1].full_receivers) == ((), ("r0",))
    assert report.bytes_on_wire == 65_000 + 2**22
    assert "delta from v1 to r1, r2; full to r0" in report.summary()
    # the first version (no base yet) and one a receiver lacked the base of go full to every receiver
    timings[0]["wire"] = {"bytes": 2**22, "full_bytes": 2**22, "base": None, "lacking": ["r2"]}
    report = sync_report(plan, calls, timings, version=3, started=100.0, error=None, finished=101.0)
    assert report.steps[0].full_receivers == ("r1", "r2")
    assert report.steps[0].lacking_base == ("r2",)
    assert report.delta_receivers == ()
    assert report.summary().endswith("full to r1, r2, r0 (r2 lacked the base)")
