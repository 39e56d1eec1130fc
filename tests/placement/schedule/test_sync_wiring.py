"""An executor's side of a sync plan without a cluster: its settings (`check_sync_options`), its
processes from plain sites (`sync_processes`), the CUDA IPC mode and planner choice
(`cuda_ipc_mode`, `make_sync_plan`),
what rebuilding a node takes (`node_wiring`) and the communication groups (`SyncGroups`)."""

from __future__ import annotations

from typing import Any

import pytest

from rlfleet.placement import (
    WEIGHT_TRANSFER,
    CommGroup,
    NodeWiring,
    SyncGroups,
    SyncPlan,
    SyncPlanError,
    WorkerSite,
    check_sync_options,
    cuda_ipc_mode,
    make_sync_plan,
    node_wiring,
    nodes_to_rewire,
    plan_comm_groups,
    plan_sync,
    sync_processes,
)

BUCKETS = [1024, 2048, 1024, 4096, 512]
TENSORS = [2, 3, 1, 4, 2]
# trainers on nodes A and B, rollout workers on A, B and (two) C; one machine per node
SITES: list[WorkerSite] = [
    ("t0", "trainer", "A", -1, "host-A"),
    ("t1", "trainer", "B", -1, "host-B"),
    ("r0", "rollout", "A", -1, "host-A"),
    ("r1", "rollout", "B", -1, "host-B"),
    ("r2", "rollout", "C", -1, "host-C"),
    ("r3", "rollout", "C", -1, "host-C"),
]
# one GPU node: two trainers and two rollout workers, colocated pairs
GPU_SITES: list[WorkerSite] = [
    ("t0", "trainer", "A", 0, None),
    ("t1", "trainer", "A", 1, None),
    ("r0", "rollout", "A", 2, None),
    ("r1", "rollout", "A", 3, None),
]


def _plan(strategy: str, sites: list[WorkerSite] = SITES, **options: Any) -> SyncPlan:
    processes = sync_processes(sites, strategy)
    return make_sync_plan(processes, BUCKETS, strategy, bucket_tensors=TENSORS, layout_digest="L1", **options)


def test_make_sync_plan_is_plan_sync_over_the_processes() -> None:
    plan = _plan("Double")
    expected = plan_sync(sync_processes(SITES, "Double"), BUCKETS, "Double")
    assert [s.signature() for s in plan.steps] == [s.signature() for s in expected.steps]
    shares = [s for s in plan.steps if s.transport == "broadcast"]
    assert [s.src for s in shares] == ["t0", "t1"]  # several senders: each trainer sends a share
    assert all(s.dst == ("r2", "r3") for s in shares)  # node C has no trainer: direct fan-out
    assert sorted(b for s in shares for b in s.buckets) == list(range(len(BUCKETS)))
    assert plan.topology_source.startswith("fallback")  # no topology: priced on the documented defaults
    assert (plan.layout_digest, plan.bucket_tensors) == ("L1", tuple(TENSORS))
    funnel = _plan("Double", senders="one")
    assert [s.src for s in funnel.steps if s.transport == "broadcast"] == ["t0"]
    assert _plan("Double", planner="seed").name == "seed"
    with pytest.raises(SyncPlanError, match=r"planner must be one of \['rlfleet', 'seed'\], got 'mine'"):
        _plan("Double", planner="mine")
    with pytest.raises(SyncPlanError, match="fanout must be one of"):
        _plan("Double", fanout="sideways")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "Triple"}, "cfg.strategy 'Triple' is unknown; valid: None, Double, Shared, Sharded"),
        ({"planner": "mine"}, "cfg.planner 'mine' is unknown; valid: rlfleet, seed"),
        ({"senders": "two"}, "cfg.senders 'two' is unknown; valid: all, one"),
        ({"fanout": "sideways"}, "cfg.fanout 'sideways' is unknown; valid: auto, node_buffer, direct"),
        ({"cuda_ipc": "on"}, "cfg.cuda_ipc 'on' is unknown; valid: auto, off, host"),
        ({"strategy": "Shared", "cuda_ipc": "host"}, "cfg.cuda_ipc 'host' does not run with strategy"),
        ({"strategy": "Shared", "fanout": "direct"}, "cfg.fanout 'direct' does not run with strategy 'Sh"),
        ({"fanout": "node_buffer"}, "cfg.fanout 'node_buffer' does not run with strategy 'Double'"),
        ({"strategy": "None", "fanout": "node_buffer"}, "cfg.fanout 'node_buffer' does not run with"),
    ],
)
def test_sync_options_that_cannot_run_are_refused_by_name(options: dict[str, str], message: str) -> None:
    settings = {"strategy": "Double", **options}
    with pytest.raises(SyncPlanError) as caught:
        check_sync_options(**settings, prefix="cfg.")
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("strategy", ["None", "Double", "Shared", "Sharded"])
def test_options_the_check_passes_plan(strategy: str) -> None:
    fanout = "node_buffer" if strategy == "Shared" else "direct"
    choices = (("rlfleet", "all", "auto"), ("rlfleet", "one", fanout), ("seed", "all", "auto"))
    for planner, senders, fan in choices:
        check_sync_options(strategy, planner, senders, fan, "off")
        assert _plan(strategy, planner=planner, senders=senders, fanout=fan).strategy == strategy


