"""NodeAffinityRouter and the seed's component_distribution helpers."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rlfleet.routing import (
    EnvAffinity,
    NodeAffinityRouter,
    env_affinity,
    env_nodes_from_distribution,
    parse_env_index,
    worker_nodes_from_distribution,
)

# The seed's shape: {node: {"env": {"ids": [...]}, "eval": {"ids": [...]}}}.
DIST: dict[str, dict[str, Any]] = {
    "node-A": {"env": {"ids": [0, 1]}, "eval": {"ids": [0, 1]}},
    "node-B": {"env": {"ids": ["2", "3"]}, "eval": {"ids": [2]}},
    "node-C": {"train": {"ids": [0]}},
}
POLICIES = ["p0", "p1", "p2", "p3"]  # p3 is on no node


def test_parse_env_index_as_the_seed() -> None:
    assert parse_env_index("env-12") == 12
    assert parse_env_index("my-env-3") == 3
    assert parse_env_index("7") == 7
    assert parse_env_index(5) == 5
    assert parse_env_index("env-x") is None
    assert parse_env_index("env") is None
    assert parse_env_index(None) is None
    assert parse_env_index(True) is None
    assert parse_env_index(("env", 1)) is None


def test_distribution_helpers() -> None:
    assert env_nodes_from_distribution(DIST) == {0: "node-A", 1: "node-A", 2: "node-B", 3: "node-B"}
    assert worker_nodes_from_distribution(DIST, POLICIES) == {"p0": "node-A", "p1": "node-A", "p2": "node-B"}
    aff = env_affinity(DIST)
    assert isinstance(aff, EnvAffinity)
    assert aff("env-3") == "node-B"
    assert aff("env-9") is None
    assert aff("no-index") is None
    assert "node-A" in repr(aff)


@pytest.mark.parametrize(
    ("dist", "match"),
    [
        ({"n": {"env": {"ids": ["x"]}}}, "'x'"),
        ({"n": {"env": {"ids": [0]}}, "m": {"env": {"ids": [0]}}}, "two nodes"),
        ({"n": ["env"]}, "must be a mapping"),
        ({"n": {"env": [0]}}, "must be a mapping"),
    ],
)
def test_bad_env_placement_names_the_culprit(dist: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        env_nodes_from_distribution(dist)


@pytest.mark.parametrize(
    ("dist", "match"),
    [
        ({"n": {"eval": {"ids": [9]}}}, "worker 9"),
        ({"n": {"eval": {"ids": [0]}}, "m": {"eval": {"ids": [0]}}}, "two nodes"),
        ({"n": {"eval": {"ids": [None]}}}, "None"),
    ],
)
def test_bad_eval_placement_names_the_culprit(dist: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        worker_nodes_from_distribution(dist, POLICIES)


def test_keys_stay_on_their_node_least_loaded_first() -> None:
    r = NodeAffinityRouter.from_component_distribution(POLICIES, DIST)
    assert r.node("p0") == "node-A"
    assert r.node("p3") is None
    assert r.node_for("env-2") == "node-B"
    assert r.node_for(None) is None
    assert set(r.nodes) == {"node-A", "node-B", None}
    assert r.assign(["env-0", "env-1", "env-0", "env-1"]) == ["p0", "p1", "p0", "p1"]
    assert r.assign(["env-2", "env-3", "env-2"]) == ["p2", "p2", "p2"]
    r.release("p1")
    assert r.select("env-0") == "p1"


def test_fallback_goes_to_the_least_loaded_candidate_anywhere() -> None:
    r = NodeAffinityRouter.from_component_distribution(POLICIES, DIST)
    r.assign(["env-0", "env-1", "env-2"])  # p0, p1, p2 hold one each
    # Unknown env, no key: the global least loaded is p3 (on no node).
    assert r.select("env-99") == "p3"
    assert r.select(None) == "p0"
    # Every worker of node B draining: its keys go elsewhere.
    r.set_draining("p2", True)
    assert r.select("env-2") in {"p1", "p3"}
    r.set_draining("p2", False)
    assert r.select("env-2") == "p2"


def test_fallback_when_the_node_is_full() -> None:
    r = NodeAffinityRouter.from_component_distribution(POLICIES, DIST, max_in_flight=1)
    assert r.select("env-2") == "p2"
    assert r.select("env-2") == "p0"  # node B full: least loaded elsewhere, lowest index first


def test_mapping_key_to_node_and_callable_worker_nodes() -> None:
    r = NodeAffinityRouter(
        ["w0", "w1", "w2", "w3"],
        key_to_node={"s1": "x", "s2": "y"},
        worker_nodes=lambda w: "x" if w in ("w0", "w1") else "y",
    )
    assert set(r.assign(["s1", "s1"])) == {"w0", "w1"}
    assert set(r.assign(["s2", "s2"])) == {"w2", "w3"}
    r.add_worker("w4", node="z")
    assert r.select("s3") == "w4"
    with pytest.raises(TypeError, match="key_to_node"):
        NodeAffinityRouter(key_to_node=42)  # type: ignore[arg-type]


def test_version_preference_and_node_affinity() -> None:
    def router(prefer: bool | str) -> NodeAffinityRouter[str]:
        r = NodeAffinityRouter(
            ["a0", "a1", "b0"],
            key_to_node={"ka": "A", "kb": "B"},
            worker_nodes={"a0": "A", "a1": "A", "b0": "B"},
            prefer_newest_version=prefer,  # type: ignore[arg-type]
        )
        r.set_version("b0", 1)
        r.set_version("a1", 1)
        return r

    # strict: the newest version first, on the key's node when it has one.
    strict = router("strict")
    assert strict.assign(["ka", "ka", "kb"]) == ["a1", "a1", "b0"]
    strict.set_version("a1", 0)
    assert strict.select("ka") == "b0"  # node A holds only the old version now
    # default: a key stays on its node, newest first there, up to the load bound.
    sticky = router(True)
    assert sticky.select("ka") == "a1"
    sticky.set_version("a1", 0)
    assert sticky.select("ka") in {"a0", "a1"}
    assert sticky.select("kb") == "b0"
    # off: least-loaded on the node, versions ignored.
    off = router(False)
    assert sorted(off.assign(["ka", "ka"])) == ["a0", "a1"]


@pytest.mark.timeout(30)
def test_a_busy_node_does_not_block_another_node() -> None:
    """Requests for node B never take node A's lock (no global lock on the hot path)."""
    r = NodeAffinityRouter(
        ["a0", "b0"], key_to_node={"ka": "A", "kb": "B"}, worker_nodes={"a0": "A", "b0": "B"}
    )
    node_a_lock = r._nodes["A"].lock
    got: list[str] = []
    with node_a_lock:  # as if a thread were in the middle of a decision on node A
        t = threading.Thread(target=lambda: (got.append(r.select("kb")), r.release("b0")))
        t.start()
        t.join(10)
        assert not t.is_alive()
    assert got == ["b0"]


