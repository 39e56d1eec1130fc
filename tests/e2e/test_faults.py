"""Fault injection across the packages: PolicyGroup (Ray) + weightsync transports + routing.

One 3-node Ray cluster and one set of actors serve the whole module (node0: train0, eval0 |
node1: train1, eval1 | node2: eval2, eval3), so disaggregated syncs mix node-buffer items
(node0, node1) and a cross-node broadcast (to node2). Actors restart after a crash
(`max_restarts=-1`), the way a deployment keeps its workers: each test kills what it needs and
the next one gets the restarted actor back. Faults are injected by `fault_policies.FaultPolicy`
at a named point inside the real sync (e.g. right after the first received bucket).

Each test prints one line "FAULT <case> | <outcome> | <seconds>" (the README table).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

import fault_policies as fp  # noqa: E402
from testkit import PLACES, eval_state, ready_group, spawn_actors  # noqa: E402

from rlfleet.policygroup import (  # noqa: E402
    BatchedData,
    CommGroupError,
    PolicyConfig,
    PolicyGroup,
    PolicyGroupError,
    TrainConfig,
    TrainWorkerDiedError,
    WeightBufferConfig,
    WorkerDiedError,
)
from rlfleet.weightsync import LayoutMismatchError  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ray.cloudpickle.register_pickle_by_value(fp)  # the workers need not import tests/

EVALS = ("eval0", "eval1", "eval2", "eval3")
SYNC_TIMEOUT_S = 15.0
GROUP_TIMEOUT_S = 10.0
RPC_TIMEOUT_S = 30.0
KIND = {"None": "WeightBuffer", "Double": "WeightBuffer", "Shared": "CPUWeightBuffer"}


def config(strategy: str = "Double", cuda_ipc: str = "auto") -> PolicyConfig:
    return PolicyConfig(
        weight_buffer=WeightBufferConfig(
            type=KIND[strategy],
            buffer_strategy=strategy,
            bucket_bytes=1024,
            checksums=True,
            cuda_ipc=cuda_ipc,
        ),
        group_timeout_s=GROUP_TIMEOUT_S,
        sync_timeout_s=SYNC_TIMEOUT_S,
        rpc_timeout_s=RPC_TIMEOUT_S,
        drain_timeout_s=10.0,
    )


def report(case: str, outcome: str, seconds: float) -> None:
    print(f"\nFAULT {case} | {outcome} | {seconds:.1f}")


@pytest.fixture(scope="module")
def actors(cluster: Any) -> dict[str, Any]:
    out = spawn_actors(fp.FaultPolicy, config(), PLACES, max_restarts=-1)
    wait_alive(out.values(), 240.0)
    return out


def wait_alive(handles: Any, timeout: float = 120.0) -> None:
    """Until every actor answers (a crashed one is restarting meanwhile)."""
    end = time.monotonic() + timeout
    for handle in handles:
        while True:
            try:
                ray.get(handle.is_alive.remote(), timeout=max(1.0, end - time.monotonic()))
                break
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > end:
                    raise
                time.sleep(0.5)


@pytest.fixture
def restore(actors: dict[str, Any]) -> Iterator[None]:
    """After a test: faults disarmed, models back to normal, no failure on record (the next test
    reads only its own `last_error`), crashed actors back."""
    yield
    wait_alive(actors.values())
    ray.get([a.release.remote() for a in actors.values()], timeout=60)
    ray.get([a.mutate.remote(None) for a in actors.values()], timeout=60)
    ray.get([a.forget_last_error.remote() for a in actors.values()], timeout=60)


def make_group(
    actors: dict[str, Any], strategy: str, evals: tuple[str, ...] = EVALS, cuda_ipc: str = "auto"
) -> PolicyGroup:
    # trainers are data-parallel replicas: a restarted one starts from train0's weights
    train, rollout = [actors["train0"], actors["train1"]], [actors[e] for e in evals]
    group: PolicyGroup = ready_group(train, rollout, config(strategy, cuda_ipc), align_trainers=True)
    return group


def trainer_sum(group: PolicyGroup) -> str:
    return str(ray.get(group.train_list[0].get_weight_checksum.remote(), timeout=60))


def rollout(group: PolicyGroup, n: int = 12) -> list[dict[str, Any]]:
    x = torch.randn(n, fp.OBS_DIM, generator=torch.Generator().manual_seed(n)).tolist()
    resp = group.rollout_batch(BatchedData([f"env-{i}" for i in range(n)], x))
    return list(ray.get(resp.values(), timeout=60))


def steps(group: PolicyGroup, transport: str) -> list[Any]:
    """The steps of one transport ("broadcast" or "node_buffer") of the plan the group runs."""
    plan = group.sync_plan
    assert plan is not None
    return [s for s in plan.steps if s.transport == transport]


def policy(group: PolicyGroup, pid: str) -> Any:
    """The worker with process id `pid` in the group's sync plan."""
    return next(p for p in group.train_list + group.eval_list if group.process_id(p) == pid)