def test_processes_carry_device_machine_and_sharded_node_shares() -> None:
    sharded = sync_processes(SITES, "Sharded")
    assert [p.id for p in sharded] == ["t0", "t1", "r0", "r1", "r2", "r3"]
    assert {p.id: p.shard for p in sharded} == {
        "t0": None,
        "t1": None,
        "r0": (0, 1),
        "r1": (0, 1),
        "r2": (0, 2),
        "r3": (1, 2),
    }
    assert all(p.shard is None for p in sync_processes(SITES, "Double"))
    assert [(p.device, p.machine) for p in sharded[:2]] == [("cpu", "host-A"), ("cpu", "host-B")]
    gpu = sync_processes(GPU_SITES, "Double")
    assert [p.device for p in gpu] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert (gpu[0].machine, gpu[0].host) == (None, "A")
    with pytest.raises(SyncPlanError, match="role must be one of"):
        sync_processes([("x0", "judge", "A", -1, None)], "Double")


@pytest.mark.parametrize(
    ("setting", "strategy", "processes", "mode"),
    [
        ("auto", "Double", True, True),
        ("auto", "Double", False, False),  # one process: nothing to open a channel to
        ("off", "Double", True, False),
        ("host", "Double", True, "force"),
        ("host", "Sharded", True, "force"),
        ("auto", "Shared", True, False),  # Shared binds its node buffer zero-copy: it keeps it
        ("host", "Shared", False, False),
    ],
)
def test_cuda_ipc_mode(setting: str, strategy: str, processes: bool, mode: object) -> None:
    assert cuda_ipc_mode(setting, strategy, processes) == mode


def test_cuda_ipc_mode_refuses_what_cannot_run() -> None:
    with pytest.raises(SyncPlanError, match="cuda_ipc 'host' needs Ray actors: an IPC channel joins two"):
        cuda_ipc_mode("host", "Double", False)
    with pytest.raises(SyncPlanError, match=r"cuda_ipc must be one of \['auto', 'off', 'host'\], got 'on'"):
        cuda_ipc_mode("on", "Double", True)


def test_a_plan_that_hands_weights_over_by_cuda_ipc_is_refused_where_that_is_off() -> None:
    allowed = _plan("Double", GPU_SITES, planner="seed", colocated=True, cuda_ipc=True)
    assert [(s.transport, s.src, s.dst) for s in allowed.steps] == [
        ("cuda_ipc", "t0", ("r0",)),
        ("cuda_ipc", "t1", ("r1",)),
    ]
    with pytest.raises(SyncPlanError, match="hands weights to GPU workers by CUDA IPC"):
        _plan("Double", GPU_SITES, planner="seed", colocated=True, cuda_ipc=False)
    ours = _plan("Double", GPU_SITES, cuda_ipc=False)  # ours keeps them on the node buffer
    assert {s.transport for s in ours.steps} == {"node_buffer"}
    assert {s.transport for s in _plan("Double", GPU_SITES, cuda_ipc=True).steps} == {"cuda_ipc"}


def test_a_death_rebuilds_only_the_node_it_changed() -> None:
    plan = _plan("Shared")
    again = _plan("Shared", SITES[:-1])  # r3 died
    assert nodes_to_rewire(plan, again) == {"C"}
    assert nodes_to_rewire(plan, plan) == set()
    assert nodes_to_rewire(None, plan) == {"A", "B", "C"}
    assert again.diff(plan).processes_removed == ("r3",)


def test_node_wiring_names_writers_readers_and_each_endpoint() -> None:
    plan = _plan("Shared")  # node C has no trainer: its first rollout worker relays for it
    wiring = node_wiring(plan, plan.nodes)
    assert wiring.processes == ("t0", "t1", "r0", "r1", "r2", "r3")
    assert [(b.node, b.writer, b.readers, b.users) for b in wiring.buffers] == [
        ("A", "t0", 1, ("r0",)),
        ("B", "t1", 1, ("r1",)),
        ("C", "r2", 2, ("r3", "r2")),  # the relay binds its own buffer too
    ]
    assert wiring.unbuffered == ()
    specs = wiring.endpoint_specs({"A": "buf-a", "B": "buf-b", "C": "buf-c"})
    assert specs == {
        "r0": {"name": "buf-a", "node_id": "A"},
        "r1": {"name": "buf-b", "node_id": "B"},
        "r2": {"name": "buf-c", "node_id": "C"},
        "r3": {"name": "buf-c", "node_id": "C"},
    }
    with pytest.raises(KeyError):
        wiring.endpoint_specs({"A": "buf-a"})  # every created buffer needs its name
    one = node_wiring(plan, {"C", "gone"})  # a node that left the plan loses its buffer
    assert (one.processes, [b.node for b in one.buffers], one.unbuffered) == (("r2", "r3"), ["C"], ("gone",))
    assert node_wiring(plan, ()) == NodeWiring((), (), (), ())


