"""A trainer's snapshots for non-blocking syncs (Ray-free): the fence waits for every snapshot
the group asked for, arrived or not; a copy is the weights of its instant; a copy overwritten by
a newer one, or of the wrong kind, is an error, never the live weights."""

from __future__ import annotations

import threading

import pytest
import torch

from rlfleet.policygroup.worker import TrainerSnapshots
from rlfleet.weightsync import Deadline, SyncTimeoutError, WeightSyncError, checksum


def test_the_fence_waits_for_a_snapshot_the_group_asked_for_before_it_arrives() -> None:
    model = torch.nn.Linear(4, 4)
    snaps = TrainerSnapshots(lambda: "trainer 0")
    snaps.expect(1)  # the train call came first (Ray may deliver the two calls in any order)
    with pytest.raises(SyncTimeoutError, match="0 of 1 arrived"):
        snaps.fence(Deadline(0.05))
    before = checksum(model.state_dict())
    arrived = threading.Timer(0.1, snaps.start, (1, 0, ("copy",), Deadline(10), lambda: model, print))
    arrived.start()
    snaps.fence(Deadline(10))  # returns only once v1 arrived and was copied
    with torch.no_grad():
        model.weight.add_(1.0)  # the update, after the fence
    copy = snaps.copy_for(1, Deadline(10))
    assert copy is not None
    assert checksum(copy) == before


def test_a_copy_overwritten_by_a_newer_one_or_of_another_kind_is_refused() -> None:
    model = torch.nn.Linear(4, 4)
    published: list[int] = []
    snaps = TrainerSnapshots(lambda: "trainer 0")
    for version, slot in ((1, 0), (2, 1), (3, 1)):  # v3 takes v2's slot: v2 was skipped
        snaps.start(version, slot, ("copy",), Deadline(10), lambda: model, lambda v, t: published.append(v))
    snaps.fence(Deadline(10))
    assert snaps.copy_for(1, Deadline(10)) is not None
    with pytest.raises(WeightSyncError, match="snapshot of v2 was overwritten by v3"):
        snaps.copy_for(2, Deadline(10))
    assert snaps.copy_for(4, Deadline(10)) is None  # never asked for: a blocking sync's live weights
    with pytest.raises(WeightSyncError, match="the sync plan changed since it was taken"):
        snaps.require(3, "publish")
    snaps.start(5, 0, ("publish",), Deadline(10), lambda: model, lambda v, t: published.append(v))
    assert snaps.wait(5, Deadline(10)) is True
    assert published == [5]  # the node writer's snapshot is its publish
    with pytest.raises(ValueError, match="kinds must be some of"):
        snaps.start(6, 0, ("gather",), Deadline(10), lambda: model, print)
    snaps.fence(Deadline(1))  # a refused request arrived all the same: nothing to wait for


def test_a_failed_snapshot_is_raised_to_the_sync_not_to_the_fence() -> None:
    model = torch.nn.Linear(4, 4)
    snaps = TrainerSnapshots(lambda: "trainer 0")

    def publish(version: int, timeout_s: float) -> None:
        raise RuntimeError("node buffer gone")

    snaps.start(1, 0, ("publish",), Deadline(10), lambda: model, publish)
    snaps.fence(Deadline(10))  # the weights may change: nothing is being read
    with pytest.raises(WeightSyncError, match="the snapshot of v1 failed: node buffer gone"):
        snaps.wait(1, Deadline(10))


def test_a_burst_keeps_the_copy_a_running_send_reads() -> None:
    """The group's pipeline gives every version that arrives while v1 is being sent the other
    slot (each absorbing the one before): v1's copy stays sendable however many come (a burst of
    five once lost it to an age rule: 'overwritten by v4' while its slot was untouched)."""
    model = torch.nn.Linear(4, 4)
    snaps = TrainerSnapshots(lambda: "trainer 0")
    snaps.start(1, 0, ("copy",), Deadline(10), lambda: model, print)
    snaps.fence(Deadline(10))
    at_v1 = checksum(model.state_dict())
    for version in (2, 3, 4, 5):  # v1 running in slot 0: the newer ones share slot 1
        with torch.no_grad():
            model.weight.add_(1.0)
        snaps.start(version, 1, ("copy",), Deadline(10), lambda: model, print)
        snaps.fence(Deadline(10))
    copy = snaps.copy_for(1, Deadline(10))
    assert copy is not None
    assert checksum(copy) == at_v1
    with pytest.raises(WeightSyncError, match="snapshot of v4 was overwritten by v5"):
        snaps.copy_for(4, Deadline(10))
    newest = snaps.copy_for(5, Deadline(10))
    assert newest is not None
    assert checksum(newest) == checksum(model.state_dict())


def test_a_second_group_on_the_same_trainer_counts_its_own_snapshots() -> None:
    """A trainer actor outlives a group: the next group asks from 0 again. Its count must not be
    met by the earlier group's arrivals (CI once saw an update land in a Sharded snapshot: the
    second group's `train` said 'one asked', the trainer had received three, and the fence let the
    optimizer step before the new request arrived)."""
    model = torch.nn.Linear(4, 4)
    snaps = TrainerSnapshots(lambda: "trainer 0")
    for version in (1, 2, 3):  # the first group
        snaps.start(version, version % 2, ("copy",), Deadline(10), lambda: model, print, "group-a")
    snaps.expect(3, "group-a")
    snaps.fence(Deadline(10))
    snaps.expect(1, "group-b")  # the second group's train call came before its request
    assert snaps.pending == 1
    with pytest.raises(SyncTimeoutError, match="3 of 4 arrived"):
        snaps.fence(Deadline(0.05))
    before = checksum(model.state_dict())
    arrived = threading.Timer(
        0.1, snaps.start, (4, 0, ("copy",), Deadline(10), lambda: model, print, "group-b")
    )
    arrived.start()
    snaps.fence(Deadline(10))
    with torch.no_grad():
        model.weight.add_(1.0)
    copy = snaps.copy_for(4, Deadline(10))
    assert copy is not None
    assert checksum(copy) == before