def readers_of(group: PolicyGroup, node: Any) -> list[str]:
    return [r for s in steps(group, "node_buffer") if s.node == node for r in s.dst]


def pick(group: PolicyGroup, actors: dict[str, Any], role: str) -> str:
    """The eval actor name playing `role` in the plan the group runs."""
    key = group._roster.wid
    name_of = {key(a): n for n, a in actors.items()}

    def name(pid: str) -> str:
        return name_of[key(policy(group, pid))]

    if role == "broadcast":  # receives over the wire from a trainer on another node
        return name(steps(group, "broadcast")[0].dst[-1])
    if role == "writer":  # Shared: receives for node2 and fills its shared buffer
        return name(steps(group, "broadcast")[0].dst[0])
    if role == "segment":  # reads the node buffer a trainer on its node wrote
        return name(readers_of(group, group.node_of(actors["train1"]))[0])
    if role == "reader":  # Shared: reads node2's shared buffer that another eval fills
        return name(readers_of(group, group.node_of(actors["eval2"]))[0])
    if role == "ipc":  # maps the IPC channel of the trainer on its node
        return name(steps(group, "cuda_ipc")[0].dst[0])
    raise ValueError(role)


def assert_not_planned(group: PolicyGroup, victim: Any) -> None:
    wid = group._roster.wid
    gone = wid(victim)
    assert all(wid(p) != gone for p in group.eval_list)
    assert gone not in group.router
    plan = group.sync_plan
    assert plan is not None
    members = {group.process_id(p) for p in group.train_list + group.eval_list}
    assert {p.id for p in plan.processes} == members
    for items in group.transfer_info.values():
        for item in items:
            receivers = item["receiver"] if isinstance(item["receiver"], list) else [item["receiver"]]
            assert all(wid(r) != gone for r in [item["sender"], *receivers])
    for entry in group.placement_info.values():
        assert all(wid(p) != gone for p in entry["eval_policies"])


# ------------------------------------------------------------------ eval killed mid-sync
@pytest.mark.parametrize(
    ("strategy", "role", "point"),
    [
        ("None", "broadcast", "consume"),
        ("Double", "segment", "consume"),
        ("Double", "broadcast", "consume"),
        ("Shared", "writer", "consume"),
        ("Shared", "reader", "stage"),
        ("Double", "ipc", "consume"),  # weight_buffer.cuda_ipc="host": the same steps on CPU
        ("None", "ipc", "consume"),
    ],
)
def test_eval_killed_mid_sync_survivors_finish_and_it_leaves_routing_and_plans(
    actors: dict[str, Any], restore: None, strategy: str, role: str, point: str
) -> None:
    group = make_group(actors, strategy, cuda_ipc="host" if role == "ipc" else "auto")
    try:
        group.train(None, seed=1)
        victim = pick(group, actors, role)
        before = group.weight_version
        ray.get(actors[victim].arm.remote(point, "die"), timeout=30)
        start = time.monotonic()
        group.sync_weights()  # the victim SIGKILLs itself inside its part of the sync
        seconds = time.monotonic() - start
        # one failed try and one retry for the survivors, each bounded by the sync deadline
        assert seconds < 2 * SYNC_TIMEOUT_S, seconds
        assert len(group.eval_list) == 3
        assert_not_planned(group, actors[victim])
        assert group.weight_version > before
        ref = trainer_sum(group)
        assert eval_state(group) == [(group.weight_version, ref)] * 3
        assert group.verify_eval_weight_checksums()
        out = rollout(group)
        survivors = {int(n[-1]) for n in EVALS if n != victim}
        assert {r["worker"] for r in out} == survivors
        assert {r["version"] for r in out} == {group.weight_version}
        report(f"eval killed mid-sync ({strategy}, {role} {victim} at {point})", "survivors synced", seconds)
    finally:
        group.shutdown()


