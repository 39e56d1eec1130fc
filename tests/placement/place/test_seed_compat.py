"""The seed-compatible planners give the seed's output for every input the seed accepts."""

from __future__ import annotations

from typing import Any

import placement_seed_reference as seed
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.placement import (
    ColocatedSizeError,
    EmptyEvalNodeError,
    Placement,
    PlacementError,
    WorkerPlacement,
    build_transfer_info_for_colocated,
    build_transfer_info_for_disaggregated,
)


class Policy:
    """Stands for an actor handle: equality is identity, as for real handles."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Policy({self.name})"


POOL = [Policy(f"p{i}") for i in range(12)]
policy_lists = st.lists(st.sampled_from(POOL), max_size=4)
placement_infos = st.dictionaries(
    st.sampled_from([f"node{i}" for i in range(7)] + ["local"]),
    st.fixed_dictionaries({"train_policies": policy_lists, "eval_policies": policy_lists}),
    max_size=7,
)
strategies = st.sampled_from(["None", "Double", "Shared", "Sharded", "bogus"])


def same(a: Any, b: Any) -> bool:
    """Structural equality that also checks dict key order and object identity of leaves."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Policy):
        return a is b
    return type(a) is type(b) and a == b


def outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:  # the oracle's failures are part of the behaviour
        return "raised", exc


@settings(max_examples=400, deadline=None)
@given(placement_infos, strategies)
def test_disaggregated_matches_seed(placement_info: dict[str, Any], strategy: str) -> None:
    kind, expected = outcome(seed.build_transfer_info_for_disaggregated, placement_info, strategy)
    if kind == "ok":
        got = build_transfer_info_for_disaggregated(placement_info, strategy)
        assert same(expected, got), (expected, got)
        return
    with pytest.raises(type(expected)) as info:
        build_transfer_info_for_disaggregated(placement_info, strategy)
    if isinstance(expected, ValueError):  # the seed's message, which ours may go on to explain
        assert str(info.value).startswith(str(expected)), (str(info.value), str(expected))
    assert isinstance(info.value, ValueError)  # ours is always a ValueError (IndexError ones too)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(POOL), max_size=6), st.lists(st.sampled_from(POOL), max_size=6))
def test_colocated_matches_seed(train: list[Policy], evals: list[Policy]) -> None:
    kind, expected = outcome(seed.build_transfer_info_for_colocated, train, evals)
    if kind == "ok":
        assert same(expected, build_transfer_info_for_colocated(train, evals))
        return
    assert isinstance(expected, AssertionError)
    with pytest.raises(AssertionError) as info:
        build_transfer_info_for_colocated(train, evals)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, ColocatedSizeError)
    assert str(info.value) == str(expected)


def test_seed_quirks_are_kept() -> None:
    t0, t1, e0, e1, e2 = (Policy(n) for n in ("t0", "t1", "e0", "e1", "e2"))
    info = {
        "mixed": {"train_policies": [t0, t1], "eval_policies": [e0]},
        "evalonly": {"train_policies": [], "eval_policies": [e1, e2]},
    }
    shared = build_transfer_info_for_disaggregated(info, "Shared")
    # intra-node items get no receivers, a cross-node item names only the first eval policy
    assert shared == {
        "mixed": [
            {"sender": t0, "receiver": [], "intra_node": True},
            {"sender": t1, "receiver": [e1], "intra_node": False},
        ]
    }
    # a train-only cluster with no eval node returns {} whatever the strategy
    assert (
        build_transfer_info_for_disaggregated({"n": {"train_policies": [t0], "eval_policies": []}}, "x") == {}
    )
    # receivers are fresh lists, never the caller's
    double = build_transfer_info_for_disaggregated(info, "Double")
    assert double["mixed"][1]["receiver"] == [e1, e2]
    assert double["mixed"][1]["receiver"] is not info["evalonly"]["eval_policies"]


def test_errors() -> None:
    with pytest.raises(ValueError, match="No train policy found"):
        build_transfer_info_for_disaggregated({}, "Double")
    with pytest.raises(ValueError, match="Unsupported weight buffer strategy: Sharded"):
        build_transfer_info_for_disaggregated({"n": {"train_policies": [1], "eval_policies": [2]}}, "Sharded")
    empty = {
        "t": {"train_policies": [1], "eval_policies": []},
        "e": {"train_policies": [], "eval_policies": []},
    }
    with pytest.raises(IndexError) as info:  # what the seed raises here, with a clear message
        build_transfer_info_for_disaggregated(empty, "Shared")
    assert isinstance(info.value, EmptyEvalNodeError)
    assert "'e'" in str(info.value)
    with pytest.raises(PlacementError, match="'train_policies'"):
        build_transfer_info_for_disaggregated({"n": {"eval_policies": [1]}}, "Double")


nodes = st.sampled_from(["n0", "n1", "n2", "n3"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["train", "eval"]), nodes), max_size=12))
def test_placement_info_matches_seed_loop(workers: list[tuple[str, str]]) -> None:
    ids = [(role, i) for i, (role, _node) in enumerate(workers)]  # any hashable id works
    node_of = {wid: node for wid, (_role, node) in zip(ids, workers, strict=True)}
    placement = Placement(
        tuple(
            WorkerPlacement(wid, role, node, f"gpu{i}")
            for i, (wid, (role, node)) in enumerate(zip(ids, workers, strict=True))
        )
    )
    train = [wid for wid in ids if wid[0] == "train"]
    evals = [wid for wid in ids if wid[0] == "eval"]
    expected = seed.init_placement_info(train, evals, node_of)
    got = placement.placement_info()
    assert list(got) == list(expected)
    assert got == expected


def test_an_unknown_strategy_is_named_with_the_valid_ones() -> None:
    info = {
        "n0": {"train_policies": ["t0"], "eval_policies": []},
        "n1": {"train_policies": [], "eval_policies": ["e0"]},
    }
    seed_text = "^Unsupported weight buffer strategy: double"  # the seed's message, then the valid names
    with pytest.raises(ValueError, match=seed_text + r" \(valid: 'None', 'Double', 'Shared'\)"):
        build_transfer_info_for_disaggregated(info, "double")