def test_node_wiring_for_direct_broadcasts_and_sharded_shares() -> None:
    double = node_wiring(_plan("Double"), {"C"})  # every rollout worker of C receives broadcasts
    assert (double.buffers, double.unbuffered) == ((), ("C",))
    assert double.endpoint_specs({}) == {"r2": {}, "r3": {}}
    sharded = _plan("Sharded")
    specs = node_wiring(sharded, sharded.nodes).endpoint_specs({"A": "buf-a", "B": "buf-b"})
    assert specs["r0"] == {"name": "buf-a", "node_id": "A", "rank": 0, "world_size": 1}
    assert specs["r2"] == {"rank": 0, "world_size": 2}
    assert specs["r3"] == {"rank": 1, "world_size": 2}


def test_sync_groups_rank_every_process_and_name_the_plans_groups() -> None:
    plan = _plan("Double")
    groups = SyncGroups.for_plan(plan)
    assert groups.members == ("t0", "t1", "r0", "r1", "r2", "r3")
    actors = [(p.id, p.node, 0) for p in plan.processes]
    transfer = [{"sender": g[0], "receiver": list(g[1:])} for g in plan.groups()]
    assert groups.world == plan_comm_groups(actors, transfer, ["t0", "t1"])
    rank = groups.rank_of
    assert groups.groups == {
        ("t0", "r2", "r3"): (f"{WEIGHT_TRANSFER}/0", rank["t0"]),
        ("t1", "r2", "r3"): (f"{WEIGHT_TRANSFER}/1", rank["t1"]),
    }
    assert (groups.gather, groups.gather_groups) == ((), {})
    assert [groups.process_of(rank[p]) for p in groups.members] == list(groups.members)
    gpu = SyncGroups.for_plan(_plan("Double", GPU_SITES))  # ranks on a node follow the GPU index
    assert [(r.actor_id, r.gpu_id, r.local_rank) for r in gpu.world.ranks] == [
        ("t0", 0, 0),
        ("t1", 1, 1),
        ("r0", 2, 2),
        ("r1", 3, 3),
    ]


def test_sharded_nodes_gather_in_shard_order() -> None:
    groups = SyncGroups.for_plan(_plan("Sharded"))
    rank = groups.rank_of
    assert groups.gather == (
        CommGroup("sharded/0", "sharded", (rank["r0"],), "A"),
        CommGroup("sharded/1", "sharded", (rank["r1"],), "B"),
        CommGroup("sharded/2", "sharded", (rank["r2"], rank["r3"]), "C"),
    )
    assert groups.gather_groups == {"A": "sharded/0", "B": "sharded/1", "C": "sharded/2"}


def test_colocated_plans_without_groups_rank_only_the_trainers() -> None:
    plan = _plan("Double", GPU_SITES, planner="seed", colocated=True, cuda_ipc=True)
    assert plan.groups() == ()
    assert SyncGroups.for_plan(plan, colocated=True).members == ("t0", "t1")  # as the seed
    assert SyncGroups.for_plan(plan).members == ("t0", "t1", "r0", "r1")
    cpu = _plan("Double", [(p, r, n, -1, m) for p, r, n, _, m in GPU_SITES], planner="seed", colocated=True)
    assert cpu.groups() == (("t0", "r0"), ("t1", "r1"))  # p2p steps run in groups: everyone is ranked
    assert len(SyncGroups.for_plan(cpu, colocated=True).members) == 4


def test_a_replan_gets_groups_among_the_same_ranks() -> None:
    plan = _plan("Double")
    groups = SyncGroups.for_plan(plan)
    assert groups.add_missing(plan) == []
    again = _plan("Double", SITES[:-1])  # r3 died: each trainer now broadcasts to r2 alone
    rank = groups.rank_of
    made = groups.add_missing(again)
    assert made == [
        CommGroup(f"{WEIGHT_TRANSFER}/r1", WEIGHT_TRANSFER, (rank["t0"], rank["r2"]), None, rank["t0"]),
        CommGroup(f"{WEIGHT_TRANSFER}/r2", WEIGHT_TRANSFER, (rank["t1"], rank["r2"]), None, rank["t1"]),
    ]
    assert groups.groups[("t0", "r2")] == (f"{WEIGHT_TRANSFER}/r1", rank["t0"])
    assert groups.add_missing(again) == []  # made once
    view = groups.groups
    groups.forget(["r3"])
    assert view is groups.groups  # changed in place
    assert set(view) == {("t0", "r2"), ("t1", "r2")}
    assert groups.add_missing(plan) == []  # the same ranks again: the group made with the world
    assert groups.groups[("t0", "r2", "r3")] == (f"{WEIGHT_TRANSFER}/0", rank["t0"])
    joined = _plan("Double", [*SITES, ("r9", "rollout", "C", -1, "host-C")])
    with pytest.raises(SyncPlanError, match="r9 have no rank in the world group"):
        groups.add_missing(joined)