# ------------------------------------------------------------------ trainer killed mid-sync
@pytest.mark.parametrize("strategy", ["None", "Double", "Shared"])
def test_trainer_killed_mid_sync_receivers_abort_and_keep_their_weights(
    actors: dict[str, Any], restore: None, strategy: str
) -> None:
    group = make_group(actors, strategy)
    try:
        group.train(None, seed=2)
        before = eval_state(group)
        version = group.weight_version
        shares = steps(group, "broadcast")
        assert [s.src for s in shares] == ["t0", "t1"]  # several senders: a share of the buckets each
        cross = shares[0]
        sender_pid = ray.get(policy(group, cross.src).get_pid.remote(), timeout=30)
        receiver = policy(group, cross.dst[0])
        # the receiver SIGKILLs the trainer after taking the first bucket: mid-stream
        ray.get(receiver.arm.remote("consume", "kill", sender_pid), timeout=30)
        start = time.monotonic()
        with pytest.raises(TrainWorkerDiedError, match=r"trainer \d died"):
            group.sync_weights()
        seconds = time.monotonic() - start
        assert seconds < SYNC_TIMEOUT_S + 15.0, seconds
        error = ray.get(receiver.last_error.remote(), timeout=30)
        kind = "none (the two-phase commit's window, below)"
        if error is not None:  # the sender died before the other sender's group committed
            kind, message, took = error
            assert kind in ("PeerLostError", "SyncTimeoutError"), (kind, message)
            assert took < SYNC_TIMEOUT_S + 5.0
        assert group.weight_version == version
        # one sender died mid-version: its receivers assembled nothing (the other sender's share
        # is dropped with it) and no node buffer step ran after a failed broadcast, so every
        # rollout worker holds the previous version, bit for bit. The one exception is the
        # two-phase commit's window (weightsync `Assembly`): the sender died after the other
        # sender's group had committed, every bucket of every share having arrived and been
        # verified; then a receiver holds the new version, applied whole ("None" applies on
        # arrival; "Double"/"Shared" only stage it). Never weights that disagree with the version.
        new = (version + 1, str(ray.get(actors["train1"].get_weight_checksum.remote(), timeout=30)))
        after = eval_state(group)
        for p, old, now in zip(group.eval_list, before, after, strict=True):
            assert now == old or (strategy == "None" and now == new), (group._roster.name(p), old, now)
        report(f"trainer killed mid-sync ({strategy})", f"receivers: {kind}; weights unchanged", seconds)
    finally:
        group.shutdown()


