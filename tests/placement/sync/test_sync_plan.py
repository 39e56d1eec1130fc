"""SyncPlan: the shapes plan_sync produces, validate() catching each broken plan, diff(), JSON, and
the seed-shaped view agreeing with the seed's own planners."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sync_processes import BUCKETS, MiB, R, T, cluster

from rlfleet.placement import (
    NodeBuffer,
    SyncPlan,
    SyncPlanError,
    SyncProcess,
    SyncStep,
    build_transfer_info_for_colocated,
    build_transfer_info_for_disaggregated,
    endpoint_needs,
    nodes_to_rewire,
    plan_sync,
    seed_sync_plan,
    split_shares,
)


def test_one_vs_two_trainers_split_the_buckets_into_byte_balanced_shares() -> None:
    one = plan_sync(cluster(1), BUCKETS, "Double")
    two = plan_sync(cluster(2), BUCKETS, "Double")
    assert [s.src for s in one.steps if s.transport == "broadcast"] == ["t0"]
    shares = [s for s in two.steps if s.transport == "broadcast"]
    assert [s.src for s in shares] == ["t0", "t1"]
    assert shares[0].buckets + shares[1].buckets == tuple(range(len(BUCKETS)))  # disjoint, contiguous
    assert abs(shares[0].nbytes - shares[1].nbytes) <= max(BUCKETS)
    assert two.groups() == (("t0", "r1", "r2", "r3", "r4", "r5"), ("t1", "r1", "r2", "r3", "r4", "r5"))
    assert two.predicted_seconds < one.predicted_seconds  # two senders: no funnel
    funnel = plan_sync(cluster(2), BUCKETS, "Double", senders="one")
    assert [s.src for s in funnel.steps if s.transport == "broadcast"] == ["t0"]


def test_shared_reads_node_buffers_and_double_copies_out() -> None:
    shared = plan_sync(cluster(2), BUCKETS, "Shared")
    # the trainer node: its first trainer writes, its rollout binds; other nodes: first rollout
    # receives the broadcasts and fills the buffer the others read after them
    assert {(b.node, b.writer, b.readers, b.mode) for b in shared.node_buffers} == {
        ("n0", "t0", ("r0",), "bind"),
        ("n1", "r1", ("r2",), "bind"),
        ("n2", "r3", ("r4", "r5"), "bind"),
    }
    reads = {s.node: s for s in shared.steps if s.transport == "node_buffer"}
    broadcasts = tuple(s.index for s in shared.steps if s.transport == "broadcast")
    assert reads["n1"].after == broadcasts
    assert reads["n2"].after == broadcasts
    assert reads["n0"].after == ()
    assert {d for s in shared.steps if s.transport == "broadcast" for d in s.dst} == {"r1", "r3"}
    double = plan_sync(cluster(2), BUCKETS, "Double")
    assert [(b.node, b.mode) for b in double.node_buffers] == [("n0", "copy")]
    destinations = {d for s in double.steps if s.transport == "broadcast" for d in s.dst}
    assert destinations == {"r1", "r2", "r3", "r4", "r5"}


def test_fanout_direct_vs_node_buffer_is_a_choice() -> None:
    direct = plan_sync(cluster(1), BUCKETS, "Shared", fanout="direct")
    relay = plan_sync(cluster(1), BUCKETS, "Double", fanout="node_buffer")
    assert [s.transport for s in direct.steps].count("node_buffer") == 1  # only the trainer's node
    assert {b.mode for b in relay.node_buffers} == {"copy"}
    assert len(relay.groups()[0]) == 3  # t0 + one writer per rollout-only node


def test_sharded_rollouts_keep_their_shard_and_the_bound_counts_only_that() -> None:
    # tensor-parallel over two nodes: each node holds half of the 8 shards, and needs only that half
    sharded = [T("t0", "n0"), T("t1", "n0")] + [R(f"r{i}", f"n{1 + i // 4}", shard=(i, 8)) for i in range(8)]
    full = [dataclasses.replace(p, shard=None) for p in sharded]
    plan = plan_sync(sharded, BUCKETS, "Sharded")
    double = plan_sync(full, BUCKETS, "Double")
    assert plan.lower_bound_seconds == pytest.approx(double.lower_bound_seconds / 2, rel=1e-3)
    assert plan.process("r5").shard == (5, 8)
    with pytest.raises(SyncPlanError, match="carries a shard"):
        plan_sync(sharded, BUCKETS, "Double")


def test_gpu_nodes_use_cuda_ipc_unless_switched_off() -> None:
    procs = [T("t0", "n0", "cuda:0"), R("r0", "n0", "cuda:1"), R("r1", "n0", "cpu"), R("r2", "n1", "cuda:0")]
    plan = plan_sync(procs, BUCKETS, "Double")
    local = {s.transport: s for s in plan.steps if s.node == "n0"}
    assert local["cuda_ipc"].dst == ("r0",)
    assert local["node_buffer"].dst == ("r1",)
    assert local["cuda_ipc"].predicted_seconds > 0  # a handoff on the node is not free
    off = plan_sync(procs, BUCKETS, "Double", cuda_ipc=False)
    assert {s.transport for s in off.steps} == {"broadcast", "node_buffer"}
    colocated = plan_sync([T("t0", "n0", "cuda:0"), R("r0", "n0", "cuda:0")], BUCKETS, "Double")
    assert colocated.predicted_seconds > 0


def test_forced_cuda_ipc_covers_every_same_node_reader_and_never_a_share() -> None:
    """ "force": the node-local fan-out is one cuda_ipc step on CPU processes too (policygroup's
    host test mode); cross-node destinations still get broadcasts, and IPC never splits buckets."""
    procs = [T("t0", "n0"), T("t1", "n1"), R("r0", "n0"), R("r1", "n0"), R("r2", "n2")]
    plan = plan_sync(procs, BUCKETS, "Double", cuda_ipc="force")
    [ipc] = [s for s in plan.steps if s.transport == "cuda_ipc"]
    assert (ipc.src, ipc.dst, ipc.node) == ("t0", ("r0", "r1"), "n0")
    assert ipc.buckets == tuple(range(len(BUCKETS)))  # every bucket, one writer: no shares
    assert not plan.node_buffers  # every reader of n0 maps the writer's slots
    assert [s.src for s in plan.steps if s.transport == "broadcast"] == ["t0", "t1"]
    assert ipc.predicted_seconds > 0
    assert {s.transport for s in plan_sync(procs, BUCKETS, "Double").steps} == {"broadcast", "node_buffer"}
    with pytest.raises(SyncPlanError, match="cuda_ipc must be True, False or 'force'"):
        plan_sync(procs, BUCKETS, "Double", cuda_ipc="yes")  # type: ignore[arg-type]


def test_split_shares_is_contiguous_and_balanced() -> None:
    assert split_shares([1, 1, 1, 1], 2) == [(0, 1), (2, 3)]
    assert split_shares([10, 1, 1, 1], 2) == [(0,), (1, 2, 3)]
    assert split_shares([64, 32, 64, 16, 64, 48], 2) == [(0, 1, 2), (3, 4, 5)]  # 160 / 128 MiB
    assert split_shares([1, 2], 3) == [(0,), (1,), ()]
    assert split_shares([], 2) == [(), ()]


def _broken(plan: SyncPlan, position: int, **changes: object) -> SyncPlan:
    steps = list(plan.steps)
    steps[position] = dataclasses.replace(steps[position], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(plan, steps=tuple(steps))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: _broken(p, 0, dst=("r1", "ghost")), "unknown process id 'ghost'"),
        (lambda p: _broken(p, 0, transport="carrier-pigeon"), "unknown transport"),
        (lambda p: _broken(p, 0, buckets=(0, 1, 99)), "outside 0..5"),
        (lambda p: _broken(p, 0, nbytes=1), "nbytes 1 but its buckets hold"),
        (lambda p: _broken(p, 1, buckets=(2, 3, 4, 5), nbytes=sum(BUCKETS[2:])), "shares not disjoint"),
        (lambda p: _broken(p, 1, buckets=(4, 5), nbytes=sum(BUCKETS[4:])), "'r1' does not hold bucket"),
        (lambda p: _broken(p, 3, after=()), "does not hold bucket.*read before the node"),
        (lambda p: _broken(p, 3, after=(5,)), "not an earlier step"),
        (lambda p: _broken(p, 3, src="r2", dst=("r1",)), "sender 'r2' does not hold bucket"),
        (lambda p: _broken(p, 0, dst=("t1", "r1", "r3")), "trainers only send"),
        (lambda p: _broken(p, 0, index=7), "a step's index must be its position"),
        (lambda p: dataclasses.replace(p, node_buffers=p.node_buffers[:1]), "without a NodeBuffer entry"),
        (lambda p: dataclasses.replace(p, strategy="Triple"), "strategy must be one of"),
    ],
)
def test_validate_names_each_class_of_broken_plan(change: object, message: str) -> None:
    plan = plan_sync(cluster(2), BUCKETS, "Shared")
    assert [s.transport for s in plan.steps] == ["broadcast"] * 2 + ["node_buffer"] * 3
    plan.validate()
    with pytest.raises(SyncPlanError, match=message):
        change(plan).validate()  # type: ignore[operator]


def test_validate_catches_missing_and_repeated_buckets() -> None:
    double = plan_sync(cluster(2), BUCKETS, "Double")
    with pytest.raises(SyncPlanError, match="rollout 'r1' misses bucket\\(s\\) \\[3\\]"):
        _broken(double, 1, buckets=(4, 5), nbytes=sum(BUCKETS[4:])).validate()
    plan = plan_sync(cluster(1), BUCKETS, "Double")
    extra = SyncStep(len(plan.steps), "p2p", "t0", ("r1",), None, (0,), BUCKETS[0])
    with pytest.raises(SyncPlanError, match="'r1' gets bucket\\(s\\) \\[0\\] more than once"):
        dataclasses.replace(plan, steps=(*plan.steps, extra)).validate()


def test_diff_after_death_join_pop_and_convert() -> None:
    base = plan_sync(cluster(2), BUCKETS, "Shared")
    assert base.diff(base).empty
    assert base.diff(base).summary() == "no change"
    died = plan_sync([p for p in cluster(2) if p.id != "r3"], BUCKETS, "Shared")  # r3 wrote n2's buffer
    d = died.diff(base)
    assert d.summary().startswith(f"from {base.digest[:8]} to {died.digest[:8]}: ")  # which way it goes
    assert "-1 process (r3)" in d.summary()
    back = base.diff(died).summary()
    assert back.startswith(f"from {died.digest[:8]} to {base.digest[:8]}: ")
    assert "+1 process (r3)" in back
    assert d.processes_removed == ("r3",)
    assert not d.processes_added
    assert ("t0", "r1", "r3") in d.groups_removed
    assert ("t0", "r1", "r4") in d.groups_added
    assert d.node_buffers_changed == ("n2",)
    joined = plan_sync([*cluster(2), R("r6", "n3")], BUCKETS, "Shared")
    j = joined.diff(base)
    assert j.processes_added == ("r6",)
    assert "n3" in j.node_buffers_changed
    assert all("r6" in g for g in j.groups_added)
    popped = plan_sync([p for p in cluster(2) if p.id != "r5"], BUCKETS, "Shared")
    p = popped.diff(base)
    assert p.processes_removed == ("r5",)
    assert not p.groups_added
    assert p.node_buffers_changed == ("n2",)
    converted = [SyncProcess("r0", "trainer", "n0") if q.id == "r0" else q for q in cluster(2)]
    c = plan_sync(converted, BUCKETS, "Shared").diff(base)
    assert c.roles_changed == ("r0",)
    assert "role changed: r0" in c.summary()
    assert json.loads(json.dumps(c.to_dict()))["roles_changed"] == ["r0"]


def test_nodes_to_rewire_are_the_nodes_whose_buffers_or_endpoints_changed() -> None:
    base = plan_sync(cluster(2), BUCKETS, "Shared")
    assert nodes_to_rewire(None, base) == set(base.nodes)  # nothing wired yet
    assert nodes_to_rewire(base, base) == set()
    popped = plan_sync([p for p in cluster(2) if p.id != "r5"], BUCKETS, "Shared")  # a reader of n2
    assert nodes_to_rewire(base, popped) == {"n2"}
    assert endpoint_needs(popped)["r4"]["buffer"] != endpoint_needs(base)["r4"]["buffer"]
    assert nodes_to_rewire(base, plan_sync(cluster(2), BUCKETS, "Double")) == set(base.nodes)
    shards = [T("t0", "n0"), R("r0", "n1", shard=(0, 2)), R("r1", "n1", shard=(1, 2))]
    assert endpoint_needs(plan_sync(shards, BUCKETS, "Sharded"))["r1"]["shard"] == (1, 2)


def test_groups_cover_every_step_that_runs_in_a_process_group() -> None:
    procs = [T("t0", "n0"), T("t1", "n0"), R("r0", "n0"), R("r1", "n0")]
    plan = seed_sync_plan(procs, BUCKETS, "Double", colocated=True)  # CPU: one p2p step per pair
    assert {s.transport for s in plan.steps} == {"p2p"}
    assert set(plan.groups()) == {(s.src, *s.dst) for s in plan.steps}


@pytest.mark.parametrize("strategy", ["None", "Double", "Shared", "Sharded"])
def test_json_round_trip_and_digest(strategy: str) -> None:
    procs = cluster(2)
    if strategy == "Sharded":
        procs = [dataclasses.replace(p, shard=(0, 2)) if p.role == "rollout" else p for p in procs]
    plan = plan_sync(procs, BUCKETS, strategy, layout_digest="abc", bucket_tensors=[3, 1, 4, 1, 5, 9])
    again = SyncPlan.from_json(json.dumps(json.loads(plan.to_json())))
    assert again == plan
    assert again.digest == plan.digest
    assert plan.tensors_in((0, 5)) == 12
    moved = dataclasses.replace(plan, predicted_seconds=99.0)
    assert moved.digest == plan.digest  # predictions are not part of what executes
    with pytest.raises(SyncPlanError, match="format"):
        SyncPlan.from_dict({**plan.to_dict(), "format": 99})
    with pytest.raises(SyncPlanError, match="malformed"):
        SyncPlan.from_dict({k: v for k, v in plan.to_dict().items() if k != "steps"})


@st.composite
def layouts(draw: st.DrawFn) -> list[SyncProcess]:
    nodes = draw(st.integers(1, 5))
    procs: list[SyncProcess] = []
    for i in range(draw(st.integers(1, 6))):
        procs.append(T(f"t{i}", f"n{draw(st.integers(0, nodes - 1))}"))
    for i in range(draw(st.integers(1, 10))):
        procs.append(R(f"r{i}", f"n{draw(st.integers(0, nodes - 1))}"))
    return procs


@settings(max_examples=120, deadline=None)
@given(layouts(), st.sampled_from(["None", "Double", "Shared"]), st.integers(1, 9))
def test_seed_view_equals_the_seed_planner(procs: list[SyncProcess], strategy: str, n_buckets: int) -> None:
    seed = seed_sync_plan(procs, [MiB] * n_buckets, strategy)
    seed.validate()
    info: dict[str, dict[str, list[str]]] = {}
    for role, key in (("trainer", "train_policies"), ("rollout", "eval_policies")):
        for p in procs:
            if p.role == role:
                info.setdefault(p.node, {"train_policies": [], "eval_policies": []})[key].append(p.id)
    objects = {p.id: f"<actor {p.id}>" for p in procs}
    expected = build_transfer_info_for_disaggregated(
        {n: {k: [objects[i] for i in v] for k, v in e.items()} for n, e in info.items()}, strategy
    )
    assert seed.transfer_info(objects) == expected
    ours = plan_sync(procs, [MiB] * n_buckets, strategy)
    ours.validate()
    assert ours.predicted_seconds >= ours.lower_bound_seconds


def test_seed_colocated_view_and_missing_objects() -> None:
    procs = [T("t0", "n0", "cuda:0"), T("t1", "n0", "cuda:1")]
    procs += [R("r0", "n0", "cuda:0"), R("r1", "n0", "cuda:1")]
    plan = seed_sync_plan(procs, BUCKETS, "Double", colocated=True)
    assert [s.transport for s in plan.steps] == ["cuda_ipc", "cuda_ipc"]
    assert plan.transfer_info({p.id: p.id for p in procs}) == build_transfer_info_for_colocated(
        ["t0", "t1"], ["r0", "r1"]
    )
    with pytest.raises(SyncPlanError, match="no object given for process 't0'"):
        plan.transfer_info({})


def test_bad_inputs_are_named() -> None:
    with pytest.raises(SyncPlanError, match="duplicate process id 'r0'"):
        plan_sync([T("t0", "n0"), R("r0", "n1"), R("r0", "n2")], BUCKETS, "Double")
    with pytest.raises(SyncPlanError, match="no trainer"):
        plan_sync([R("r0", "n1")], BUCKETS, "Double")
    with pytest.raises(SyncPlanError, match="bucket_bytes\\[1\\]"):
        plan_sync(cluster(1), [1, -2], "Double")
    with pytest.raises(SyncPlanError, match="role must be one of"):
        SyncProcess("x", "eval", "n0")  # type: ignore[arg-type]
    with pytest.raises(SyncPlanError, match="fanout"):
        plan_sync(cluster(1), BUCKETS, "Double", fanout="tree")  # type: ignore[arg-type]
    with pytest.raises(SyncPlanError, match="bucket_tensors"):
        plan_sync(cluster(1), BUCKETS, "Double", bucket_tensors=[1])


def test_node_buffer_modes_are_checked() -> None:
    with pytest.raises(SyncPlanError, match="mode must be one of"):
        NodeBuffer("n0", "t0", (), "mmap")  # type: ignore[arg-type]


def test_drawing_groups_processes_by_node(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plan = plan_sync(cluster(2), BUCKETS, "Shared")
    dot = plan.to_dot()
    assert dot.count("subgraph cluster_") == 4
    assert 'label="node n1"' in dot
    assert '"t0" -> "r1"' in dot
    assert "broadcast" in dot
    assert "MB" in dot
    assert "predicted" in dot
    assert "not run" in dot
    png = plan.draw(tmp_path / "plan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nodes_of_one_machine_share_its_nics() -> None:
    """Two trainers on two raylets of one machine do not send twice as fast as one: they share
    its network interfaces (a local multi-raylet cluster); on two machines they do."""

    def on(machines: dict[str, str], trainers: int) -> SyncPlan:
        senders_only_on_n0 = [p for p in cluster(trainers) if p.node != "n0" or p.role == "trainer"]
        procs = [dataclasses.replace(p, machine=machines.get(p.node)) for p in senders_only_on_n0]
        return plan_sync(procs, BUCKETS, "Double", fanout="direct")

    apart = {"n0": "m0", "nt1": "m1", "n1": "m2", "n2": "m3"}
    shared = {"n0": "m0", "nt1": "m0", "n1": "m2", "n2": "m3"}
    assert on(apart, 2).predicted_seconds < 0.7 * on(apart, 1).predicted_seconds
    assert on(shared, 2).predicted_seconds == pytest.approx(on(shared, 1).predicted_seconds, rel=0.05)
    # receivers on one machine: its NICs take every copy, so the bound grows with them
    one_box = dict.fromkeys(("n0", "nt1", "n1", "n2"), "m0")
    assert on(one_box, 1).lower_bound_seconds > on(apart, 1).lower_bound_seconds
    plan = on(shared, 2)
    assert SyncPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan  # the machine survives JSON
    with pytest.raises(SyncPlanError, match="machine"):
        SyncProcess("t0", "trainer", "n0", machine="")


def test_a_cpu_broadcast_to_its_own_node_crosses_the_machines_tcp_stack() -> None:
    """The seed's plan on one machine: t0's gloo broadcast to its own node's rollout workers goes
    over loopback TCP, beside t1's broadcasts to the other nodes, so it delays them; NCCL on GPUs
    moves the same-node copies over intra-node links, which the cross-node copies never use."""

    def seed_plan(device: str, with_local: bool) -> SyncPlan:
        procs = [T("t0", "n0", device), T("t1", "n1", device), R("r2", "n2", device), R("r3", "n3", device)]
        if with_local:
            procs += [R("r0", "n0", device), R("r1", "n0", device)]
        procs = [dataclasses.replace(p, machine="m0") for p in procs]
        return seed_sync_plan(procs, BUCKETS, "Double")

    cpu_local, cpu_alone = seed_plan("cpu", True), seed_plan("cpu", False)
    local_step = next(s for s in cpu_local.steps if s.src == "t0")
    assert local_step.transport == "broadcast"
    assert set(local_step.dst) == {"r0", "r1"}
    assert cpu_local.predicted_seconds > 1.2 * cpu_alone.predicted_seconds
    gpu_local, gpu_alone = seed_plan("cuda:0", True), seed_plan("cuda:0", False)
    assert gpu_local.predicted_seconds == pytest.approx(gpu_alone.predicted_seconds, rel=0.05)


@pytest.mark.parametrize("planner", [plan_sync, seed_sync_plan])
def test_a_plan_with_nothing_to_move_or_nobody_to_receive_is_refused_naming_what_is_missing(
    planner: Any,
) -> None:
    with pytest.raises(SyncPlanError, match="no processes"):
        planner([], BUCKETS, "Double")
    with pytest.raises(SyncPlanError, match=r"no rollout worker among the processes \['t0', 't1'\]"):
        planner([T("t0", "n0"), T("t1", "n1")], BUCKETS, "Double")
    with pytest.raises(SyncPlanError, match="no buckets"):
        planner(cluster(1), [], "Double")


@pytest.mark.parametrize("planner", [plan_sync, seed_sync_plan])
def test_bucket_bytes_is_each_buckets_size_and_an_int_is_refused_saying_so(planner: Any) -> None:
    with pytest.raises(SyncPlanError, match=r"bucket_bytes is the size of each bucket.*\[67108864\] \* n"):
        planner(cluster(1), 64 * MiB, "Double")


def test_device_strings_are_cpu_or_cuda_and_anything_else_is_named() -> None:
    for device in ("cpu", "CPU", "cpu:0", "Cpu:3"):
        assert not R("r0", "n0", device).gpu
        assert R("r0", "n0", device).device == "cpu"
    for device, canonical in (("cuda", "cuda"), ("cuda:1", "cuda:1"), ("CUDA:2", "cuda:2")):
        assert R("r0", "n0", device).gpu
        assert R("r0", "n0", device).device == canonical
    for bad in ("banana", "CPU:x", "cuda:", "cuda:-1", "gpu0", "cuda:1:2", " cpu"):
        with pytest.raises(SyncPlanError, match=rf"process 'r0': device must be .*got {bad!r}"):
            R("r0", "n0", bad)
    plan = plan_sync([T("t0", "n0", "CPU"), R("r0", "n0", "cpu:0")], BUCKETS, "Double")
    assert [s.transport for s in plan.steps] == ["node_buffer"]  # CPU processes: no CUDA IPC step
