"""ShmRing: one writer, many reader processes, bucket slots in shared memory, every failure clean."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
import shm_workers as w
import torch

from rlfleet.weightsync import (
    ChecksumMismatchError,
    DirectBuffer,
    DoubleBuffer,
    LayoutMismatchError,
    PeerLostError,
    SharedSegment,
    ShmRingReceiver,
    ShmRingSender,
    SyncTimeoutError,
    WeightSyncError,
    checksum,
    cleanup_stale_segments,
)
from rlfleet.weightsync.shm._shm_ring import G_DATA_OFFSET, G_SLOT_BYTES

SMALL_BUCKET = 16 * 1024


def _collect(queue: Any, count: int) -> list[tuple[Any, str, Any]]:
    return [queue.get(timeout=w.TIMEOUT) for _ in range(count)]


@pytest.mark.parametrize(("slots", "checksums"), [(2, False), (3, True)])
def test_round_trip_to_reader_processes_for_many_versions(slots: int, checksums: bool) -> None:
    readers, versions = 3, 3
    layout = w.layout_of(w.make_state(1), SMALL_BUCKET)
    assert len(layout.buckets) > slots, "the ring must wrap around"
    queue = w.context().Queue()
    with ShmRingSender(layout, readers, slots=slots, checksums=checksums) as sender, w.processes() as procs:
        for i in range(readers):
            w.start(procs, w.ring_reader, sender.name, i, SMALL_BUCKET, versions, queue)
        for version in range(1, versions + 1):
            outcome = sender.send(w.make_state(version), version, w.TIMEOUT)
            assert outcome == dict.fromkeys(range(readers), "committed")
            results = _collect(queue, readers)
            expected = checksum(w.make_state(version))
            assert sorted(r[0] for r in results) == list(range(readers))
            for _, status, payload in results:
                assert status == "ok", payload
                assert payload == (version, expected)


def test_in_process_round_trip_into_each_buffer() -> None:
    state = w.make_state(4)
    layout = w.layout_of(state, SMALL_BUCKET)
    live_direct, live_double = w.zeros_like_layout(layout), w.zeros_like_layout(layout)
    buffers = [DirectBuffer(live_direct, layout), DoubleBuffer(live_double, layout)]
    with ShmRingSender(layout, 2, checksums=True) as sender:
        receivers = [ShmRingReceiver.attach(sender.name, i) for i in range(2)]
        threads = [
            threading.Thread(target=r.receive, args=(b, w.TIMEOUT))
            for r, b in zip(receivers, buffers, strict=True)
        ]
        for t in threads:
            t.start()
        assert sender.send(state, 4, w.TIMEOUT) == {0: "committed", 1: "committed"}
        for t in threads:
            t.join()
        for r in receivers:
            r.close()
    assert checksum(live_direct) == checksum(live_double) == checksum(state)
    assert [b.version for b in buffers] == [4, 4]


def test_layout_mismatch_names_the_parameter_and_applies_nothing() -> None:
    layout = w.layout_of(w.make_state(1), SMALL_BUCKET)
    queue = w.context().Queue()
    with ShmRingSender(layout, 2) as sender, w.processes() as procs:
        w.start(procs, w.ring_reader, sender.name, 0, SMALL_BUCKET, 1, queue)
        w.start(
            procs,
            w.ring_reader,
            sender.name,
            1,
            SMALL_BUCKET,
            1,
            queue,
            None,
            None,
            None,
            None,
            ("step", (2,)),
        )
        outcome = sender.send(w.make_state(2), 2, w.TIMEOUT)
        assert outcome == {0: "committed", 1: "failed"}
        results = {r[0]: r[1:] for r in _collect(queue, 2)}
    assert results[0] == ("ok", (2, checksum(w.make_state(2))))
    status, (message, version, live_sum) = results[1]
    assert status == "LayoutMismatchError"
    assert "'step'" in message
    assert version == -1
    assert live_sum == checksum(w.zeros_like_layout(w.layout_of(_with_step_shape((2,)), SMALL_BUCKET)))


def _with_step_shape(shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    state = w.make_state(1)
    state["step"] = torch.zeros(shape, dtype=torch.int64)
    return state


def test_out_of_order_version_is_refused_by_the_reader() -> None:
    layout = w.layout_of(w.make_state(1), SMALL_BUCKET)
    queue = w.context().Queue()
    with ShmRingSender(layout, 1) as sender, w.processes() as procs:
        w.start(procs, w.ring_reader, sender.name, 0, SMALL_BUCKET, 1, queue, None, None, None, 5)
        assert sender.send(w.make_state(3), 3, w.TIMEOUT) == {0: "failed"}
        ((_, status, (message, version, live_sum)),) = _collect(queue, 1)
    assert status == "VersionError", message
    assert version == 5
    assert live_sum == checksum(w.make_state(5))


def test_corrupted_slot_with_checksums_applies_nothing() -> None:
    state = w.make_state(1)
    layout = w.layout_of(state, 1 << 20)
    assert len(layout.buckets) == 1
    live = w.zeros_like_layout(layout)
    buffer = DoubleBuffer(live, layout)
    before = checksum(live)
    with ShmRingSender(layout, 1, slots=2, checksums=True) as sender:
        receiver = ShmRingReceiver.attach(sender.name, 0)
        # Everything fits the slots, so the writer publishes and commits without waiting for us.
        assert sender.send(state, 1, w.TIMEOUT, wait_for_readers=False) == {}
        raw = SharedSegment.attach(sender.name)
        header = raw.tensor(0, 4096, dtype=torch.int64)
        data_offset = int(header[G_DATA_OFFSET])
        assert int(header[G_SLOT_BYTES]) >= layout.buckets[0].nbytes
        slot = raw.tensor(data_offset, layout.buckets[0].nbytes)
        slot[layout["transposed"].offset + 3] ^= 0x40
        with pytest.raises(ChecksumMismatchError, match="bucket 0") as info:
            receiver.receive(buffer, w.TIMEOUT)
        assert info.value.bucket == 0
        del header, slot
        raw.close()
        receiver.close()
    assert checksum(live) == before
    assert buffer.version == -1
    assert buffer.pending_version is None


@pytest.mark.timeout(400)
def test_sender_killed_mid_send_readers_lose_it_cleanly() -> None:
    readers = 2
    ctx = w.context()
    queue, sender_queue = ctx.Queue(), ctx.Queue()
    at_gate = [ctx.Event() for _ in range(readers)]
    go = ctx.Event()
    with w.processes() as procs:
        sender = w.start(procs, w.ring_sender_then_hang, SMALL_BUCKET, readers, sender_queue, (1, 2))
        _, name = sender_queue.get(timeout=w.TIMEOUT)
        for i in range(readers):
            w.start(procs, w.ring_reader, name, i, SMALL_BUCKET, 2, queue, (2, 1), at_gate[i], go)
        first = _collect(queue, readers)
        assert all(r[1] == "ok" and r[2] == (1, checksum(w.make_state(1))) for r in first), first
        for event in at_gate:  # both readers are inside version 2: the sender is mid-send
            assert event.wait(w.TIMEOUT)
        os.kill(sender.pid or 0, signal.SIGKILL)
        sender.join(w.TIMEOUT)
        go.set()
        second = _collect(queue, readers)
    for _, status, (message, version, live_sum) in second:
        assert status == "PeerLostError", message
        assert "died" in message
        assert version == 1
        assert live_sum == checksum(w.make_state(1))
    assert name in cleanup_stale_segments(w.TEST_PREFIX)


def test_dead_reader_is_named_or_dropped() -> None:
    layout = w.layout_of(w.make_state(1), SMALL_BUCKET)
    ctx = w.context()
    for drop in (False, True):
        queue = ctx.Queue()
        at_gate, go = ctx.Event(), ctx.Event()
        with ShmRingSender(layout, 2, drop_dead_readers=drop) as sender, w.processes() as procs:
            w.start(procs, w.ring_reader, sender.name, 0, SMALL_BUCKET, 1, queue)
            doomed = w.start(
                procs, w.ring_reader, sender.name, 1, SMALL_BUCKET, 1, queue, (1, 1), at_gate, go
            )
            result: dict[str, Any] = {}

            def send(result: dict[str, Any] = result) -> None:
                try:
                    result["outcome"] = sender.send(w.make_state(1), 1, w.TIMEOUT)
                except WeightSyncError as exc:
                    result["error"] = exc

            thread = threading.Thread(target=send)
            thread.start()
            assert at_gate.wait(w.TIMEOUT)
            os.kill(doomed.pid or 0, signal.SIGKILL)
            doomed.join(w.TIMEOUT)
            thread.join(w.TIMEOUT)
            (survivor,) = _collect(queue, 1)
        if drop:
            assert result["outcome"] == {0: "committed", 1: "dropped"}
            assert survivor[1:] == ("ok", (1, checksum(w.make_state(1))))
        else:
            assert isinstance(result["error"], PeerLostError)
            assert "reader 1" in str(result["error"])
            assert survivor[1] == "SyncAbortedError"
            assert survivor[2][1:] == (-1, checksum(w.zeros_like_layout(layout)))


def test_slow_reader_times_out_the_sender_and_the_session_aborts() -> None:
    state = w.make_state(1)
    layout = w.layout_of(state, SMALL_BUCKET)
    live = w.zeros_like_layout(layout)
    buffer = DoubleBuffer(live, layout)
    entered, release = threading.Event(), threading.Event()
    original = buffer.consume

    def slow(k: int, data: torch.Tensor) -> None:
        entered.set()
        release.wait(w.TIMEOUT)
        original(k, data)

    buffer.consume = slow  # type: ignore[method-assign]
    with ShmRingSender(layout, 1) as sender:
        receiver = ShmRingReceiver.attach(sender.name, 0)
        thread, errors = w.receive_in_thread(receiver, buffer, w.TIMEOUT)
        with pytest.raises(SyncTimeoutError, match="reader 0"):
            sender.send(state, 1, 0.5)
        assert entered.is_set()
        release.set()
        thread.join(w.TIMEOUT)
        receiver.close()
    assert [type(e).__name__ for e in errors] == ["SyncAbortedError"]
    assert buffer.version == -1
    assert checksum(live) == checksum(w.zeros_like_layout(layout))


def test_sender_checks_its_state_dict_before_publishing() -> None:
    state = w.make_state(1)
    layout = w.layout_of(state, SMALL_BUCKET)
    with ShmRingSender(layout, 1) as sender:
        bad = dict(state)
        bad["transposed"] = torch.zeros(1)
        with pytest.raises(LayoutMismatchError, match="'transposed'"):
            sender.send(bad, 1, 1.0)
        assert sender.session == 0
        with pytest.raises(SyncTimeoutError, match="reader 0 to attach"):
            sender.send(state, 1, 0.05)


def test_reader_index_checks() -> None:
    layout = w.layout_of(w.make_state(1), SMALL_BUCKET)
    with ShmRingSender(layout, 1) as sender:
        with pytest.raises(ValueError, match="out of range"):
            ShmRingReceiver.attach(sender.name, 1)
        receiver = ShmRingReceiver.attach(sender.name, 0)
        receiver.close()
    with pytest.raises(ValueError, match="slots"):
        ShmRingSender(layout, 1, slots=1)