def _rolling(**options: Any) -> NodeAffinityRouter[str]:
    """Issue 25 #7's cluster: 4 workers on 2 nodes in the middle of a rolling update to version 1
    (c done, b draining for its swap, a and d still at version 0)."""
    r = NodeAffinityRouter(
        ["a", "b", "c", "d"],
        key_to_node=lambda key: "n0" if str(key).startswith("n0") else "n1",
        worker_nodes={"a": "n0", "b": "n0", "c": "n1", "d": "n1"},
        **options,
    )
    r.set_draining("c", True)
    r.set_version("c", 1)
    r.set_draining("c", False)
    r.set_draining("b", True)
    return r


def test_a_key_stays_on_its_node_through_a_rolling_update() -> None:
    """Issue 25 #7: with a local, recent worker able to take it, a key never leaves its node
    (before the fix, n0's keys went to n1 once `a` passed the load bound: half of them)."""
    r = _rolling()
    held = [r.select(f"n0-{i}") for i in range(40)]  # all in flight: loads pile up on `a`
    assert set(held) == {"a"}
    n1 = [r.select(f"n1-{i}") for i in range(40)]
    assert set(n1) == {"c", "d"}  # n1: newest first up to the bound, then its older worker
    assert r.loads["c"] <= r.bound(0)
    assert r.loads["d"] > 0
    for w in held + n1:
        r.release(w)


def test_a_key_leaves_its_node_only_when_no_local_recent_worker_can_take_it() -> None:
    r = _rolling(max_in_flight=3)
    assert [r.select("n0-x") for _ in range(3)] == ["a", "a", "a"]
    assert r.select("n0-x") in {"c", "d"}  # `a` at max_in_flight: anywhere
    r = _rolling(version_lag=0)  # version 0 is not recent any more: only c is
    assert r.select("n0-x") == "c"
    r = _rolling(prefer_newest_version="strict")
    assert r.select("n0-x") == "c"  # "strict": the newest version first, wherever it runs


def test_the_rolling_update_stays_on_node_from_many_threads() -> None:
    r = _rolling()
    off_node: list[str] = []

    def client(t: int) -> None:
        for i in range(300):
            w = r.select(f"n0-{t}-{i}", timeout=10)
            if w != "a":
                off_node.append(w)
            if i % 3:
                r.release(w)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert off_node == []
