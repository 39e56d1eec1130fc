"""CostModel: validation, JSON, the pipeline formula, the linear form, hardware profiles, and the
rates a topology built for a model keeps."""

from __future__ import annotations

import json

import pytest

from rlfleet.placement import (
    HARDWARE_PROFILES,
    LINEAR_PARAMS,
    CostModel,
    CostModelError,
    SyncProcess,
    Topology,
    pipeline_seconds,
    plan_sync,
)

MiB = 2**20


def test_cost_model_checks_its_terms_and_round_trips() -> None:
    model = CostModel()
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    with pytest.raises(CostModelError, match="memcpy_bytes_per_s must be a positive finite number"):
        CostModel(memcpy_bytes_per_s=0)
    with pytest.raises(CostModelError, match="per_tensor_s must be a non-negative"):
        CostModel(per_tensor_s=float("nan"))
    with pytest.raises(CostModelError, match="protocol_efficiency must be in"):
        CostModel(protocol_efficiency=1.5)
    with pytest.raises(CostModelError, match="nics_per_node"):
        CostModel(nics_per_node=0)
    with pytest.raises(CostModelError, match="unknown CostModel field"):
        CostModel.from_dict({"bandwidth": 1})
    with pytest.raises(CostModelError, match="unknown CostModel field"):
        model.replace(speed=2)
    assert model.replace(latency_s=1.0).latency_s == 1.0


def test_pipeline_overlaps_stages_bucket_by_bucket() -> None:
    assert pipeline_seconds([1.0, 2.0, 3.0], 1) == pytest.approx(6.0)  # one bucket: the sum
    assert pipeline_seconds([1.0, 2.0, 3.0], 3) == pytest.approx(6.0 / 3 + 2 / 3 * 3.0)
    assert pipeline_seconds([1.0, 2.0, 3.0], 10**6) == pytest.approx(3.0, rel=1e-5)  # the slowest stage
    assert pipeline_seconds([], 4) == 0.0


def test_a_delta_step_pays_encode_and_apply_per_full_byte_and_the_wire_per_delta_byte() -> None:
    model = CostModel(delta_encode_bytes_per_s=4e9, delta_apply_bytes_per_s=2e9, per_bucket_s=0.0)
    # one bucket: the stages add up; 8 GB full, 80 MB of delta on a 1 GB/s wire
    assert model.delta_seconds(8e9, 8e7, 1e9) == pytest.approx(2.0 + 0.08 + 4.0)
    assert model.delta_seconds(8e9, 8e7, 1e9, buckets=100) < 4.2  # pipelined: the slowest stage
    assert model.delta_seconds(8e9, 8e7, 1e9) < 8e9 / 1e9  # beats a full 8 s sync on that wire
    assert CostModel().delta_seconds(8e9, 8e7, 1e11) > 8e9 / 1e11  # ... but not on a memory-speed one
    with pytest.raises(CostModelError, match="delta_encode_bytes_per_s"):
        CostModel(delta_encode_bytes_per_s=0)
    with pytest.raises(CostModelError, match="byte counts"):
        model.delta_seconds(-1, 0, 1e9)
    with pytest.raises(CostModelError, match="wire rate"):
        model.delta_seconds(1, 0, 0)


def test_linear_form_round_trips() -> None:
    model = HARDWARE_PROFILES["H100"]
    again = model.with_linear(model.linear_values(), "same")
    for name in LINEAR_PARAMS:
        assert again.linear_values()[name] == pytest.approx(model.linear_values()[name])
    assert again.protocol_efficiency == pytest.approx(model.protocol_efficiency)


def test_hardware_profiles_cite_their_sources() -> None:
    assert set(HARDWARE_PROFILES) == {"H100", "H200", "H20"}
    for name, profile in HARDWARE_PROFILES.items():
        assert profile.nics_per_node == 8
        assert profile.inter_node_bytes_per_s == 50e9
        assert profile.intra_node_bytes_per_s == 450e9
        assert profile.protocol_efficiency == 0.94
        assert name in profile.source
        assert "assumption" in profile.source
    assert HARDWARE_PROFILES["H200"].load_bytes_per_s > HARDWARE_PROFILES["H100"].load_bytes_per_s
    with pytest.raises(TypeError):
        HARDWARE_PROFILES["B200"] = CostModel()  # type: ignore[index]


def test_topology_overrides_keep_a_models_rates() -> None:
    model = CostModel(inter_node_bytes_per_s=3e9, latency_s=1e-4, intra_node_bytes_per_s=20e9)
    assert model.topology_overrides() == {"nic_bandwidth": 3e9, "nic_latency": 1e-4, "host_bandwidth": 20e9}
    nodes = [
        {"NodeID": name * 56, "Alive": True, "NodeManagerAddress": f"10.0.0.{i}", "Resources": {"CPU": 1.0}}
        for i, name in enumerate("ab")
    ]
    procs = [SyncProcess("t0", "trainer", "a" * 56), SyncProcess("r0", "rollout", "b" * 56)]
    topology = Topology.from_ray_nodes(nodes, model.topology_overrides())
    kept = plan_sync(procs, [MiB] * 4, "Double", topology=topology, cost=model)
    assert (kept.cost.inter_node_bytes_per_s, kept.cost.latency_s) == (3e9, 1e-4)
    fallback = plan_sync(procs, [MiB] * 4, "Double", topology=Topology.from_ray_nodes(nodes), cost=model)
    assert fallback.cost.inter_node_bytes_per_s != 3e9  # without them the topology's fallback NIC wins


def test_an_unknown_hardware_profile_lists_the_ones_there_are() -> None:
    listed = r"unknown hardware profile 'h100'.*'H100', 'H200', 'H20'.*did you mean 'H100'"
    with pytest.raises(KeyError, match=listed):
        HARDWARE_PROFILES["h100"]
    with pytest.raises(KeyError, match=r"unknown hardware profile 'B200'; known: 'H100', 'H200', 'H20'"):
        HARDWARE_PROFILES["B200"]
    assert HARDWARE_PROFILES.get("h100") is None  # a lookup that may miss still may
    assert "H100" in HARDWARE_PROFILES
    assert list(HARDWARE_PROFILES) == ["H100", "H200", "H20"]
