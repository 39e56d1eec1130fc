"""Shared buffers and rings under faults: failed versions, stuck readers, deadlines, bounded waits.

Each test reproduces a broken promise found by adversarial testing (issue 15), with real
processes where a process is involved; no assertion is on time (the pytest timeout, well below
the buffers' own 200 s timeout, is what shows a wait ended by the caller's deadline).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
import shm_workers as w
import torch

import rlfleet.weightsync.shm._ring_format as ring_format
import rlfleet.weightsync.shm._shared_reader as shared_reader
import rlfleet.weightsync.shm._shm_ring as shm_ring
from rlfleet.weightsync import (
    Deadline,
    DoubleBuffer,
    MetadataError,
    SharedBuffer,
    SharedBufferReader,
    SharedSegment,
    ShmRingReceiver,
    ShmRingSender,
    SyncTimeoutError,
    VersionError,
    checksum,
    cleanup_stale_segments,
)
from rlfleet.weightsync.shm._shared_format import R_IN_USE, WRITING, SlotTable

BUCKET = 16 * 1024
pytestmark = pytest.mark.timeout(120)


def _layout() -> Any:
    return w.layout_of(w.make_state(1), BUCKET)


def _wait_for_a_claim(shared_name: str) -> None:
    """Poll the segment until the writer has marked a slot WRITING (it claimed one)."""
    segment = SharedSegment.attach(shared_name, map_whole=False)
    try:
        table, _, _ = SlotTable.of(segment)
        Deadline(w.TIMEOUT).poll(
            lambda: any(table.state(j) == WRITING for j in range(table.num_slots)), "a slot claim"
        )
        table.detach()
    finally:
        segment.close()


def _reader_reports(queue: Any) -> tuple[int, str, Any]:
    index, status, payload = queue.get(timeout=w.TIMEOUT)
    assert status == "ok", payload
    return index, status, payload


# -- 1. a failed version never destroys the newest committed one --------------------------------
def test_aborted_version_leaves_the_newest_committed_version_for_new_readers() -> None:
    """A reader serves v1 in one slot, v2 is committed in the other and unread, v3 begins and is
    aborted: v2 must still be what a new reader binds (it was overwritten and lost)."""
    layout = w.layout_of(w.make_state(1), w.BUCKET)
    ctx = w.context()
    queue, serving, late = ctx.Queue(), ctx.Queue(), ctx.Queue()
    with SharedBuffer(layout, 3, timeout_s=w.TIMEOUT) as shared, w.processes() as procs:
        shared.publish(w.make_state(1), 1)
        w.start(procs, w.shared_reader, shared.name, serving, queue)
        serving.put(1)
        assert _reader_reports(queue)[2][0] == 1
        shared.publish(w.make_state(2), 2)
        began = threading.Thread(target=w.stage, args=(shared, 3, 2))
        began.start()  # must not take v2's slot: waits for the reader to leave v1's
        _wait_for_a_claim(shared.name)
        serving.put("refresh")
        assert _reader_reports(queue)[2][:2] == (2, checksum(w.make_state(2)))
        began.join(w.TIMEOUT)
        assert shared.pending_version == 3
        shared.abort(RuntimeError("the sync of v3 failed"))
        w.start(procs, w.shared_reader, shared.name, late, queue)
        late.put("refresh")
        version, digest, inside, _ = _reader_reports(queue)[2]
        assert (version, digest, inside) == (2, checksum(w.make_state(2)), True)
        for commands in (serving, late):
            commands.put("stop")


@pytest.mark.timeout(300)
def test_writer_killed_mid_publish_leaves_the_newest_committed_version() -> None:
    """The same with the writer process SIGKILLed while it writes v3."""
    ctx = w.context()
    queue, commands, late_queue, late = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    prefix = f"{w.TEST_PREFIX}-killed"
    with w.processes() as procs:
        writer = w.start(procs, w.shared_writer, queue, commands, prefix)
        _, name = queue.get(timeout=w.TIMEOUT)
        commands.put(("publish", 1))
        assert queue.get(timeout=w.TIMEOUT) == ("publish", 1)
        serving = SharedBufferReader.attach(name)
        assert serving.refresh() == 1
        commands.put(("publish", 2))
        assert queue.get(timeout=w.TIMEOUT) == ("publish", 2)
        commands.put(("stage", 3, 2))
        _wait_for_a_claim(name)
        assert serving.refresh() == 2  # v3 did not take v2's slot
        assert queue.get(timeout=w.TIMEOUT) == ("stage", 3)
        os.kill(writer.pid or 0, signal.SIGKILL)
        writer.join(w.TIMEOUT)
        assert serving.latest_version() == 2
        assert checksum(serving.tensors()) == checksum(w.make_state(2))
        w.start(procs, w.shared_reader, name, late, late_queue)
        late.put("refresh")
        version, digest, _, _ = _reader_reports(late_queue)[2]
        assert (version, digest) == (2, checksum(w.make_state(2)))
        late.put("stop")
        serving.close()
    assert name in cleanup_stale_segments(w.TEST_PREFIX)


def test_two_slots_wait_for_a_lingering_reader_and_three_slots_do_not() -> None:
    for slots in (2, 3):
        with SharedBuffer(_layout(), 2, slots=slots, timeout_s=w.TIMEOUT) as shared:
            reader = SharedBufferReader.attach(shared.name, 0)
            shared.publish(w.make_state(1), 1)
            assert reader.refresh() == 1
            shared.publish(w.make_state(2), 2)
            if slots == 2:
                with pytest.raises(SyncTimeoutError, match="reader 0 must refresh"):
                    shared.publish(w.make_state(3), 3, deadline=0.3)
                assert shared.latest_version() == 2
                assert reader.refresh() == 2
            shared.publish(w.make_state(3), 3, deadline=0.3)
            assert checksum(reader.tensors()) == checksum(w.make_state(reader.version))
            assert shared.extra_bytes >= slots * shared.slot_bytes
            reader.close()


# -- 2. what can fail in commit is checked before the vote ----------------------------------
def test_version_that_does_not_fit_the_version_word_is_refused_at_begin() -> None:
    with SharedBuffer(_layout(), 1, timeout_s=w.TIMEOUT) as shared:
        shared.publish(w.make_state(1), 1)
        with pytest.raises(VersionError, match="2\\*\\*63"):
            shared.begin(2**63)
        assert shared.pending_version is None
        assert shared.latest_version() == 1
    sender = ShmRingSender(_layout(), 1)
    with sender, pytest.raises(ValueError, match="2\\*\\*63"):
        sender.send(w.make_state(1), 2**63, 1.0)


class _RefusingBuffer(DoubleBuffer):
    """A receiver whose commit would fail (a serving lock it cannot get): it says so in prepare."""

    def _prepare(self, version: int, deadline: Deadline) -> None:
        raise SyncTimeoutError(f"cannot take the serving lock for version {version}")


def test_prepare_commit_readies_the_shared_buffer_and_a_failing_prepare_applies_nothing() -> None:
    layout = _layout()
    with SharedBuffer(layout, 1, timeout_s=w.TIMEOUT, checksums=True) as shared:
        reader = SharedBufferReader.attach(shared.name)
        w.stage(shared, 1, len(layout.buckets))
        shared.prepare_commit(1, Deadline(w.TIMEOUT))
        shared.commit(1)
        assert reader.refresh() == 1  # the checksums prepare stored verify
        assert checksum(reader.tensors()) == checksum(w.make_state(1))
        w.stage(shared, 2, len(layout.buckets))
        shared.prepare_commit(2, Deadline(w.TIMEOUT))
        shared.abort(RuntimeError("another rank voted failure"))
        assert shared.latest_version() == 1
        reader.close()
    live = w.zeros_like_layout(layout)
    refusing = _RefusingBuffer(live, layout)
    with ShmRingSender(layout, 1) as sender:
        receiver = ShmRingReceiver.attach(sender.name, 0)
        thread, errors = w.receive_in_thread(receiver, refusing, w.TIMEOUT)
        assert sender.send(w.make_state(1), 1, w.TIMEOUT) == {0: "failed"}
        thread.join(w.TIMEOUT)
        receiver.close()
    assert [str(e) for e in errors] == ["cannot take the serving lock for version 1"]
    assert refusing.version == -1
    assert checksum(live) == checksum(w.zeros_like_layout(layout))


# -- 3. commit and abort never wait for the segment lock ------------------------------------
def test_commit_and_abort_finish_while_a_stuck_reader_holds_the_segment_lock() -> None:
    layout = _layout()
    ctx = w.context()
    commands, queue = ctx.Queue(), ctx.Queue()
    everything = len(layout.buckets)
    with SharedBuffer(layout, 1, timeout_s=w.TIMEOUT) as shared, w.processes() as procs:
        w.start(procs, w.lock_holder, shared.name, commands, queue)
        shared.publish(w.make_state(1), 1)
        w.stage(shared, 2, everything)
        commands.put("lock")
        assert queue.get(timeout=w.TIMEOUT) == "held"
        shared.commit(2)  # waited for the lock for timeout_s (200 s), then failed
        assert shared.latest_version() == 2
        with pytest.raises(SyncTimeoutError, match=r"locking segment .* for claiming a slot"):
            w.stage(shared, 3, 0, deadline=0.3)  # the caller's deadline, not timeout_s
        commands.put("release")
        assert queue.get(timeout=w.TIMEOUT) == "released"
        w.stage(shared, 3, 1)
        commands.put("lock")
        assert queue.get(timeout=w.TIMEOUT) == "held"
        shared.abort(RuntimeError("sync failed"))  # waited for the lock without any limit
        assert shared.pending_version is None
        commands.put("release")
        commands.put("stop")
        with SharedBufferReader.attach(shared.name) as reader:
            assert reader.refresh() == 2
            assert checksum(reader.tensors()) == checksum(w.make_state(2))


# -- 7. the caller's deadline reaches SharedBuffer.begin, with the real cause --------------------
@pytest.mark.timeout(200)
def test_ring_receive_into_a_shared_buffer_ends_at_its_deadline_naming_the_reader() -> None:
    layout = _layout()
    ctx = w.context()
    queue = ctx.Queue()
    commands = [ctx.Queue(), ctx.Queue()]
    with (
        SharedBuffer(layout, 2, timeout_s=w.TIMEOUT) as shared,
        ShmRingSender(layout, 1) as sender,
        w.processes() as procs,
    ):
        for version, reader_commands in zip((1, 2), commands, strict=True):  # both slots read
            shared.publish(w.make_state(version), version)
            w.start(procs, w.shared_reader, shared.name, reader_commands, queue)
            reader_commands.put(version)
            assert _reader_reports(queue)[2][0] == version
        receiver = ShmRingReceiver.attach(sender.name, 0)
        thread, errors = w.receive_in_thread(receiver, shared, 2.0)
        assert sender.send(w.make_state(3), 3, w.TIMEOUT) == {0: "failed"}
        thread.join(w.TIMEOUT)
        receiver.close()
        assert [type(e) for e in errors] == [SyncTimeoutError]
        assert "reader 0" in str(errors[0])
        assert "must refresh()" in str(errors[0])
        assert "deadline 2.000s" in str(errors[0])
        assert shared.version == 2
        assert shared.latest_version() == 2
        for reader_commands in commands:
            reader_commands.put("stop")


# -- 8. blocking calls default to a finite deadline ---------------------------------------------
def test_ring_and_reader_calls_without_a_deadline_end_by_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # A ring's omitted deadline is DEFAULT_RING_TIMEOUT_S, bound in its signature (checked in
    # test_node_buffer_deadlines.py); None means that default too, read when called: shortened here.
    monkeypatch.setattr(shm_ring, "DEFAULT_RING_TIMEOUT_S", 0.5)
    monkeypatch.setattr(ring_format, "DEFAULT_RING_TIMEOUT_S", 0.5)
    monkeypatch.setattr(shared_reader, "DEFAULT_TIMEOUT_S", 0.5)
    layout = _layout()
    buffer = DoubleBuffer(w.zeros_like_layout(layout), layout)
    with ShmRingSender(layout, 1) as sender:  # alive and silent
        with pytest.raises(SyncTimeoutError, match="reader 0 to attach"):
            sender.send(w.make_state(1), 1, None)
        receiver = ShmRingReceiver.attach(sender.name, 0)
        with pytest.raises(SyncTimeoutError, match="waiting for the next version"):
            receiver.receive(buffer, None)
        receiver.close()
    with SharedBuffer(layout, 1) as shared, SharedBufferReader.attach(shared.name) as reader:
        with pytest.raises(SyncTimeoutError, match="version 1"):
            reader.check_version(1)
        with pytest.raises(SyncTimeoutError, match="version 1"):
            reader.wait_for_version(1)


# -- 17. a corrupted ring header is a clear error ---------------------------------------------
def test_ring_reader_epoch_at_its_maximum_is_a_clear_error() -> None:
    with ShmRingSender(_layout(), 1) as sender:
        raw = SharedSegment.attach(sender.name)
        words = raw.tensor(0, 4096, dtype=torch.int64)
        ring = shm_ring.RING
        words[ring.header_words + ring.slot_words * sender.num_slots + shm_ring.R_EPOCH] = 2**63 - 1
        with pytest.raises(MetadataError, match="epoch"):
            ShmRingReceiver.attach(sender.name, 0)
        del words
        raw.close()


def test_reader_records_say_which_slot_each_reader_uses() -> None:
    """The control block a writer and a reader share: one description, both sides agree."""
    with SharedBuffer(_layout(), 2, timeout_s=w.TIMEOUT) as shared:
        reader = SharedBufferReader.attach(shared.name, 1)
        shared.publish(w.make_state(1), 1)
        reader.refresh()
        table = shared._header
        assert table.get(table.reader(1, R_IN_USE)) == table.slot_holding(1)
        assert table.reader_alive(1)
        assert not table.reader_alive(0)
        assert table.writer_alive()
        reader.close()
