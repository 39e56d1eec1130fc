"""The seed's ``router_map`` as a view of a sync plan: for the seed's own plan it is exactly the
seed's map; for rlfleet's plans (relays, several senders) each trainer node maps to the nodes
its version reaches."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from sync_processes import MiB, R, T, cluster

from rlfleet.placement import SyncProcess, plan_sync, seed_sync_plan


def seed_router_map(procs: list[SyncProcess]) -> dict[str, list[str]]:
    """The seed's classification (train-only, eval-only, mixed nodes) and round-robin deal."""
    roles: dict[str, set[str]] = {}
    for p in procs:
        roles.setdefault(p.node, set()).add(p.role)
    train = [n for n, r in roles.items() if r == {"trainer"}]
    evals = [n for n, r in roles.items() if r == {"rollout"}]
    mixed = [n for n, r in roles.items() if r == {"trainer", "rollout"}]
    out: dict[str, list[str]] = {n: [n] for n in mixed}
    owners = train or mixed
    for i, node in enumerate(evals):
        out.setdefault(owners[i % len(owners)], []).append(node)
    return out


@st.composite
def layouts(draw: Any) -> list[SyncProcess]:
    nodes = draw(st.integers(1, 5))
    procs = [T(f"t{i}", f"n{draw(st.integers(0, nodes - 1))}") for i in range(draw(st.integers(1, 4)))]
    procs += [R(f"r{i}", f"n{draw(st.integers(0, nodes - 1))}") for i in range(draw(st.integers(1, 8)))]
    return procs


@settings(max_examples=100, deadline=None)
@given(layouts(), st.sampled_from(["None", "Double", "Shared"]))
def test_the_seed_plans_router_map_is_the_seeds(procs: list[SyncProcess], strategy: str) -> None:
    plan = seed_sync_plan(procs, [MiB] * 3, strategy)
    assert plan.router_map() == seed_router_map(procs)


def test_relayed_nodes_count_for_the_trainer_node_that_fed_them() -> None:
    procs = cluster(2)  # n0: t0 + r0; nt1: t1; n1, n2: rollout workers
    plan = plan_sync(procs, [MiB] * 6, "Double")
    mapping = plan.router_map()
    reached = {n for nodes in mapping.values() for n in nodes}
    assert reached == {"n0", "n1", "n2"}  # every rollout node, once the relays are followed
    assert set(mapping) <= {"n0", "nt1"}  # keys are trainer nodes only
    assert mapping.get("n0", ["n0"])[0] == "n0"  # a mixed node lists itself first, as the seed's
