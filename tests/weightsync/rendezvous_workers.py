"""Process bodies for the rendezvous-generation tests (spawned, under `run_ranks`).

Stale keys (left by an earlier join of the same name) and foreign ones (written by someone who
is not the rank) must never stand in for a rank: the join fails naming that rank, within its
deadline, as a RendezvousTimeoutError.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import weightsync_dist_workers as w
from cupy_nccl_standin import StandInNccl
from member_workers import finish, member_store

from rlfleet.weightsync import Deadline, MemberGroup

DEADLINE = 30.0


def _reduce(group: MemberGroup) -> float:
    value = torch.ones(1)
    group.process_group.allreduce([value]).wait()
    return float(value.item())


def _timed(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    result = w.outcome(fn)
    result["seconds"] = time.monotonic() - start
    return result


def scenario_member_stale(rank: int, world: int, port: int) -> dict[str, Any]:
    """All three build group "g" and use it; then 0 and 1 rebuild "g" while 2 stays away.

    Rank 2's check-in keys from the first build are still in the store: before generations,
    the rebuild took them for rank 2 and went on into gloo's connect (a raw DistStoreError
    after the store timeout, naming no rank).
    """
    store = member_store(rank)
    out: dict[str, Any] = {"first": _reduce(MemberGroup.create(store, "g", rank, world, timeout_s=DEADLINE))}
    if rank != 2:
        out["rebuild"] = _timed(lambda: MemberGroup.create(store, "g", rank, world, timeout_s=3.0) and None)
        out["again"] = _reduce(MemberGroup.create(store, "g2", rank, 2, timeout_s=DEADLINE))
    finish(store, rank, range(world))
    return out


def scenario_member_spoofed(rank: int, world: int, port: int) -> dict[str, Any]:
    """Process 2 writes check-in keys for member 2 of group "h" (old and new key names) and
    never joins; members 0 and 1 must be told member 2 is missing."""
    store = member_store(rank)
    out: dict[str, Any] = {}
    if rank == 2:
        store.set("rlfleet/member/h/join/2", "1")  # what the old check-in looked for
        store.set("rlfleet/member/h/nonce/2", "spoofed")  # a check-in no rank will acknowledge
        store.set("test/spoofed", "1")
    else:
        end = time.monotonic() + DEADLINE
        while not store.check(["test/spoofed"]) and time.monotonic() < end:
            time.sleep(0.01)
        out["spoofed"] = _timed(lambda: MemberGroup.create(store, "h", rank, world, timeout_s=3.0) and None)
    finish(store, rank, range(world))
    return out


def scenario_nccl_standin(rank: int, world: int, port: int, version: int, root: str) -> dict[str, Any]:
    """`join_communicator` with CuPy `version`'s NCCL signatures (the stand-in), rank 1 the source.

    "first": everyone builds group "w". "again": everyone rebuilds "w" on the same store,
    rank 2 late (its first-build check-in is read before it replaces it). "absent": 0 and 1
    rebuild "w" without rank 2. Each build returns the id its communicator was made from.
    """
    from rlfleet.weightsync.cuda._nccl_init import join_communicator

    store = member_store(rank)
    nccl = StandInNccl(version, root)

    def build(seconds: float) -> str:
        comm = join_communicator(nccl, store, "w", rank, world, 1, Deadline(seconds))
        return str(comm.unique_id.hex())

    out: dict[str, Any] = {"first": build(DEADLINE)}
    if rank == 2:
        time.sleep(1.0)  # rank 2 joins the rebuild late (after the others read its old check-in)
    out["again"] = build(DEADLINE)
    if rank != 2:
        out["absent"] = _timed(lambda: build(3.0))
    finish(store, rank, range(world))
    return out
