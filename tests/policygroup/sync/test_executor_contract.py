"""The executor contract, checked in one place: every call kind placement schedules has its
worker method in `STEP_CALLS`, that method takes exactly the arguments the executor passes
(`step_args`), and it returns placement's `CallResult`, the shape `sync_report` reads."""

from __future__ import annotations

import inspect
import time
import typing

import pytest
from pg_policies import Tiny

from rlfleet.placement import CALL_KINDS, CallResult, GroupPart, PlannedCall, SyncPlan, schedule_calls
from rlfleet.policygroup import PolicyConfig, PolicyGroup, WeightBufferConfig
from rlfleet.policygroup.sync._run import step_args
from rlfleet.policygroup.worker import STEP_CALLS, WeightCalls


def _sample(kind: str) -> PlannedCall:
    part = GroupPart(0, "t0", ("t0", "r0"), None)
    return PlannedCall(
        kind,  # type: ignore[arg-type]
        "r0",
        (0,),
        node="n0",
        parts=(part,) if kind in ("send", "receive") else (),
        readers=("r0",) if kind.startswith("ipc") else (),
        reader=0 if kind == "ipc_receive" else None,
    )


def test_every_call_kind_has_its_worker_method() -> None:
    assert set(STEP_CALLS) == set(CALL_KINDS)
    for kind, method in STEP_CALLS.items():
        assert getattr(WeightCalls, method.__name__) is method, kind  # dispatch by this name works


@pytest.mark.parametrize("kind", CALL_KINDS)
def test_each_method_takes_what_the_executor_passes_and_returns_a_call_result(kind: str) -> None:
    method = STEP_CALLS[kind]  # type: ignore[index]
    parts = [{"group": "g", "src_rank": 0, "sender": "t0", "buckets": None}]
    args = step_args(_sample(kind), 3, time.time() + 60, parts, {"n0": "rlfleet-x"}, "channel")
    signature = inspect.signature(method)
    named = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ][1:]  # after self
    assert len(named) == len(args), f"{method.__name__}{signature} vs {len(args)} arguments"
    assert "deadline_at" in named
    assert "version" in named
    after = ("ref-a", "ref-b")  # the refs of the calls it waits for ride along (*_after)
    signature.bind(object(), *args, *after)  # TypeError if they disagree
    assert typing.get_type_hints(method)["return"] is CallResult


def test_a_real_sync_returns_call_results_the_report_reads() -> None:
    """Local workers, node buffer and broadcast-free: every call's value is a `CallResult` and
    each step of the plan is measured."""
    config = PolicyConfig(weight_buffer=WeightBufferConfig(buffer_strategy="Shared", bucket_bytes=4096))
    trainer, rollouts = Tiny(config, "train"), [Tiny(config, "eval", index=i) for i in range(2)]
    group = PolicyGroup([trainer], rollouts, config)
    try:
        group.init_placement_info()
        group.init_weight_buffer()
        report = group.sync_weights()
        plan = group.sync_plan
        assert isinstance(plan, SyncPlan)
        assert report is not None
        kinds = {c.kind for c in schedule_calls(plan)}
        assert kinds <= set(STEP_CALLS)
        assert report.ok
        assert report.matches(plan)
    finally:
        group.shutdown()


def test_the_report_covers_the_whole_sync_its_caller_waits_for() -> None:
    """``sync_weights()`` reports the whole sync (checks, steps, answers, the rolling apply), not
    only the plan's steps, and predicts all of it."""
    config = PolicyConfig(weight_buffer=WeightBufferConfig(buffer_strategy="Double", bucket_bytes=4096))
    group = PolicyGroup([Tiny(config, "train")], [Tiny(config, "eval", index=i) for i in range(2)], config)
    try:
        group.init_placement_info()
        group.init_weight_buffer()
        began = time.monotonic()
        report = group.sync_weights()
        elapsed = time.monotonic() - began
        assert report is not None
        assert report.wall_seconds is not None
        assert report.predicted_wall_seconds is not None
        assert report.wall_seconds <= elapsed  # inside the caller's wait
        assert set(report.wall_phases) == {"prepare", "steps", "collect", "apply"}
        assert sum(report.wall_phases.values()) == pytest.approx(report.wall_seconds)
        assert report.wall_phases["steps"] == report.measured_seconds
        assert report.wall_phases["apply"] > 0  # the rolling update is part of it
        assert report.predicted_wall_seconds > report.predicted_seconds
        assert group.last_sync_report == report
        assert group.last_sync is not None
        assert group.last_sync.report == report
    finally:
        group.shutdown()
