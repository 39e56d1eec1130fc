"""Reshard execution over real gloo between spawned processes: bit-exact shards for every layout
change, all-or-nothing versions, clean failures that keep the groups usable, and a timeout and a
lost peer that leave the old weights intact."""

from __future__ import annotations

import glob
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import reshard_workers as rw
import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import MetadataError, RankProgram, checksum
from rlfleet.weightsync.reshard._reshard import ReshardMessage


@pytest.fixture(autouse=True)
def _no_leftover_segments() -> Iterator[None]:
    """The reshard path creates no shared memory, and results cross the process boundary as
    bytes (torch tensors in a queue would leave torch_* segments behind)."""
    before = set(glob.glob("/dev/shm/torch_*"))
    yield
    assert set(glob.glob("/dev/shm/torch_*")) - before == set()


# -- programs and messages (no processes) --------------------------------------------------------
def _programs(case: rw.Case) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return rw.programs(rw.model(case.fused_train), rw.model(case.fused_gen), case.train, case.gen)


def test_both_ends_of_a_pair_cut_the_same_messages() -> None:
    train, gen = _programs(rw.CASES[2])
    sent: dict[tuple[int, int, int], ReshardMessage] = {}
    for prog in train:
        for m in RankProgram.from_dict(prog).messages(rw.BUCKET, rw.DIRECT_MIN):
            sent[(m.src, m.dst, m.index)] = m
    got = {
        (m.src, m.dst, m.index): m
        for prog in gen
        for m in RankProgram.from_dict(prog).messages(rw.BUCKET, rw.DIRECT_MIN)
    }
    assert sent == got
    kinds = {len(m.items) > 1 for m in got.values()}
    assert kinds == {True, False}  # packed buckets and direct slices both occur
    for m in got.values():
        assert m.nbytes <= rw.BUCKET or len(m.items) == 1
        for t, offset in m.items:
            assert offset % t.itemsize == 0  # aligned without padding
        assert sum(t.nbytes for t, _ in m.items) == m.nbytes


def test_messages_follow_one_global_order() -> None:
    train, _ = _programs(rw.CASES[2])
    msgs = RankProgram.from_dict(train[0]).messages(rw.BUCKET, rw.DIRECT_MIN)
    assert [m.order for m in msgs] == sorted(m.order for m in msgs)


def test_program_round_trips_and_rejects_garbage() -> None:
    _, gen = _programs(rw.CASES[0])
    prog = RankProgram.from_dict(gen[0])
    assert RankProgram.coerce(prog.to_dict()) == prog
    assert prog.nbytes == sum(
        t.numel() * t.element_size()
        for t in rw.local_state(rw.model(), rw.full_pieces(rw.model(), 0), rw.CASES[0].gen, 0).values()
    )
    bad = dict(gen[0], transfers=[[*gen[0]["transfers"][0][:8], 999, "bfloat16"]])
    with pytest.raises(MetadataError, match="the plan says 999"):
        RankProgram.from_dict(bad)
    wrong_rank = dict(gen[0], rank=0, transfers=[[0, 5, "embed", "embed", 0, 0, 0, 1, 128, "bfloat16"]])
    with pytest.raises(MetadataError, match=r"outside the worlds|does not involve"):
        RankProgram.from_dict(wrong_rank)
    with pytest.raises(MetadataError, match="not valid JSON"):
        RankProgram.coerce(b"{nope")


def _gen_program(transfers: list[list[Any]]) -> dict[str, Any]:
    return {
        "format": 1,
        "role": "gen",
        "rank": 0,
        "train_world_size": 2,
        "gen_world_size": 1,
        "digest": "plan",
        "tensors": [["w", [4, 3], "float32"], ["b", [3], "float32"]],
        "transfers": [*transfers, [0, 0, "b", "b", None, 0, 0, 1, 12, "float32"]],
    }


def test_a_program_that_leaves_rows_uncovered_is_refused_and_nothing_commits() -> None:
    from rlfleet.weightsync import DoubleBuffer, ReshardReceiver

    half = [[0, 0, "w", "w", 0, 0, 0, 2, 24, "float32"]]  # rows 0..2 of 4: rows 2..4 never sent
    with pytest.raises(MetadataError, match=r"\[2:4\] of 'w' \(4, 3\) along dim 0 is covered by no transfer"):
        RankProgram.from_dict(_gen_program(half))
    consumer = DoubleBuffer({"w": torch.zeros(4, 3), "b": torch.zeros(3)})
    with pytest.raises(MetadataError, match="covered by no transfer"):
        ReshardReceiver(_gen_program(half), [])
    assert consumer.version == -1
    nothing = _gen_program([])
    nothing["transfers"] = nothing["transfers"][:0]
    with pytest.raises(MetadataError, match="no transfer writes 'w'"):
        RankProgram.from_dict(nothing)


