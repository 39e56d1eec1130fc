"""Non-blocking sends (``wait=False``): the snapshot is what is sent, whatever the trainer does to
its weights after the fence; a background failure is raised by the sender's next call; a burst
of versions sends the newest, never a queue of stale ones (`SendPipeline`, `WeightSnapshot`)."""

from __future__ import annotations

import threading
from typing import Any

import background_workers as b
import pytest
import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    Deadline,
    Layout,
    LayoutMismatchError,
    PublishHandle,
    SendPipeline,
    SyncTimeoutError,
    WeightSnapshot,
    checksum,
)


@pytest.fixture(scope="module")
def background() -> dict[int, Any]:
    return w.run_ranks(b.scenario_background_broadcast, 3, timeout=180.0)


@pytest.mark.timeout(200)
def test_a_background_broadcast_sends_the_snapshot_not_the_weights_changed_after_the_fence(
    background: dict[int, Any],
) -> None:
    for version in (*b.VERSIONS, 4):
        assert background[0][f"v{version}"] == {"sent": version, "skipped": False}
        for rank in (1, 2):
            got = background[rank][f"v{version}"]
            assert got["ok"], (rank, got)
            assert got["applied"] == version, (rank, got)
            # the weights of the instant of the snapshot, not the 100+v the trainer wrote after
            assert got["checksum"] == checksum(w.make_state(version)), (rank, version)


@pytest.mark.timeout(200)
def test_a_failed_background_broadcast_is_raised_by_the_next_call_and_the_group_goes_on() -> None:
    results = w.run_ranks(b.scenario_background_failure, 3, timeout=180.0)
    sender = results[0]
    assert sender["v1 finished"] is True
    assert sender["v2"]["ok"] is False
    assert sender["v2"]["type"] == "LayoutMismatchError", sender
    assert sender["v3"] == {"ok": True, "value": 3}
    for rank in (1, 2):
        assert results[rank]["v1"]["ok"] is False
        assert results[rank]["v3"] == {"ok": True, "value": 3}
        assert results[rank]["applied"] == 3


