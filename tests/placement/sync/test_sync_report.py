"""SyncReport / StepReport: plain data with a one-line summary and a check against the plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlfleet.placement import StepReport, SyncPlanError, SyncProcess, SyncReport, plan_sync

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
