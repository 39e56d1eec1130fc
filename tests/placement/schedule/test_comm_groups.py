"""Comm-group plans: the seed's ranks and groups as data, one weight-transfer group per item."""

from __future__ import annotations

import json

import placement_seed_reference as seed
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.placement import (
    INTRA_NODE,
    TRAIN_DATA_PARALLEL,
    WEIGHT_TRANSFER,
    PlacementError,
    build_transfer_info_for_disaggregated,
    plan_comm_groups,
)

actors_st = st.lists(
    st.tuples(st.sampled_from(["n0", "n1", "n2", "n3"]), st.integers(0, 7)), min_size=1, max_size=16
)


@settings(max_examples=300, deadline=None)
@given(actors_st, st.integers(0, 16), st.sampled_from(["None", "Double", "Shared"]))
def test_matches_seed_init_comm_group(raw: list[tuple[str, int]], n_train: int, strategy: str) -> None:
    ids = [f"a{i}" for i in range(len(raw))]
    node_of = {a: n for a, (n, _g) in zip(ids, raw, strict=True)}
    gpu_of = {a: g for a, (_n, g) in zip(ids, raw, strict=True)}
    train, evals = ids[: min(n_train, len(ids))], ids[min(n_train, len(ids)) :]
    info = seed.init_placement_info(train, evals, node_of)
    try:
        transfer = seed.build_transfer_info_for_disaggregated(info, strategy)
    except (ValueError, IndexError):
        transfer = {}
    expected = seed.init_comm_group(ids, train, node_of, gpu_of, transfer, strategy)
    plan = plan_comm_groups(
        [(a, node_of[a], gpu_of[a]) for a in ids], transfer, train, weight_buffer_strategy=strategy
    )

    # ranks are a permutation, in the seed's order
    assert [r.rank for r in plan.ranks] == list(range(len(ids)))
    assert sorted(r.actor_id for r in plan.ranks) == sorted(ids)
    assert [r.actor_id for r in plan.ranks] == expected["sorted_actors"]
    assert [r.local_rank for r in plan.ranks] == expected["local_rank_list"]
    assert [r.local_world_size for r in plan.ranks] == expected["local_world_size_list"]
    assert plan.rendezvous_actor == expected["master"]
    assert plan.rendezvous_rank == 0
    # every creation call of the seed, in order, each its own group
    modes = {
        INTRA_NODE: "INTRA_NODE",
        WEIGHT_TRANSFER: "WEIGHT_TRANSFER",
        TRAIN_DATA_PARALLEL: "TRAIN_DATA_PARALLEL",
    }
    assert [(modes[g.mode], list(g.ranks)) for g in plan.groups] == expected["calls"]
    assert len({g.group_id for g in plan.groups}) == len(plan.groups)
    for g in plan.weight_transfer_groups:
        assert g.src_rank == g.ranks[0]
    json.dumps(plan.to_dict())


def test_a_sender_serving_several_items_keeps_every_group() -> None:
    # one train node serving three eval nodes with one trainer: the seed keeps only the last group
    info = {
        "t": {"train_policies": ["tr"], "eval_policies": []},
        "e0": {"train_policies": [], "eval_policies": ["x0", "x1"]},
        "e1": {"train_policies": [], "eval_policies": ["y0"]},
        "e2": {"train_policies": [], "eval_policies": ["z0"]},
    }
    transfer = build_transfer_info_for_disaggregated(info, "Double")
    actors = [("tr", "t", 0), ("x0", "e0", 0), ("x1", "e0", 1), ("y0", "e1", 0), ("z0", "e2", 0)]
    plan = plan_comm_groups(actors, transfer, ["tr"])
    sender = plan.rank_of("tr")
    wt = plan.weight_transfer_groups
    assert [g.ranks for g in wt] == [(0, 1, 2), (0, 3), (0, 4)]
    assert [g for g in plan.groups_of(sender) if g.mode == WEIGHT_TRANSFER] == list(wt)
    assert plan.train_group is not None
    assert plan.train_group.ranks == (0,)
    # a flat list of items works too, and colocated items with a single receiver
    flat = plan_comm_groups(actors, [{"sender": "tr", "receiver": "x1"}], [])
    assert [g.ranks for g in flat.weight_transfer_groups] == [(0, 2)]
    assert flat.train_group is None


def test_creation_calls_list_each_ranks_groups_in_order() -> None:
    info = {
        "t": {"train_policies": ["tr"], "eval_policies": []},
        "e0": {"train_policies": [], "eval_policies": ["x0", "x1"]},
        "e1": {"train_policies": [], "eval_policies": ["y0"]},
    }
    actors = [("tr", "t", 0), ("x0", "e0", 0), ("x1", "e0", 1), ("y0", "e1", 0)]
    plan = plan_comm_groups(actors, build_transfer_info_for_disaggregated(info, "Double"), ["tr"])
    every = plan.creation_calls(plan.groups)  # torch.distributed groups: each rank makes every group
    assert sorted(every) == [0, 1, 2, 3]
    order = [g.group_id for g in plan.groups]
    assert all([c["group_id"] for c in calls] == order for calls in every.values())
    wt = plan.weight_transfer_groups
    alone = plan.creation_calls(wt, registered=False)  # standalone groups: members only
    assert {r: [c["ranks"] for c in calls] for r, calls in alone.items()} == {
        0: [[0, 1, 2], [0, 3]],
        1: [[0, 1, 2]],
        2: [[0, 1, 2]],
        3: [[0, 3]],
    }
    assert alone[3][0] == {"ranks": [0, 3], "mode": WEIGHT_TRANSFER, "group_id": wt[1].group_id}
    assert plan.creation_calls([]) == {}


def test_ranks_sort_by_node_first_seen_then_gpu() -> None:
    plan = plan_comm_groups(
        [("b", "n1", 3), ("a", "n0", 5), ("c", "n1", 0), ("d", "n0", 1)], None, ["b", "a"]
    )
    assert [(r.actor_id, r.local_rank, r.local_world_size) for r in plan.ranks] == [
        ("c", 0, 2),
        ("b", 1, 2),
        ("d", 0, 2),
        ("a", 1, 2),
    ]
    assert [g.ranks for g in plan.intra_node_groups] == [(0, 1), (2, 3)]
    assert plan.train_group is not None
    assert plan.train_group.ranks == (1, 3)
    assert plan.world_size == 4
    assert plan_comm_groups([]).world_size == 0


@pytest.mark.parametrize(
    ("actors", "transfer", "train", "needle"),
    [
        ([("a", "n", 0), ("a", "n", 1)], None, [], "duplicate actor id 'a'"),
        ([("a", "n")], None, [], r"actors\[0\]"),
        ([("a", "n", 0)], [{"sender": "zz", "receiver": ["a"]}], [], "'zz'"),
        ([("a", "n", 0)], [{"sender": "a", "receiver": ["q"]}], [], "'q'"),
        ([("a", "n", 0)], [{"sender": "a"}], [], "'receiver'"),
        ([("a", "n", 0)], None, ["t9"], "'t9'"),
        ([("a", "n", 0), ("b", "n", "x")], None, [], "cannot be compared"),
    ],
)
def test_bad_input_names_the_offender(actors: list, transfer: object, train: list, needle: str) -> None:
    with pytest.raises(PlacementError, match=needle):
        plan_comm_groups(actors, transfer, train)  # type: ignore[arg-type]