@pytest.mark.parametrize("strategy", ["None", "Double", "Shared"])
def test_one_of_two_senders_killed_mid_version_keeps_the_previous_version_everywhere(
    actors: dict[str, Any], restore: None, strategy: str
) -> None:
    """Trainer t1 sends its share of the buckets in full; t0 dies as it starts its share. The
    receivers cannot assemble the version: every rollout worker keeps the previous one."""
    group = make_group(actors, strategy)
    try:
        group.train(None, seed=6)
        before, version = eval_state(group), group.weight_version
        shares = steps(group, "broadcast")
        assert [s.src for s in shares] == ["t0", "t1"]
        assert set(shares[0].buckets).isdisjoint(shares[1].buckets)
        ray.get(actors["train0"].arm.remote("send", "die"), timeout=30)
        start = time.monotonic()
        with pytest.raises(TrainWorkerDiedError, match="trainer 0"):
            group.sync_weights()
        seconds = time.monotonic() - start
        assert group.weight_version == version
        assert eval_state(group) == before  # nothing applied, nothing torn, anywhere
        for pid in shares[0].dst:
            kind, message, _ = ray.get(policy(group, pid).last_error.remote(), timeout=30)
            assert kind in ("PeerLostError", "SyncTimeoutError", "IncompleteSyncError"), (kind, message)
        report(
            f"one of two senders killed mid-version ({strategy})",
            f"receivers: {kind}; previous version kept everywhere",
            seconds,
        )
    finally:
        group.shutdown()


def test_killed_trainer_leaves_no_shared_memory_behind(actors: dict[str, Any], restore: None) -> None:
    import glob

    from rlfleet.weightsync import cleanup_stale_segments

    group = make_group(actors, "Double")
    uid = group._uid
    assert glob.glob(f"/dev/shm/rlfleet-{uid}*"), "the trainers' node buffers exist while the group runs"
    start = time.monotonic()
    with contextlib.suppress(ray.exceptions.RayActorError):
        ray.get(actors["train1"].crash.remote(), timeout=30)
    group.shutdown()  # every worker leaves; the survivors reclaim buffers whose writer died
    wait_alive([actors["train1"]])
    cleanup_stale_segments()
    leaked = glob.glob(f"/dev/shm/rlfleet-{uid}*")
    for path in leaked:  # leave the machine clean whatever the verdict
        os.unlink(path)
    assert not leaked, leaked
    report(
        "trainer killed holding its node buffer",
        "buffer reclaimed, nothing left in /dev/shm",
        time.monotonic() - start,
    )


# ------------------------------------------------------------------ corruption in shared memory
def test_corrupted_byte_in_a_ring_slot_in_flight_is_caught_by_a_reader_process() -> None:
    """weightsync ShmRing between real processes: the writer publishes, one byte of the slot is
    flipped before the reader process consumes it, the reader's checksum check refuses it."""
    import multiprocessing as mp

    from rlfleet.weightsync import Layout, SharedSegment, ShmRingSender, checksum
    from rlfleet.weightsync.shm._shm_ring import G_DATA_OFFSET

    state = fp.make_model().state_dict()
    layout = Layout.from_state_dict(state, 1 << 20)
    assert len(layout.buckets) == 1  # the whole version fits the ring: published without waiting
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    start = time.monotonic()
    with ShmRingSender(layout, 1, slots=2, checksums=True) as sender:
        proc = ctx.Process(target=fp.ring_reader_process, args=(sender.name, queue, go))
        proc.start()
        try:
            assert queue.get(timeout=120) == "attached"
            # the version is published into the ring; the reader has not looked at it yet
            assert sender.send(state, 1, 10.0, wait_for_readers=False) == {}
            raw = SharedSegment.attach(sender.name)
            header = raw.tensor(0, 4096, dtype=torch.int64)
            slot = raw.tensor(int(header[G_DATA_OFFSET]), layout.buckets[0].nbytes)
            slot[layout["2.weight"].offset + 5] ^= 0x01
            del header, slot
            raw.close()
            go.set()
            kind, message, version, live = queue.get(timeout=120)
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    seconds = time.monotonic() - start
    assert kind == "ChecksumMismatchError", message
    assert "bucket 0" in message
    assert version == -1  # nothing applied
    assert live == checksum(fp.zeros_like(state))
    report("one byte flipped in a shared-memory ring slot", "ChecksumMismatchError, nothing applied", seconds)


