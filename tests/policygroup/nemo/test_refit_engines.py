"""`connect_sglang_rollout_engines` (NeMo RL), generic: rollout engines by GPU counts and offsets
form the receiving side of the refit group; engine ranks that speak only weightsync receive each
version bit-exact in the bf16 they serve (the trainers' fp32 cast once, on the way); an engine
lost mid-group fails the refit and keeps every previous version."""

from __future__ import annotations

from typing import Any

import pytest
import refit_engine_procs as procs
import torch
from pg_policies import Tiny

from rlfleet.policygroup import CommGroupError, PolicyConfig, RolloutEngines
from rlfleet.weightsync import Layout

Results = dict[tuple[str, tuple[int, int]], dict[str, Any]]
TRAINERS = [("trainer", (0, 0)), ("trainer", (1, 0))]
ENGINES = [("engine", e) for e in procs.ENGINES]


@pytest.fixture(scope="module")
def results() -> Results:
    return procs.run()


@pytest.mark.timeout(300)
def test_engines_receive_each_version_bit_exact(results: Results) -> None:
    for key in ENGINES:
        for version in (1, 2):
            assert results[key][f"v{version}"] == {"version": version, "exact": True}, key
    bf16 = Layout.from_state_dict(procs.build_model().state_dict(), procs.BUCKET, wire_dtype=torch.bfloat16)
    for key in TRAINERS:
        assert results[key]["v1"]["ok"]
        assert results[key]["v2"]["ok"]
        assert results[key]["v2"]["value"]["version"] == 2
    assert results[TRAINERS[0]]["v2"]["value"]["wire_bytes"] == bf16.total_bytes  # half of fp32's


@pytest.mark.timeout(300)
def test_engine_ranks_follow_counts_and_offsets(results: Results) -> None:
    # engine 0 (offset 2) is engine rank 2; engine 1 spans engine ranks 0 and 1; trainers first
    ranks = {key[1]: results[key]["member_rank"] for key in ENGINES}
    assert ranks == {(0, 0): 4, (1, 0): 2, (1, 1): 3}


@pytest.mark.timeout(300)
def test_connecting_the_same_topology_again_is_a_no_op(results: Results) -> None:
    for key in TRAINERS:
        state = results[key]["state_before_loss"]
        assert state["connects"] == 1
        assert state["refits"] == 2


@pytest.mark.timeout(300)
def test_transport_state_is_plain_json(results: Results) -> None:
    state = results[("trainer", (1, 0))]["state_before_loss"]
    assert state["engine_gpu_counts"] == procs.COUNTS
    assert state["engine_gpu_offsets"] == procs.OFFSETS
    assert state["group"]["rank"] == 1
    assert state["group"]["size"] == procs.WORLD
    assert state["group"]["prefix"] == RolloutEngines.describe(2, procs.COUNTS, procs.OFFSETS).prefix
    assert state["version"] == 2
    assert state["bucket_bytes"] == procs.BUCKET
    assert state["broken"] is None
    collective = results[("trainer", (0, 0))]["state"]["collective"]
    assert collective == {
        "address": collective["address"],
        "world_size": procs.WORLD,
        "train_world_size": 2,
        "rank": 0,
        "backend": "gloo",
    }


@pytest.mark.timeout(300)
def test_a_lost_engine_fails_the_refit_and_nothing_moves(results: Results) -> None:
    for key in TRAINERS:
        out = results[key]
        assert out["v3"]["type"] == "PeerLostError", out["v3"]
        assert out["version_after_loss"] == 2
        assert out["state"]["broken"].startswith("PeerLostError")
        assert out["v4"]["type"] == "CommGroupError"  # connect again first
        assert "connect_sglang_rollout_engines() again" in out["v4"]["message"]
    for key in ENGINES:
        if key[1] != procs.DYING:
            assert not results[key]["v3"]["ok"]
            assert results[key]["kept_v2"]


@pytest.mark.timeout(300)
def test_a_recovered_engine_is_connected_anew_and_receives(results: Results) -> None:
    for key in TRAINERS:
        assert results[key]["v3_again"]["ok"], results[key]["v3_again"]
        state = results[key]["state_recovered"]
        assert (state["connects"], state["version"], state["broken"]) == (2, 3, None)
    for key in [*ENGINES, ("recovered", procs.DYING)]:
        if key != ("engine", procs.DYING):
            assert (results[key]["v3_again"], results[key]["exact"]) == (3, True), key


def test_connect_needs_init_collective_first() -> None:
    policy = Tiny(PolicyConfig(), role="train", device="cpu")
    with pytest.raises(CommGroupError, match="init_collective"):
        policy.connect_sglang_rollout_engines(engine_gpu_counts=[1])
    with pytest.raises(CommGroupError, match="connect_sglang_rollout_engines"):
        policy.refit_rollout_engines()


@pytest.mark.parametrize(
    ("counts", "offsets", "match"),
    [
        ([], None, "at least one"),
        ([0], None, ">= 1"),
        ([2, 1], [0], "2 engines"),
        ([2, 2], [0, 1], "belongs to engines 0 and 1"),
        ([1, 1], [0, 2], r"\[1\] belong to no engine"),
        ("22", None, "list of ints"),
        ([True], None, ">= 1"),
    ],
)
def test_engine_topology_is_checked(counts: Any, offsets: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RolloutEngines.describe(2, counts, offsets)


def test_default_offsets_place_engines_one_after_another() -> None:
    topology = RolloutEngines.describe(3, [2, 1, 4])
    assert topology.gpu_offsets == (0, 2, 3)
    assert topology.size == 10
    assert [topology.member_rank(2, r) for r in range(4)] == [6, 7, 8, 9]
    assert topology.prefix != RolloutEngines.describe(3, [2, 1, 4], [5, 4, 0]).prefix
