"""Process bodies for the member-group and rendezvous tests (spawned: they live in a module).

They run under `weightsync_dist_workers.run_ranks`. Member groups need no default group: the
store is a plain TCPStore that process 0 hosts on 127.0.0.1 (`host_store`, port 0) and whose
port the others read from the harness's shared cell.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    DirectBuffer,
    DoubleBuffer,
    MemberGroup,
    checksum,
    host_store,
    join_generation,
)

DEADLINE = 30.0


def member_store(rank: int, host_rank: int = 0, timeout: float = 60.0) -> dist.TCPStore:
    """Process `host_rank` hosts the store on loopback; the others connect to the port it bound."""
    cell = w._STORE_PORT
    if rank == host_rank:
        store = host_store("127.0.0.1", 0, timeout_s=timeout)
        cell.value = store.port
        return store
    end = time.monotonic() + timeout
    while cell.value == 0:
        if time.monotonic() > end:
            raise TimeoutError("the store host never published its port")
        time.sleep(0.005)
    return dist.TCPStore("127.0.0.1", cell.value, is_master=False, timeout=timedelta(seconds=timeout))


def finish(store: dist.TCPStore, rank: int, ranks: Sequence[int]) -> None:
    """Everyone reaches the end before the host leaves (its exit takes the store with it).

    Two rounds: having seen every "done", the others say "bye" and go; the host waits for
    every "bye", so nobody still polls the store when it closes.
    """
    join_generation(store, "test/done", rank, ranks, 60.0, "end of test")
    if rank == 0:
        store.wait([f"test/bye/{r}" for r in ranks if r != rank], timedelta(seconds=60))
    else:
        store.set(f"test/bye/{rank}", "1")


def _live(version: int) -> dict[str, torch.Tensor]:
    return {k: v.clone().contiguous() for k, v in w.make_state(version).items()}


def scenario_member_sync(rank: int, world: int, port: int) -> dict[str, Any]:
    """No default group: member ranks run opposite to process ranks; process 0 sends."""
    store = member_store(rank)
    member = world - 1 - rank
    group = MemberGroup.create(store, "sync", member, world, timeout_s=60.0)
    layout = w.layout_of(w.make_state(0))
    out: dict[str, Any] = {"initialized": dist.is_initialized(), "member": group.rank, "size": group.size}
    if rank == 0:
        sender = BroadcastSender(layout, group, group.rank, direct_min=w.DIRECT_MIN)
        out["v1"] = sender.send(w.make_state(1), 1, DEADLINE).version
        sender.checksums = True
        out["v2"] = sender.send(w.make_state(2), 2, DEADLINE).version
    else:
        consumer: DoubleBuffer | DirectBuffer = (
            DoubleBuffer(_live(0), layout) if rank == 1 else DirectBuffer(_live(0), layout)
        )
        receiver = BroadcastReceiver(layout, group, world - 1)
        for version in (1, 2):
            receiver.receive(consumer, DEADLINE)
            out[f"v{version}"] = {"applied": consumer.version, "checksum": checksum(consumer.live)}
    finish(store, rank, range(world))
    return out


def scenario_member_overlap(rank: int, world: int, port: int) -> dict[str, Any]:
    """Group "a" = processes {0, 1}, group "b" = {1, 2}; process 1 creates b first, then a.

    torch's `new_group` would need all three processes to create both, in one order.
    Process 0 sends version 7 in "a"; process 1 forwards what it applied to process 2 in "b".
    """
    store = member_store(rank)
    layout = w.layout_of(w.make_state(0))
    out: dict[str, Any] = {}
    if rank == 0:
        a = MemberGroup.create(store, "a", 1, 2, timeout_s=60.0)
        BroadcastSender(layout, a, 1, direct_min=w.DIRECT_MIN).send(w.make_state(7), 7, DEADLINE)
    elif rank == 1:
        b = MemberGroup.create(store, "b", 0, 2, timeout_s=60.0)
        a = MemberGroup.create(store, "a", 0, 2, timeout_s=60.0)
        consumer = DoubleBuffer(_live(0), layout)
        BroadcastReceiver(layout, a, 1).receive(consumer, DEADLINE)
        out["a"] = checksum(consumer.live)
        BroadcastSender(layout, b, 0, checksums=True).send(consumer.live, consumer.version, DEADLINE)
    else:
        b = MemberGroup.create(store, "b", 1, 2, timeout_s=60.0)
        consumer = DoubleBuffer(_live(0), layout)
        BroadcastReceiver(layout, b, 0).receive(consumer, DEADLINE)
        out["b"] = checksum(consumer.live)
        out["version"] = consumer.version
    finish(store, rank, range(world))
    return out


def scenario_member_absent(rank: int, world: int, port: int) -> dict[str, Any]:
    """Process 2 never joins group "absent" of size 3: the others are told so, naming member 2."""
    store = member_store(rank)
    out: dict[str, Any] = {}
    if rank != 2:
        start = time.monotonic()
        out["absent"] = w.outcome(lambda: MemberGroup.create(store, "absent", rank, world, timeout_s=2.0))
        out["seconds"] = time.monotonic() - start
    finish(store, rank, range(world))
    return out


def scenario_member_kill(rank: int, world: int, port: int) -> dict[str, Any]:
    """The sender (process 1, member 0) SIGKILLs itself while packing version 2."""
    store = member_store(rank)
    member = (rank - 1) % world
    group = MemberGroup.create(store, "kill", member, world, timeout_s=15.0)
    layout = w.layout_of(w.make_state(0))
    if rank == 1:
        sender = BroadcastSender(layout, group, 0, direct_min=w.DIRECT_MIN)
        sender.send(w.make_state(1), 1, DEADLINE)
        sender.send(w.FlakyMapping(w.make_state(2), "layers.90.w", 1, "kill"), 2, DEADLINE)
        return {"unreachable": True}
    consumer = DoubleBuffer(_live(0), layout)
    receiver = BroadcastReceiver(layout, group, 0)
    receiver.receive(consumer, DEADLINE)
    start = time.monotonic()
    result = w.outcome(lambda: receiver.receive(consumer, 20.0))
    result["seconds"] = time.monotonic() - start
    result["applied"] = consumer.version
    result["checksum"] = checksum(consumer.live)
    result["again"] = w.outcome(lambda: receiver.receive(consumer, 1.0))
    finish(store, rank, [0, 2])
    return result


def scenario_group_key(rank: int, world: int, port: int, port1: int, port2: int) -> dict[str, Any]:
    """Processes 0 and 1 make a group in a first world; then all three start a second world.

    The per-member-set counter now differs between processes (0 and 1 counted a group, 2 did
    not): a keyed group still forms, an unkeyed one does not until `reset_group_numbering`.
    """
    from rlfleet.weightsync import init_process_group_bounded, new_group_bounded, reset_group_numbering

    url = "tcp://127.0.0.1:{}"
    out: dict[str, Any] = {}
    if rank < 2:
        init_process_group_bounded("gloo", url.format(port1), rank, 2, join_timeout=60.0, timeout=30.0)
        new_group_bounded([0, 1], join_timeout=30.0)
        dist.barrier()  # neither leaves while the other still connects the group's pairs
        dist.destroy_process_group()
    init_process_group_bounded("gloo", url.format(port2), rank, world, join_timeout=60.0, timeout=30.0)

    def reduce(group: dist.ProcessGroup) -> float:
        value = torch.ones(1)
        if rank in (0, 1):
            dist.all_reduce(value, group=group)
        return float(value.item())

    keyed = new_group_bounded([0, 1], join_timeout=30.0, key="policy-0")
    out["keyed"] = reduce(keyed)
    dist.barrier()
    out["counted"] = w.outcome(lambda: new_group_bounded([0, 1], join_timeout=2.0) and None)
    dist.barrier()
    reset_group_numbering()
    out["reset"] = reduce(new_group_bounded([0, 1], join_timeout=30.0))
    dist.barrier()
    dist.destroy_process_group()
    return out
