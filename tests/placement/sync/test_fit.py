"""fit_cost_model: calibration from measured reports (synthetic ones, made by a known model), the
prior the probes give, and every plan at or above its lower bound."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.placement import (
    HARDWARE_PROFILES,
    MEASURED_PHASES,
    CostModel,
    CostModelError,
    StepReport,
    SyncPlan,
    SyncPlanError,
    SyncProcess,
    SyncReport,
    Topology,
    fit_cost_model,
    plan_sync,
    seed_sync_plan,
)
from rlfleet.placement.sync._cost import PlanContext, step_features

MiB = 2**20


def _plans(rng: random.Random, count: int) -> list[SyncPlan]:
    plans = []
    for i in range(count):
        nodes = rng.randint(2, 4)
        procs = [SyncProcess(f"t{k}", "trainer", f"n{k % 2}") for k in range(rng.randint(1, 2))]
        procs += [SyncProcess(f"r{k}", "rollout", f"n{k % nodes}") for k in range(rng.randint(2, 6))]
        sizes = [rng.randint(1, 50) * MiB for _ in range(rng.randint(2, 10))]
        tensors = [rng.randint(1, 200) for _ in sizes]
        planner = plan_sync if i % 2 else seed_sync_plan
        plans.append(planner(procs, sizes, rng.choice(["Shared", "Double", "None"]), bucket_tensors=tensors))
    return plans


def _measure(plans: list[SyncPlan], truth: CostModel, noise: float, rng: random.Random) -> list[SyncReport]:
    """What executing each plan would measure if ``truth`` were the cluster (phases with noise)."""
    reports = []
    values = truth.linear_values()
    for version, plan in enumerate(plans):
        steps = []
        features = step_features(PlanContext.of(plan, truth), plan.steps)
        for step, feats in zip(plan.steps, features, strict=True):
            phases = {
                name: max(0.0, sum(c * values[p] for p, c in coefs.items()) * (1 + rng.gauss(0, noise)))
                for name, coefs in feats.items()
            }
            steps.append(StepReport(step.index, sum(phases.values()), step.predicted_seconds, phases))
        total = sum(s.measured_seconds for s in steps)
        predicted = plan.predicted_seconds
        reports.append(SyncReport(version, True, None, tuple(steps), total, predicted, plan.digest))
    return reports


TRUTH = CostModel(
    per_tensor_s=3e-5,
    per_bucket_s=4e-4,
    memcpy_bytes_per_s=6e9,
    control_round_trip_s=2e-3,
    protocol_efficiency=0.7,
    inter_node_bytes_per_s=2e9,
    intra_node_bytes_per_s=8e9,
    latency_s=1e-4,
)


def test_fit_recovers_known_parameters_from_synthetic_reports() -> None:
    rng = random.Random(7)
    plans = _plans(rng, 16)
    fitted = fit_cost_model(_measure(plans, TRUTH, 0.0, rng), plans)
    recovered = ("per_tensor_s", "per_bucket_s", "memcpy_s_per_byte", "control_round_trip_s")
    recovered += ("inter_s_per_byte",)
    for name in recovered:
        assert fitted.linear_values()[name] == pytest.approx(TRUTH.linear_values()[name], rel=1e-3), name
    # 1.4 GB/s measured beats the prior's 1.25 GB/s line rate: the line rate moves, not the efficiency
    assert fitted.inter_node_bytes_per_s * fitted.protocol_efficiency == pytest.approx(1.4e9, rel=1e-3)
    slower = fit_cost_model(_measure(plans, TRUTH, 0.0, rng), plans, CostModel(inter_node_bytes_per_s=10e9))
    assert slower.inter_node_bytes_per_s == 10e9
    assert slower.protocol_efficiency == pytest.approx(0.14, rel=1e-3)
    assert "NNLS" in fitted.source
    noisy = fit_cost_model(_measure(plans, TRUTH, 0.02, rng), plans)
    for name in ("per_tensor_s", "memcpy_s_per_byte", "control_round_trip_s", "inter_s_per_byte"):
        assert noisy.linear_values()[name] == pytest.approx(TRUTH.linear_values()[name], rel=0.1), name
    # terms nothing measured stay where they were (CPU plans never copy to a GPU)
    assert noisy.h2d_bytes_per_s == CostModel().h2d_bytes_per_s


def test_fit_needs_reports_of_the_plans() -> None:
    plans = _plans(random.Random(1), 2)
    reports = _measure(plans, TRUTH, 0.0, random.Random(1))
    with pytest.raises(CostModelError, match="no successful report matches a plan"):
        fit_cost_model([dataclasses.replace(r, plan_digest="x") for r in reports], plans)
    failed = [dataclasses.replace(r, ok=False, error="boom") for r in reports]
    with pytest.raises(CostModelError, match="no successful report"):
        fit_cost_model(failed, plans)
    empty = [dataclasses.replace(r, steps=()) for r in reports]
    with pytest.raises(CostModelError, match="no measured phase"):
        fit_cost_model(empty, plans)


def test_measured_terms_make_the_prior_a_calibration_refines() -> None:
    base = CostModel(protocol_efficiency=0.8)
    probes = {"control_round_trip_s": 2e-3, "memcpy_bytes_per_s": 4e9}
    probes.update(per_tensor_s=1e-5, per_bucket_s=3e-4)
    prior = base.with_measured_terms(**probes)
    assert (prior.control_round_trip_s, prior.per_tensor_s, prior.per_bucket_s) == (2e-3, 1e-5, 3e-4)
    assert prior.memcpy_bytes_per_s == prior.load_bytes_per_s == 4e9  # a host copy stands for the load
    assert (prior.inter_node_bytes_per_s, prior.protocol_efficiency) == (base.inter_node_bytes_per_s, 0.8)
    assert prior.source == "calibrate(): control round trip 2 ms, memcpy 4 GB/s, 10 us/tensor, 300 us/bucket"
    wired = base.with_measured_terms(**probes, broadcast_bytes_per_s=9e8)
    assert wired.inter_node_bytes_per_s == wired.intra_node_bytes_per_s == 9e8
    assert wired.protocol_efficiency == 1.0  # the protocol's rate as measured: efficiency is in it
    assert wired.source.endswith(", broadcast 0.9 GB/s")
    with pytest.raises(CostModelError, match="memcpy_bytes_per_s must be a positive finite number"):
        base.with_measured_terms(**{**probes, "memcpy_bytes_per_s": 0.0})
    rng = random.Random(3)
    plans = _plans(rng, 8)
    reports = _measure(plans, TRUTH, 0.0, rng)
    refined = fit_cost_model(reports, plans, prior)
    assert refined.source.startswith(f"{prior.source}; then fit_cost_model: NNLS over ")
    assert refined.source.count(prior.source) == 1  # the prior's source is named once, first
    assert "(unfitted terms: defaults)" in fit_cost_model(reports, plans).source


@st.composite
def gpu_layouts(draw: st.DrawFn) -> tuple[list[SyncProcess], str]:
    nodes = draw(st.integers(1, 4))
    gpu = draw(st.booleans())
    procs = []
    for i in range(draw(st.integers(1, 4))):
        node = f"n{draw(st.integers(0, nodes - 1))}"
        procs.append(SyncProcess(f"t{i}", "trainer", node, "cuda:0" if gpu else "cpu"))
    strategy = draw(st.sampled_from(["None", "Double", "Shared", "Sharded"]))
    count = draw(st.integers(1, 9))
    for i in range(count):
        shard = (i % 3, 3) if strategy == "Sharded" else None
        device = f"cuda:{i % 8}" if gpu else "cpu"
        procs.append(SyncProcess(f"r{i}", "rollout", f"n{draw(st.integers(0, nodes - 1))}", device, shard))
    return procs, strategy


@settings(max_examples=150, deadline=None)
@given(gpu_layouts(), st.integers(1, 12), st.sampled_from(["H100", "H20", None]))
def test_every_plan_is_at_or_above_its_lower_bound(
    layout: tuple[list[SyncProcess], str], n_buckets: int, profile: str | None
) -> None:
    procs, strategy = layout
    cost = HARDWARE_PROFILES[profile] if profile else None
    for fanout in ("auto", "direct", "node_buffer"):
        plan = plan_sync(procs, [8 * MiB] * n_buckets, strategy, cost=cost, fanout=fanout)  # type: ignore[arg-type]
        assert plan.predicted_seconds >= plan.lower_bound_seconds
    seed = seed_sync_plan(procs, [8 * MiB] * n_buckets, strategy, cost=cost)
    assert seed.predicted_seconds >= seed.lower_bound_seconds == plan.lower_bound_seconds


def _zeroed(report: SyncReport, phases: tuple[str, ...] = MEASURED_PHASES) -> SyncReport:
    steps = tuple(
        dataclasses.replace(s, phases={k: 0.0 if k in phases else v for k, v in s.phases.items()})
        for s in report.steps
    )
    return dataclasses.replace(report, steps=steps)


def test_an_all_zero_fit_is_refused_naming_what_cannot_be_right() -> None:
    rng = random.Random(5)
    plans = _plans(rng, 4)
    zeros = [_zeroed(r) for r in _measure(plans, TRUTH, 0.0, rng)]
    with pytest.raises(CostModelError, match=r"no measurement can be right.*step 0 pack=0\.0 \(zero\)"):
        fit_cost_model(zeros, plans)


def test_zero_phases_are_ignored_and_listed_and_the_rest_still_fit() -> None:
    rng = random.Random(7)
    plans = _plans(rng, 16)
    reports = _measure(plans, TRUTH, 0.0, rng)
    spoiled = [_zeroed(reports[0], ("wire",)), *reports[1:]]
    listed = r"ignored \d+ measurement\(s\).*report 0 \(v0\) step 0 wire=0\.0 \(zero\)"
    with pytest.warns(UserWarning, match=listed):
        fitted = fit_cost_model(spoiled, plans)
    assert "impossible measurement(s) ignored" in fitted.source
    for name in ("per_tensor_s", "per_bucket_s", "memcpy_s_per_byte", "inter_s_per_byte"):
        assert fitted.linear_values()[name] == pytest.approx(TRUTH.linear_values()[name], rel=1e-3), name


def _priced_on_hardware() -> list[SyncPlan]:
    """Plans on a described cluster (synthetic H100 nodes, the H100 profile): their bounds are facts."""
    topology = Topology.synthetic(3, 2)
    procs = [SyncProcess("t0", "trainer", "node0", "cuda:0"), SyncProcess("t1", "trainer", "node0", "cuda:1")]
    procs += [SyncProcess(f"r{k}", "rollout", f"node{1 + k // 2}", f"cuda:{k % 2}") for k in range(4)]
    sizes = [256 * MiB] * 8
    cost = HARDWARE_PROFILES["H100"]
    return [plan_sync(procs, sizes, s, topology=topology, cost=cost) for s in ("Double", "Shared")]


def test_a_report_faster_than_its_plans_lower_bound_is_ignored_or_refused() -> None:
    plans = _priced_on_hardware()
    cluster = plans[0].cost  # the profile with the topology's link rates: what the plans were priced on
    honest = _measure(plans, cluster, 0.0, random.Random(2))
    assert all(r.measured_seconds >= p.lower_bound_seconds for r, p in zip(honest, plans, strict=True))
    hundredfold = cluster.with_linear({k: v / 100 for k, v in cluster.linear_values().items()}, "100x")
    fast = _measure(plans, hundredfold, 0.0, random.Random(2))
    assert fast[1].measured_seconds < plans[1].lower_bound_seconds
    with pytest.warns(UserWarning, match=r"report 1 \(v1\): measured .* faster than its plan's lower bound"):
        fit_cost_model([honest[0], fast[1]], plans, cluster)
    with pytest.raises(CostModelError, match="faster than its plan's lower bound"):
        fit_cost_model(fast, plans, cluster)


def test_phase_values_that_cannot_be_measured_are_refused_when_reported() -> None:
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(SyncPlanError, match="non-negative finite number of seconds"):
            StepReport(0, 1.0, 1.0, {"wire": bad})


def test_a_direct_measurement_anchors_the_fit_instead_of_being_discarded() -> None:
    """A probe's host copy rate is one more equation: few, noisy syncs do not throw it away."""
    rng = random.Random(3)
    plans = _plans(rng, 2)
    truth = dataclasses.replace(TRUTH, memcpy_bytes_per_s=20e9)  # the syncs copy fast (in cache)
    reports = _measure(plans, truth, 0.3, rng)
    free = fit_cost_model(reports, plans)
    probe = 5e9  # what the probe measured on a copy larger than any cache
    anchored = fit_cost_model(reports, plans, anchors={"memcpy_s_per_byte": 1.0 / probe})
    assert "anchored on measured memcpy_s_per_byte" in anchored.source
    assert abs(math.log(anchored.memcpy_bytes_per_s / probe)) < abs(math.log(free.memcpy_bytes_per_s / probe))
    with pytest.raises(CostModelError, match=r"unknown anchor\(s\) \['memcpy_bytes_per_s'\]"):
        fit_cost_model(reports, plans, anchors={"memcpy_bytes_per_s": probe})
    with pytest.raises(CostModelError, match="positive finite measurement"):
        fit_cost_model(reports, plans, anchors={"memcpy_s_per_byte": 0.0})