@pytest.mark.parametrize(
    "transfers",
    [
        [[0, 0, "w", "w", 0, 0, 0, 2, 24, "float32"], [1, 0, "w", "w", 0, 0, 2, 2, 24, "float32"]],
        [[0, 0, "w", "w", 1, 0, 0, 1, 16, "float32"], [1, 0, "w", "w", 1, 0, 1, 2, 32, "float32"]],
        [[0, 0, "w", "w", None, 0, 0, 4, 48, "float32"]],
    ],
)
def test_programs_that_cover_every_element_are_accepted(transfers: list[list[Any]]) -> None:
    program = RankProgram.from_dict(_gen_program(transfers))
    assert program.nbytes == 48 + 12


# -- one world of 8 processes runs every case --------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    spill = tmp_path_factory.mktemp("reshard")
    results = w.run_ranks(rw.scenario_all, 8, str(spill), timeout=150.0, expect_dead=(rw.LOST_RANK,))
    assert rw.LOST_RANK not in results
    with open(spill / f"{rw.LOST_RANK}.pickle", "rb") as f:  # what it did before it died
        results[rw.LOST_RANK] = pickle.load(f)
    return results


def _gens(runs: dict[int, Any], case: str) -> dict[int, Any]:
    return {r: v[case] for r, v in runs.items() if case in v and v[case]["role"] == "gen"}


def _trains(runs: dict[int, Any], case: str) -> dict[int, Any]:
    return {r: v[case] for r, v in runs.items() if case in v and v[case]["role"] == "train"}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", [c.name for c in rw.CASES])
def test_every_layout_change_is_bit_exact(runs: dict[int, Any], case: str) -> None:
    spec = next(c for c in rw.CASES if c.name == case)
    gens = _gens(runs, case)
    trains = _trains(runs, case)
    assert len(gens) == spec.gen.world
    assert len(trains) == spec.train.world
    last = "v3" if case == "tp2dp2_to_tp4" else "v2"
    for g in gens.values():
        for step in ("v1", "v2", last):
            assert g[step]["ok"], g[step]
            assert g[step]["exact"], step
        assert g[last]["value"] == {"kv_scales": {"k": 0.5}}
        assert g[last]["applied"] == int(last[1])
        # each generation rank received exactly its own shard
        assert g["received_bytes"] == g["own_bytes"]
    for t in trains.values():
        assert t["v1"]["ok"], t["v1"]
    # against the unsharded model: reassemble the generation shards
    gen_specs = rw.model(spec.fused_gen)
    shards = {rank - spec.train.world: rw.decode(g["shard"]) for rank, g in gens.items()}
    rebuilt = rw.assemble(gen_specs, spec.gen, shards)
    assert checksum(rebuilt) == checksum(rw.full_pieces(gen_specs, int(last[1])))


@pytest.mark.timeout(200)
def test_landing_in_the_consumers_own_storage(runs: dict[int, Any]) -> None:
    gens = _gens(runs, "tp2dp2_to_tp4")
    assert gens[5]["landed_in_place"] > 0  # gen rank 1 offers BucketTarget


@pytest.mark.timeout(200)
def test_stale_version_is_rejected_everywhere_and_nothing_applies(runs: dict[int, Any]) -> None:
    for g in _gens(runs, "tp2dp2_to_tp4").values():
        assert not g["stale"]["ok"]
        assert g["stale"]["type"] == "VersionError"
        assert g["stale"]["intact"]
    for t in _trains(runs, "tp2dp2_to_tp4").values():
        assert t["stale"]["type"] == "VersionError", t["stale"]


@pytest.mark.timeout(200)
def test_sender_failure_mid_stream_aborts_on_all_and_keeps_the_group(runs: dict[int, Any]) -> None:
    for g in _gens(runs, "tp2dp2_to_tp4").values():
        step = g["sender_fails"]
        assert step["type"] == "SyncAbortedError", step
        assert "train rank 1" in step["message"]
        assert step["intact"]
        assert step["applied"] == 2
    trains = _trains(runs, "tp2dp2_to_tp4")
    assert "failed to read embed" in trains[1]["sender_fails"]["message"]
    assert all(t["broken"] is None for t in trains.values())