# -- the pipeline, in one process -------------------------------------------------------------
class Trainer:
    """A model, its snapshot slots, and a send that waits for `gate` (a slow receiver)."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(32, 32)
        self.snapshot = WeightSnapshot(Layout.from_state_dict(self.model.state_dict(), 4096))
        self.pipeline: SendPipeline[float] = SendPipeline("test sender")
        self.gate = threading.Event()
        self.sent: list[float] = []

    def step(self, value: float) -> None:
        with torch.no_grad():
            self.model.weight.fill_(value)

    def submit(self, version: int, coalesce: bool = True) -> PublishHandle[float]:
        def send(slot: int) -> float:
            assert self.gate.wait(30)
            self.sent.append(float(self.snapshot.state_dict(slot)["weight"][0, 0]))
            return self.sent[-1]

        def take(slot: int) -> None:
            self.snapshot.take(slot, self.model.state_dict())

        return self.pipeline.submit(version, Deadline(30), take, send, coalesce=coalesce)


def test_a_burst_of_versions_sends_the_newest_and_skips_the_waiting_ones() -> None:
    t = Trainer()
    t.step(1.0)
    first = t.submit(1)
    first.snapshot_done()
    while t.pipeline._running is None:  # v1 is on its way (held by the slow receiver)
        threading.Event().wait(0.001)
    handles = []
    for version in (2, 3, 4, 5):
        t.step(float(version))
        handles.append(t.submit(version))
        handles[-1].snapshot_done()
        t.step(-1.0)  # after the fence: never sent
    t.gate.set()
    assert first.result() == 1.0
    assert not first.skipped
    assert [h.result() for h in handles] == [5.0] * 4
    assert [h.skipped for h in handles] == [True, True, True, False]
    assert {h.sent_version for h in handles} == {5}
    assert t.sent == [1.0, 5.0]  # v2..v4 never left: no queue of stale versions


def test_without_coalescing_every_version_is_sent_with_its_own_bytes() -> None:
    """``coalesce=False`` (a snapshot that commits, as a node buffer's publish): every version is
    sent, in order, each from its own slot. With v1 on its way and v2 waiting, v3 waits for v2 to
    start (before: v3 took v2's slot and v2 went out with v3's bytes, or not at all)."""
    t = Trainer()
    handles: list[PublishHandle[float]] = []
    submitted: list[int] = []

    def burst() -> None:
        for version in (1, 2, 3, 4):
            t.step(float(version))
            handles.append(t.submit(version, coalesce=False))
            handles[-1].snapshot_done()
            submitted.append(version)
            t.step(-1.0)  # after the fence: never sent

    thread = threading.Thread(target=burst)
    thread.start()
    deadline = Deadline(10)
    while len(submitted) < 2:  # v1 running (held by the gate), v2 waiting
        deadline.check("v1 and v2 submitted")
        threading.Event().wait(0.001)
    threading.Event().wait(0.2)
    assert submitted == [1, 2], "v3 must wait for a slot while v1 runs and v2 waits"
    t.gate.set()
    thread.join(30)
    assert [h.result() for h in handles] == [1.0, 2.0, 3.0, 4.0]
    assert [h.skipped for h in handles] == [False] * 4
    assert t.sent == [1.0, 2.0, 3.0, 4.0]


def test_an_uncollected_failure_is_raised_once_by_the_next_submit() -> None:
    pipeline: SendPipeline[int] = SendPipeline("failing sender")

    def fail(_slot: int) -> int:
        raise RuntimeError("receiver gone")

    handle = pipeline.submit(1, Deadline(10), lambda slot: None, fail)
    assert handle.wait(10)
    with pytest.raises(RuntimeError, match="receiver gone"):
        pipeline.submit(2, Deadline(10), lambda slot: None, lambda slot: 2)
    assert pipeline.submit(3, Deadline(10), lambda slot: None, lambda slot: 3).result() == 3
    collected = pipeline.submit(4, Deadline(10), lambda slot: None, fail)
    with pytest.raises(RuntimeError):
        collected.result()  # seen here: the next submit does not raise it again
    assert pipeline.submit(5, Deadline(10), lambda slot: None, lambda slot: 5).result() == 5


def test_a_failed_snapshot_is_raised_at_the_fence_and_nothing_is_sent() -> None:
    pipeline: SendPipeline[int] = SendPipeline("snapshot fails")
    sent: list[int] = []

    def take(_slot: int) -> None:
        raise LayoutMismatchError("parameter 'w' has shape (3,), layout says (4,)", "w")

    handle = pipeline.submit(1, Deadline(10), take, lambda slot: sent.append(1) or 1)
    with pytest.raises(LayoutMismatchError, match="'w'"):
        handle.snapshot_done()
    with pytest.raises(LayoutMismatchError):
        handle.result()
    assert sent == []


def test_waits_on_a_handle_are_bounded() -> None:
    release = threading.Event()
    pipeline: SendPipeline[int] = SendPipeline("stuck sender")
    handle = pipeline.submit(1, Deadline(30), lambda slot: None, lambda slot: int(release.wait(30)))
    with pytest.raises(SyncTimeoutError, match="v1"):
        handle.result(timeout=0.05)
    assert handle.wait(timeout=0.01) is False
    release.set()
    assert handle.result() == 1


def test_a_snapshot_copies_a_state_dict_a_stream_or_a_share() -> None:
    state = w.make_state(7)
    layout = w.layout_of(state)
    snapshot = WeightSnapshot(layout)
    taken = snapshot.take(0, state)
    assert checksum(taken) == checksum(state)
    assert all(
        t.untyped_storage().data_ptr() != state[n].untyped_storage().data_ptr() for n, t in taken.items()
    )
    streamed = snapshot.take(1, ((s.name, state[s.name]) for s in layout.tensors))
    assert checksum(streamed) == checksum(state)
    share = snapshot.take(0, state, buckets=[0])
    assert set(share) == {t.name for t in layout.buckets[0].tensors}
    with pytest.raises(LayoutMismatchError, match="'scalar'"):
        snapshot.take(0, {k: v for k, v in state.items() if k != "scalar"})
    with pytest.raises(ValueError, match="slot 2"):
        snapshot.take(2, state)
