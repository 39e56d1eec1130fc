"""create_router: the seed's factory and our names."""

from __future__ import annotations

from typing import Any

import pytest

from rlfleet.routing import (
    ROLLOUT_MODES,
    ROUTER_TYPES,
    ConsistentHashRouter,
    LeastLoadRouter,
    NodeAffinityRouter,
    PowerOfTwoRouter,
    RoundRobinRouter,
    create_router,
)

DIST = {"n0": {"env": {"ids": [0]}, "eval": {"ids": [0]}}, "n1": {"env": {"ids": [1]}, "eval": {"ids": [1]}}}


class ResourceManager:
    """Stands in for the seed's global resource manager: it only hands out the distribution."""

    def get_component_distribution(self) -> dict[str, Any]:
        return DIST


@pytest.mark.parametrize("mode", ROLLOUT_MODES)
@pytest.mark.parametrize(
    ("router_type", "cls"),
    [
        ("simple", LeastLoadRouter),
        ("least_load", LeastLoadRouter),
        ("round_robin", RoundRobinRouter),
        ("power_of_two", PowerOfTwoRouter),
        ("consistent_hash", ConsistentHashRouter),
    ],
)
def test_every_type_in_every_mode(mode: str, router_type: str, cls: type) -> None:
    r = create_router(mode, router_type, workers=["a", "b"])
    assert type(r) is cls  # async mode honours router_type (the seed ignores it)
    assert r.workers == ["a", "b"]


@pytest.mark.parametrize("mode", ROLLOUT_MODES)
def test_node_affinity_from_the_seed_inputs(mode: str) -> None:
    r = create_router(
        mode, "node_affinity", eval_policies=["p0", "p1"], global_resource_manager=ResourceManager()
    )
    assert isinstance(r, NodeAffinityRouter)
    assert r.select("env-1") == "p1"
    r2 = create_router(mode, "node_affinity", ["p0", "p1"], component_distribution=DIST)
    assert r2.select("env-0") == "p0"
    r3 = create_router(mode, "node_affinity", ["p0"], key_to_node={"k": "n"}, worker_nodes={"p0": "n"})
    assert r3.select("k") == "p0"


def test_keyword_arguments_reach_the_router() -> None:
    r = create_router("async", "power_of_two", range(3), seed=5, max_in_flight=2, prefer_newest_version=False)
    assert isinstance(r, PowerOfTwoRouter)
    assert r.max_in_flight == 2
    assert not r.prefer_newest_version


def test_bad_inputs_name_the_offender_and_the_valid_choices() -> None:
    with pytest.raises(ValueError, match=r"'batch'.*sync, async"):
        create_router("batch", "simple")
    with pytest.raises(ValueError, match=r"'fastest'.*simple, node_affinity, round_robin"):
        create_router("sync", "fastest")
    with pytest.raises(ValueError, match="component_distribution"):
        create_router("sync", "node_affinity", ["p0"])
    with pytest.raises(ValueError, match="empty component_distribution"):
        create_router("sync", "node_affinity", ["p0"], component_distribution={})
    with pytest.raises(ValueError, match="only apply to router_type 'node_affinity'"):
        create_router("sync", "simple", ["p0"], component_distribution=DIST)
    with pytest.raises(ValueError, match="either workers or eval_policies"):
        create_router("sync", "simple", ["p0"], eval_policies=["p1"])
    with pytest.raises(TypeError):
        create_router("sync", "simple", ["p0"], no_such_option=1)
    assert set(ROUTER_TYPES) >= {"simple", "node_affinity"}
