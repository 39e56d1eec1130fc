"""The policy group's parts on their own, in one process: its workers in a sync plan and call failure
classification (the Ray paths are in test_cluster; the worker's components are weightsync's and
tested in tests/weightsync/test_worker_components.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pg_policies import MLPPolicy

from rlfleet.placement import make_sync_plan, sync_processes
from rlfleet.policygroup import PolicyConfig, PolicyGroupError, PolicyRole, WeightBufferConfig
from rlfleet.policygroup.driver._calls import Calls, Roster, vagueness
from rlfleet.policygroup.sync._plan import Processes, plan_for
from rlfleet.weightsync import Layout, LayoutMismatchError


def _processes(strategy: str, n_train: int = 2) -> tuple[list[Any], list[Any], Processes]:
    """Trainers on nodes A and B, rollout workers on A, B and (two) C, located without a call."""
    config = PolicyConfig(weight_buffer=WeightBufferConfig(buffer_strategy=strategy, type=KIND[strategy]))
    train = [MLPPolicy(config, role="train", index=i) for i in range(n_train)]
    evals = [MLPPolicy(config, index=i) for i in range(4)]
    roster = Roster(train, evals)
    processes = Processes(roster, Calls(roster, 10.0, lambda: []))
    for policy, node in zip(train + evals, "AB"[:n_train] + "ABCC", strict=True):
        processes.node_of[roster.wid(policy)] = node  # located: no call to the workers
        processes.gpu_of[roster.wid(policy)] = -1
        processes.ip_of[roster.wid(policy)] = f"host-{node}"  # one machine per node
    return train, evals, processes


KIND = {"Double": "WeightBuffer", "Shared": "CPUWeightBuffer", "Sharded": "ShardedWeightBuffer"}


def _plan(strategy: str, actors: bool = False, **wb: Any) -> tuple[list[Any], list[Any], Processes, Any]:
    train, evals, processes = _processes(strategy)
    config = PolicyConfig(
        weight_buffer=WeightBufferConfig(
            buffer_strategy=strategy, type=KIND[strategy], bucket_bytes=1024, **wb
        )
    )
    layout = train[0].get_weight_layout(1024)
    plan = plan_for(processes.sync_processes(strategy), layout, config, False, actors)
    return train, evals, processes, plan


def test_the_plan_is_placements_over_the_group_processes() -> None:
    """How placement chooses and wires a plan is tested in tests/placement/test_sync_wiring.py;
    here: the group's workers reach it with their stable ids, sites and layout."""
    train, evals, processes, plan = _plan("Sharded")
    assert [processes.pid(p) for p in train + evals] == ["t0", "t1", "r0", "r1", "r2", "r3"]
    sites = [(p.id, p.role, p.node, -1, f"host-{p.node}") for p in plan.processes]
    expected = make_sync_plan(sync_processes(sites, "Sharded"), plan.bucket_bytes, "Sharded")
    assert [s.signature() for s in plan.steps] == [s.signature() for s in expected.steps]
    assert {p.id: p.shard for p in plan.rollouts} == {"r0": (0, 1), "r1": (0, 1), "r2": (0, 2), "r3": (1, 2)}
    assert plan.layout_digest == Layout.from_dict(train[0].get_weight_layout(1024)).digest
    assert plan.topology_source.startswith("fallback")  # no Ray here: priced on the documented defaults
    assert _plan("Double", planner="seed")[3].name == "seed"
    with pytest.raises(PolicyGroupError, match="weight_buffer: cuda_ipc 'host' needs Ray actors"):
        _plan("Double", cuda_ipc="host")
    forced = _plan("Double", actors=True, cuda_ipc="host")[3]  # every same-node worker: the IPC step
    assert {s.transport for s in forced.steps} >= {"cuda_ipc"}


def test_ids_are_stable_and_a_new_role_gets_a_new_id() -> None:
    _, evals, processes = _processes("Double")
    first = processes.pid(evals[3])
    processes.roster.policy_list[PolicyRole.EVAL].remove(evals[1])
    assert processes.pid(evals[3]) == first  # a death elsewhere renames nobody
    processes.roster.policy_list[PolicyRole.EVAL].remove(evals[3])
    processes.roster.policy_list[PolicyRole.TRAIN].append(evals[3])
    assert processes.pid(evals[3]) == "t2"


def test_fanouts_that_cannot_run_are_refused_in_the_config() -> None:
    with pytest.raises(ValueError, match=r"weight_buffer\.fanout 'direct' does not run with strategy 'Sh"):
        WeightBufferConfig(type="CPUWeightBuffer", buffer_strategy="Shared", fanout="direct")
    with pytest.raises(ValueError, match=r"weight_buffer\.planner 'mine' is unknown"):
        WeightBufferConfig(planner="mine")


class _Refusing(MLPPolicy):
    def get_weight_checksum(self) -> str:
        raise LayoutMismatchError("parameter '0.weight' differs", "0.weight")


def test_failures_name_the_worker_and_the_clearest_one_wins() -> None:
    config = PolicyConfig()
    roster = Roster([MLPPolicy(config, role="train")], [MLPPolicy(config), _Refusing(config, index=1)])
    calls = Calls(roster, 10.0, lambda: [])
    with pytest.raises(
        PolicyGroupError, match=r"get_weight_checksum: rollout worker 1 failed: parameter '0\.weight'"
    ):
        calls.call_all(roster.eval_list, "get_weight_checksum")
    assert vagueness(LayoutMismatchError("x", "0.weight")) == 0
    assert vagueness(RuntimeError("a receiver has a different layout")) == 1