@pytest.mark.parametrize("strategy", ["Double", "Shared"])
def test_corrupted_node_segment_is_not_applied(actors: dict[str, Any], restore: None, strategy: str) -> None:
    group = make_group(actors, strategy)
    try:
        group.train(None, seed=3)
        victim = pick(group, actors, "segment")
        ray.get(actors[victim].arm.remote("stage", "corrupt"), timeout=30)
        states = eval_state(group)
        before = dict(zip(EVALS, states, strict=True))[victim]
        version = group.weight_version
        start = time.monotonic()
        with pytest.raises(PolicyGroupError, match="fails its checksum"):
            group.sync_weights()
        seconds = time.monotonic() - start
        kind, message, _ = ray.get(actors[victim].last_error.remote(), timeout=30)
        assert kind == "ChecksumMismatchError", message
        assert ray.get(actors[victim].get_weight_checksum.remote(), timeout=30) == before[1]
        assert group.weight_version == version
        assert eval_state(group) == states  # staged elsewhere, applied nowhere
        report(
            f"one byte flipped in a node buffer ({strategy})",
            "ChecksumMismatchError, nothing applied",
            seconds,
        )
    finally:
        group.shutdown()


# ------------------------------------------------------------------ layout mismatch
@pytest.mark.parametrize("mutation", ["renamed", "reshaped", "dtype"])
def test_layout_mismatch_names_the_parameter_and_applies_nothing(
    actors: dict[str, Any], restore: None, mutation: str
) -> None:
    param = fp.MUTATED_PARAMETER[mutation]
    start = time.monotonic()
    # a rollout worker whose model differs: refused when its buffer is set up
    ray.get(actors["eval3"].mutate.remote(mutation), timeout=30)
    own = ray.get(actors["eval3"].get_weight_checksum.remote(), timeout=30)
    group = PolicyGroup([actors["train0"]], [actors["eval3"]], config("Double"))
    try:
        group.init(TrainConfig())
        group.init_placement_info()
        with pytest.raises(PolicyGroupError, match=re.escape(f"'{param}'")) as info:
            group.init_weight_buffer()
        assert isinstance(info.value.__cause__, LayoutMismatchError)
        renamed_to = {"renamed": "2.offset"}.get(mutation, param)  # either side's name will do
        assert info.value.__cause__.parameter in (param, renamed_to)
        assert ray.get(actors["eval3"].get_weight_checksum.remote(), timeout=30) == own
    finally:
        group.shutdown()
    ray.get(actors["eval3"].mutate.remote(None), timeout=30)
    # the trainers' model changes under them after the group was wired: refused, evals keep v
    group = make_group(actors, "Double")
    try:
        before, version = eval_state(group), group.weight_version
        ray.get([actors[t].mutate.remote(mutation, False) for t in ("train0", "train1")], timeout=30)
        with pytest.raises(PolicyGroupError, match=re.escape(f"'{param}'")):
            group.sync_weights()
        assert group.weight_version == version
        assert eval_state(group) == before
    finally:
        group.shutdown()
    # the trainers re-derive their layout from the changed model: the cross-node receivers
    # refuse it (their error names the parameter), nothing is applied anywhere
    ray.get([actors[t].mutate.remote(None) for t in ("train0", "train1")], timeout=30)
    group = make_group(actors, "Double")
    try:
        before, version = eval_state(group), group.weight_version
        ray.get([actors[t].mutate.remote(mutation) for t in ("train0", "train1")], timeout=30)
        with pytest.raises(PolicyGroupError, match=re.escape(f"'{param}'")):
            group.sync_weights()  # the receivers' error, naming the parameter, is the one raised
        for receiver in (policy(group, pid) for pid in steps(group, "broadcast")[0].dst):
            kind, message, _ = ray.get(receiver.last_error.remote(), timeout=30)
            assert kind == "LayoutMismatchError", message
            assert f"'{param}'" in message
        assert group.weight_version == version
        assert eval_state(group) == before
    finally:
        group.shutdown()
    report(
        f"layout mismatch ({mutation} {param})",
        "LayoutMismatchError names it, nothing applied",
        time.monotonic() - start,
    )