@pytest.mark.timeout(200)
def test_a_commit_that_cannot_happen_is_refused_before_the_vote(runs: dict[int, Any]) -> None:
    gens = _gens(runs, "tp2dp2_to_tp4")
    stuck = gens[4]["stuck_request"]  # generation rank 0: a request holds its serving lock
    assert stuck["type"] == "SyncTimeoutError", stuck
    assert "in-flight requests" in stuck["message"]
    for g in gens.values():
        assert not g["stuck_request"]["ok"]
        assert g["stuck_request"]["intact"]  # every generation rank keeps version 2
        assert g["stuck_request"]["applied"] == 2
        assert g["broken"] is None
    for t in _trains(runs, "tp2dp2_to_tp4").values():
        assert t["stuck_request"]["type"] == "SyncAbortedError", t["stuck_request"]
        assert "gen rank 0 could not prepare its commit" in t["stuck_request"]["message"]


@pytest.mark.timeout(200)
def test_generation_layout_mismatch_names_the_parameter(runs: dict[int, Any]) -> None:
    gens = _gens(runs, "tp2dp2_to_tp4")
    bad = gens[6]["gen_layout"]
    assert bad["type"] == "LayoutMismatchError"
    assert bad["parameter"] == "head"
    for g in gens.values():
        assert g["gen_layout"]["intact"]
        assert not g["gen_layout"]["ok"]
        assert g["broken"] is None
    for t in _trains(runs, "tp2dp2_to_tp4").values():
        assert t["gen_layout"]["type"] == "LayoutMismatchError"
        assert "gen rank 2" in t["gen_layout"]["message"]


@pytest.mark.timeout(200)
def test_timeout_mid_stream_leaves_old_weights_intact(runs: dict[int, Any]) -> None:
    (gen,) = _gens(runs, "timeout").values()
    step = gen["stall"]
    assert step["type"] == "SyncTimeoutError", step
    assert step["intact"]
    assert step["applied"] == 1
    assert gen["broken"] is not None
    trains = _trains(runs, "timeout")
    assert all(not t["stall"]["ok"] for t in trains.values())
    assert {t["stall"]["type"] for t in trains.values()} <= {"PeerLostError", "SyncTimeoutError"}


@pytest.mark.timeout(200)
def test_lost_sender_is_a_peer_lost_error_and_old_weights_stay(runs: dict[int, Any]) -> None:
    (gen,) = _gens(runs, "lost").values()
    assert gen["v1"]["exact"]
    assert gen["lost"]["type"] == "PeerLostError", gen["lost"]
    assert gen["lost"]["intact"]
    assert gen["lost"]["applied"] == 1
    assert gen["broken"] is not None
    assert "lost" not in runs[rw.LOST_RANK]


def test_shards_of_the_test_model_are_what_the_reference_says() -> None:
    specs = rw.model()
    pieces = rw.full_pieces(specs, 1)
    par = rw.Par(tp=2)
    shards = {r: rw.local_state(specs, pieces, par, r) for r in range(2)}
    assert shards[1]["layers.0.qkv"].shape == (64, 64)
    assert torch.equal(shards[1]["layers.0.qkv"][:32], pieces["layers.0.q"][32:])
    assert checksum(rw.assemble(specs, par, shards)) == checksum(pieces)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["torch", "cupy"])
def test_reshard_over_nccl_on_two_gpus(transport: str) -> None:
    if transport == "cupy":
        pytest.importorskip("cupy")
    results = w.run_ranks(rw.scenario_gpu, 2, transport, timeout=200.0)
    assert results[0]["v1"]["ok"], results[0]
    for step in ("v1", "v2"):
        assert results[1][step]["ok"], results[1][step]
        assert results[1][step]["exact"]


@pytest.mark.timeout(200)
def test_extras_that_cannot_travel_abort_cleanly(runs: dict[int, Any]) -> None:
    trains = _trains(runs, "tp2dp2_to_tp4")
    assert trains[0]["bad_extras"]["type"] == "SyncAbortedError"
    assert "extras cannot travel" in trains[0]["bad_extras"]["message"]
    for g in _gens(runs, "tp2dp2_to_tp4").values():
        assert g["bad_extras"]["type"] == "SyncAbortedError"
        assert "extras cannot travel" in g["bad_extras"]["message"]
        assert g["bad_extras"]["intact"]
        assert g["v3"]["ok"]  # the group stayed usable