def test_trainer_layout_change_is_refused_by_node_segment_readers(
    actors: dict[str, Any], restore: None
) -> None:
    group = make_group(actors, "Double", evals=("eval0", "eval1"))  # node buffers only
    try:
        assert not steps(group, "broadcast")
        before, version = eval_state(group), group.weight_version
        ray.get([actors[t].mutate.remote("reshaped") for t in ("train0", "train1")], timeout=30)
        start = time.monotonic()
        with pytest.raises(PolicyGroupError, match=re.escape("'2.weight'")):
            group.sync_weights()
        assert group.weight_version == version
        assert eval_state(group) == before
        report(
            "trainer's model no longer fits the layout (node buffers)",
            "LayoutMismatchError names it, nothing applied",
            time.monotonic() - start,
        )
    finally:
        group.shutdown()


# ------------------------------------------------------------------ a rank never joins
def test_comm_group_member_that_never_joins_is_named_within_the_deadline(
    actors: dict[str, Any], restore: None
) -> None:
    group = PolicyGroup([actors["train0"], actors["train1"]], [actors[e] for e in EVALS], config())
    try:
        group.init(TrainConfig())
        group.init_placement_info()
        group.init_weight_buffer()
        ray.get(actors["eval2"].arm.remote("join", "hang", 120.0), timeout=30)
        start = time.monotonic()
        with pytest.raises(CommGroupError) as info:
            group.init_comm_group("gloo")
        seconds = time.monotonic() - start
        # every other rank gives up after group_timeout_s; the driver's wait has 15 s of margin
        assert seconds < GROUP_TIMEOUT_S + 15.0 + 10.0, seconds
        message = str(info.value)
        assert re.search(r"rank \d+ \(rollout worker 2\b", message), message
    finally:
        ray.get(actors["eval2"].release.remote(), timeout=30)
        group.shutdown()
    report("comm group: rollout worker 2 never joins", "CommGroupError names its rank", seconds)


# ------------------------------------------------------------------ restart and rejoin
def test_restarted_eval_rejoins_gets_the_current_version_and_is_routed_again(
    actors: dict[str, Any], restore: None
) -> None:
    group = make_group(actors, "Double")
    try:
        group.train(None, seed=4)
        group.sync_weights()
        current = trainer_sum(group)
        victim = actors["eval3"]
        old_pid = ray.get(victim.get_pid.remote(), timeout=30)
        victim.crash.remote()
        start = time.monotonic()
        # requests routed to it meanwhile reach the restarted process: refused, never served
        # with its initial weights
        x = torch.zeros(8, fp.OBS_DIM).tolist()
        for _ in range(4):
            resp = group.rollout_batch(BatchedData([f"env-{i}" for i in range(8)], x))
            for ref in resp.values():
                answer, error = None, None
                try:
                    answer = ray.get(ref, timeout=60)
                except ray.exceptions.RayTaskError as exc:
                    error = exc.cause
                except ray.exceptions.RayActorError as exc:
                    error = exc
                if answer is not None:
                    assert answer["version"] == group.weight_version, answer
                else:
                    assert isinstance(error, WorkerDiedError | ray.exceptions.RayActorError), error
        group.train(None, seed=5)
        group.sync_weights()  # finds it dead (or restarted, refusing): dropped, the others move on
        assert_not_planned(group, victim)
        wait_alive([victim])  # Ray restarted it: a fresh process with the initial weights
        assert ray.get(victim.get_pid.remote(), timeout=30) != old_pid
        current = trainer_sum(group)
        # rejoin: back into the group, re-planned, buffers and groups rebuilt
        group.push(victim, "eval")
        group.init_eval()
        group.init_placement_info()
        group.init_weight_buffer()
        group.init_comm_group("gloo")
        group.sync_weights()
        seconds = time.monotonic() - start
        assert len(group.eval_list) == 4
        assert eval_state(group) == [(group.weight_version, current)] * 4
        out = rollout(group, 16)
        assert 3 in {r["worker"] for r in out}
        assert {r["version"] for r in out} == {group.weight_version}
        report("eval restarted after a crash", "rejoined, current weights, routed again", seconds)
    finally:
        group.shutdown()
