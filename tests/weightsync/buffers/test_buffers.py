"""Weight buffers: versioned, atomic apply; every error leaves the applied version intact."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import shm_workers as w
import torch

from rlfleet.weightsync import (
    BucketConsumer,
    ChecksumMismatchError,
    DirectBuffer,
    DoubleBuffer,
    IncompleteSyncError,
    Layout,
    LayoutMismatchError,
    MetadataError,
    ServingLock,
    SharedBuffer,
    SharedBufferReader,
    ShmRingReceiver,
    ShmRingSender,
    SyncTimeoutError,
    VersionError,
    WeightSyncError,
    checksum,
    flat_block,
    live_tensors,
    pack_bucket,
)

BUCKET = 16 * 1024


def feed(
    consumer: BucketConsumer, state: dict[str, torch.Tensor], version: int, skip: int | None = None
) -> None:
    """Drive one sync by hand, as a transport would (optionally leaving one bucket out)."""
    layout = consumer.layout
    scratch = torch.empty(max(layout.max_bucket_nbytes, 1), dtype=torch.uint8)
    consumer.begin(version)
    for bucket in layout.buckets:
        if bucket.index != skip:
            consumer.consume(bucket.index, pack_bucket(layout, bucket.index, state, scratch).clone())
    consumer.commit(version)


class SharedView:
    """A SharedBuffer with an in-process reader, seen as "the receiver's weights"."""

    def __init__(self, layout: Layout) -> None:
        self.buffer = SharedBuffer(layout, 2, timeout_s=w.TIMEOUT)
        self.reader = SharedBufferReader.attach(self.buffer.name)

    def live(self) -> dict[str, torch.Tensor]:
        self.reader.refresh()
        return self.reader.tensors()

    def close(self) -> None:
        self.reader.close()
        self.buffer.close()


Kind = Callable[[Layout], tuple[Any, Callable[[], dict[str, torch.Tensor]], Callable[[], None]]]


def _direct(layout: Layout) -> tuple[Any, Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    live = w.zeros_like_layout(layout)
    return DirectBuffer(live, layout), lambda: live, lambda: None


def _double(layout: Layout) -> tuple[Any, Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    live = w.zeros_like_layout(layout)
    return DoubleBuffer(live, layout), lambda: live, lambda: None


def _double_swap(layout: Layout) -> tuple[Any, Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    live = w.zeros_like_layout(layout)
    return DoubleBuffer(live, layout, mode="swap"), lambda: live, lambda: None


def _shared(layout: Layout) -> tuple[Any, Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    view = SharedView(layout)
    return view.buffer, view.live, view.close


KINDS: dict[str, Kind] = {
    "direct": _direct,
    "double": _double,
    "double_swap": _double_swap,
    "shared": _shared,
}


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Callable[[], dict[str, torch.Tensor]]]]:
    layout = w.layout_of(w.make_state(1), BUCKET)
    buffer, live, close = KINDS[request.param](layout)
    try:
        yield buffer, live
    finally:
        close()


def test_versions_apply_bit_exact(kind: tuple[Any, Callable[[], dict[str, torch.Tensor]]]) -> None:
    buffer, live = kind
    assert buffer.version == -1
    for version in (1, 2, 5):
        state = w.make_state(version)
        feed(buffer, state, version)
        assert buffer.version == version
        assert checksum(live()) == checksum(state)


def test_every_error_leaves_the_applied_version_intact(
    kind: tuple[Any, Callable[[], dict[str, torch.Tensor]]],
) -> None:
    buffer, live = kind
    feed(buffer, w.make_state(1), 1)
    good = checksum(w.make_state(1))

    def intact() -> None:
        assert buffer.version == 1
        assert buffer.pending_version is None
        assert checksum(live()) == good

    for stale in (0, 1):
        with pytest.raises(VersionError, match="not newer"):
            buffer.begin(stale)
        intact()
    with pytest.raises(IncompleteSyncError, match="missing 1 of"):
        feed(buffer, w.make_state(2), 2, skip=len(buffer.layout.buckets) - 1)
    intact()
    with pytest.raises(WeightSyncError, match="outside a sync"):
        buffer.consume(0, torch.zeros(buffer.layout.buckets[0].nbytes, dtype=torch.uint8))
    intact()

    # Errors mid-stream: the transport aborts, as every transport does on an error.
    nbuckets = len(buffer.layout.buckets)
    zeros = torch.zeros(buffer.layout.buckets[0].nbytes, dtype=torch.uint8)
    short = torch.zeros(buffer.layout.buckets[1].nbytes - 1, dtype=torch.uint8)
    mistakes: list[Callable[[], None]] = [
        lambda: buffer.consume(0, zeros),  # twice
        lambda: buffer.consume(1, short),  # wrong size
        lambda: buffer.consume(nbuckets, zeros),  # no such bucket
        lambda: buffer.commit(4),  # not the pending version
    ]
    for mistake in mistakes:
        buffer.begin(3)
        buffer.consume(0, zeros)
        with pytest.raises((MetadataError, VersionError)) as info:
            mistake()
        buffer.abort(info.value)
        intact()
    buffer.begin(3)
    buffer.consume(0, torch.full((buffer.layout.buckets[0].nbytes,), 0xAB, dtype=torch.uint8))
    buffer.abort(RuntimeError("transport lost"))
    intact()
    feed(buffer, w.make_state(3), 3)  # and the next complete sync applies
    assert checksum(live()) == checksum(w.make_state(3))


def test_begin_while_pending_drops_the_stale_session(
    kind: tuple[Any, Callable[[], dict[str, torch.Tensor]]],
) -> None:
    buffer, live = kind
    buffer.begin(1)
    buffer.consume(0, torch.zeros(buffer.layout.buckets[0].nbytes, dtype=torch.uint8))
    feed(buffer, w.make_state(2), 2)
    assert checksum(live()) == checksum(w.make_state(2))


def test_buffers_check_the_live_tensors_against_the_layout() -> None:
    state = w.make_state(1)
    layout = w.layout_of(state, BUCKET)
    bad = w.zeros_like_layout(layout)
    bad["transposed"] = torch.zeros(3)
    for cls in (DirectBuffer, DoubleBuffer):
        with pytest.raises(LayoutMismatchError, match="'transposed'"):
            cls(bad, layout)
    with pytest.raises(ValueError, match="mode"):
        DoubleBuffer(w.zeros_like_layout(layout), layout, mode="flip")  # type: ignore[arg-type]


# -- Direct ---------------------------------------------------------------------------------------
def test_direct_keeps_nothing_between_syncs() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    buffer = DirectBuffer(w.zeros_like_layout(layout), layout)
    feed(buffer, w.make_state(1), 1)
    assert buffer.extra_bytes == 0
    assert buffer.peak_extra_bytes == layout.padded_bytes
    assert buffer.atomic


def test_direct_in_place_is_not_atomic_and_says_so() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    live = w.zeros_like_layout(layout)
    buffer = DirectBuffer(live, layout, max_staging_bytes=0)
    assert not buffer.atomic
    feed(buffer, w.make_state(1), 1)
    assert buffer.peak_extra_bytes == 0
    assert not buffer.torn
    with pytest.raises(IncompleteSyncError):
        feed(buffer, w.make_state(2), 2, skip=1)
    assert buffer.torn, "in-place buckets already landed: reported, not hidden"
    assert buffer.version == 1
    feed(buffer, w.make_state(3), 3)
    assert not buffer.torn
    assert checksum(live) == checksum(w.make_state(3))


# -- Double ---------------------------------------------------------------------------------------
def test_double_serves_v_while_v_plus_1_arrives_and_commit_waits_for_requests() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    live = w.zeros_like_layout(layout)
    buffer = DoubleBuffer(live, layout, commit_timeout_s=w.TIMEOUT)
    feed(buffer, w.make_state(1), 1)
    scratch = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
    state2 = w.make_state(2)
    buffer.begin(2)
    for bucket in layout.buckets:
        buffer.consume(bucket.index, pack_bucket(layout, bucket.index, state2, scratch))
    assert checksum(live) == checksum(w.make_state(1)), "staging does not touch the live weights"
    committed = threading.Event()
    with buffer.serving():
        thread = threading.Thread(target=lambda: (buffer.commit(2), committed.set()))
        thread.start()
        assert not committed.wait(0.2)  # not a timing claim: the commit cannot run while we serve
        assert checksum(live) == checksum(w.make_state(1))
    thread.join(w.TIMEOUT)
    assert committed.is_set()
    assert checksum(live) == checksum(state2)


def test_double_commit_times_out_behind_a_stuck_request_and_keeps_v() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    live = w.zeros_like_layout(layout)
    buffer = DoubleBuffer(live, layout, commit_timeout_s=0.05)
    feed(buffer, w.make_state(1), 1)
    with buffer.serving(), pytest.raises(SyncTimeoutError, match="in-flight requests"):
        feed(buffer, w.make_state(2), 2)
    assert buffer.version == 1
    assert checksum(live) == checksum(w.make_state(1))
    feed(buffer, w.make_state(2), 2)
    assert checksum(live) == checksum(w.make_state(2))


def _staged(buffer: DirectBuffer | DoubleBuffer, version: int) -> None:
    """Begin `version` and hand every bucket over, as a transport does before the vote."""
    layout = buffer.layout
    scratch = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
    state = w.make_state(version)
    buffer.begin(version)
    for bucket in layout.buckets:
        buffer.consume(bucket.index, pack_bucket(layout, bucket.index, state, scratch).clone())


def _pending_v2(make: Callable[..., Any], commit_timeout_s: float) -> tuple[Any, dict[str, torch.Tensor]]:
    """A buffer that applied version 1 and holds every bucket of version 2; and its live tensors."""
    layout = w.layout_of(w.make_state(1), BUCKET)
    live = w.zeros_like_layout(layout)
    buffer = make(live, layout, commit_timeout_s=commit_timeout_s)
    feed(buffer, w.make_state(1), 1)
    _staged(buffer, 2)
    return buffer, live


@pytest.mark.parametrize("make", [DirectBuffer, DoubleBuffer])
def test_prepare_takes_the_serving_lock_so_the_commit_cannot_fail(make: Callable[..., Any]) -> None:
    buffer, live = _pending_v2(make, 0.05)
    with buffer.serving(), pytest.raises(SyncTimeoutError, match="in-flight requests"):
        buffer.prepare_commit(2, 5.0)  # a stuck request: refused before any vote
    assert buffer.version == 1
    assert buffer.pending_version == 2
    buffer.prepare_commit(2, 5.0)
    refused = threading.Event()

    def late_request() -> None:  # arrives after the prepare: waits for the commit, never sees a mix
        try:
            with buffer.serving(0.05):
                pass
        except SyncTimeoutError:
            refused.set()

    thread = threading.Thread(target=late_request)
    thread.start()
    thread.join(w.TIMEOUT)
    assert refused.is_set()
    buffer.commit(2)  # held since prepare: no wait, cannot time out
    assert checksum(live) == checksum(w.make_state(2))
    with buffer.serving(0.5):  # the lock was released by the commit
        pass


@pytest.mark.parametrize("make", [DirectBuffer, DoubleBuffer])
def test_abort_after_prepare_releases_the_lock_and_keeps_v(make: Callable[..., Any]) -> None:
    buffer, live = _pending_v2(make, 1.0)
    buffer.prepare_commit(2)
    buffer.abort(RuntimeError("a rank voted no"))
    assert buffer.version == 1
    assert checksum(live) == checksum(w.make_state(1))
    with buffer.serving(0.5):  # released
        pass
    feed(buffer, w.make_state(3), 3)
    assert checksum(live) == checksum(w.make_state(3))


def test_prepare_checks_the_version_and_every_bucket() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    buffer = DoubleBuffer(w.zeros_like_layout(layout), layout)
    with pytest.raises(VersionError):
        buffer.prepare_commit(1)  # nothing pending
    buffer.begin(1)
    with pytest.raises(IncompleteSyncError, match="missing"):
        buffer.prepare_commit(1)
    with pytest.raises(VersionError):
        buffer.prepare_commit(2)


@pytest.mark.parametrize("version", [2**63, 2**64 + 1, -5, 1.0, True])
def test_versions_outside_int64_are_a_version_error_not_an_overflow(version: Any) -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    buffer = DirectBuffer(w.zeros_like_layout(layout), layout)
    with pytest.raises(VersionError):
        buffer.begin(version)
    assert buffer.pending_version is None


def test_a_commit_that_times_out_lets_waiting_requests_go_on() -> None:
    lock = ServingLock()
    outcomes: list[str] = []
    served = threading.Event()

    def writer() -> None:
        try:
            lock.acquire_exclusive(0.2)
            outcomes.append("acquired")
        except SyncTimeoutError:
            outcomes.append("timed out")

    def request() -> None:
        with lock.shared(w.TIMEOUT):
            served.set()

    with lock.shared():
        commit = threading.Thread(target=writer)
        commit.start()
        while not lock._waiting_writers and commit.is_alive():  # the writer now holds requests back
            threading.Event().wait(0.001)
        late = threading.Thread(target=request)
        late.start()
        commit.join(w.TIMEOUT)
        assert outcomes == ["timed out"]
        assert served.wait(w.TIMEOUT), "a request held back by a writer that gave up must go on"
    late.join(w.TIMEOUT)
    lock.acquire_exclusive(0.5)  # a hold that another thread releases (prepare here, abort there)
    releaser = threading.Thread(target=lock.release_exclusive)
    releaser.start()
    releaser.join(w.TIMEOUT)
    with lock.shared(0.5):
        pass


def test_double_requests_see_all_of_one_version() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    live = w.zeros_like_layout(layout)
    buffer = DoubleBuffer(live, layout)
    versions = {v: checksum(w.make_state(v)) for v in range(1, 6)}
    feed(buffer, w.make_state(1), 1)
    seen: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with buffer.serving():
                seen.append(checksum(live))

    thread = threading.Thread(target=serve)
    thread.start()
    for v in range(2, 6):
        feed(buffer, w.make_state(v), v)
    stop.set()
    thread.join(w.TIMEOUT)
    assert seen
    assert set(seen) <= set(versions.values())


def test_double_swap_flips_storages_of_a_module_without_copies() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    module = w.module_for(layout)
    buffer = DoubleBuffer(module, layout, mode="swap")
    staging_ptrs = {t.data_ptr() for t in buffer.staging.values() if t.numel()}
    feed(buffer, w.make_state(1), 1)
    live_ptrs = {t.data_ptr() for t in module.state_dict().values() if t.numel()}
    assert live_ptrs == staging_ptrs, "the module now computes with what was the staging area"
    assert checksum(dict(module.state_dict())) == checksum(w.make_state(1))
    feed(buffer, w.make_state(2), 2)
    assert checksum(dict(module.state_dict())) == checksum(w.make_state(2))
    before = buffer.extra_bytes
    feed(buffer, w.make_state(3), 3)
    assert buffer.extra_bytes == before, "no new staging memory per version"
    assert checksum(live_tensors(module)) == checksum(w.make_state(3))


def test_double_copy_reaches_modules_through_detached_state_dict_aliases() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    module = w.module_for(layout)
    buffer = DoubleBuffer(module.state_dict(), layout)  # keep_vars=False: aliases
    feed(buffer, w.make_state(2), 2)
    assert checksum(dict(module.state_dict())) == checksum(w.make_state(2))


# -- Shared ---------------------------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_shared_readers_in_processes_bind_zero_copy_views() -> None:
    readers = 3
    layout = w.layout_of(w.make_state(1), BUCKET)
    ctx = w.context()
    queue = ctx.Queue()
    commands = [ctx.Queue() for _ in range(readers)]
    with SharedBuffer(layout, readers, timeout_s=w.TIMEOUT) as shared, w.processes() as procs:
        for i in range(readers):
            w.start(procs, w.shared_reader, shared.name, commands[i], queue)
        for version in (1, 2, 3):
            shared.publish(w.make_state(version), version)
            for c in commands:
                c.put(version)
            results = [queue.get(timeout=w.TIMEOUT) for _ in range(readers)]
            assert sorted(r[0] for r in results) == list(range(readers))
            for _, status, (got, digest, inside, _pid) in results:
                assert status == "ok"
                assert got == version
                assert digest == checksum(w.make_state(version))
                assert inside, "reader weights must live in the shared mapping, not private copies"
        assert shared.extra_bytes <= 2 * layout.padded_bytes + 64 * 1024
        for c in commands:
            c.put("stop")


def test_shared_reader_cannot_write_the_weights() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    ctx = w.context()
    queue, commands = ctx.Queue(), ctx.Queue()
    with SharedBuffer(layout, 1, timeout_s=w.TIMEOUT) as shared, w.processes() as procs:
        shared.publish(w.make_state(1), 1)
        proc = w.start(procs, w.shared_reader, shared.name, commands, queue)
        commands.put(1)
        assert queue.get(timeout=w.TIMEOUT)[1] == "ok"
        commands.put("write")
        proc.join(w.TIMEOUT)
        assert proc.exitcode == -signal.SIGSEGV
        with SharedBufferReader.attach(shared.name) as check:
            check.refresh()
            assert checksum(check.tensors()) == checksum(w.make_state(1))


def test_shared_writer_never_overwrites_a_slot_in_use() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    with SharedBuffer(layout, 2, timeout_s=0.2) as shared:
        reader = SharedBufferReader.attach(shared.name, 0)
        late = SharedBufferReader.attach(shared.name, 1)
        shared.publish(w.make_state(1), 1)
        assert reader.refresh() == 1
        shared.publish(w.make_state(2), 2)  # the other slot: fine
        # reader 0 still reads v1 and nobody moved to v2 yet: v3 would have to overwrite one of them
        with pytest.raises(SyncTimeoutError, match="reader 0 must refresh"):
            shared.publish(w.make_state(3), 3)
        assert shared.version == 2
        assert checksum(reader.tensors()) == checksum(w.make_state(1))
        assert late.refresh() == 2
        assert checksum(late.tensors()) == checksum(w.make_state(2))
        assert reader.refresh() == 2
        shared.publish(w.make_state(3), 3)  # v1's slot is free now
        assert checksum(reader.tensors()) == checksum(w.make_state(2))
        assert reader.refresh() == 3
        assert checksum(reader.tensors()) == checksum(w.make_state(3))
        reader.close()
        late.close()


def test_shared_writer_ignores_dead_readers() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    ctx = w.context()
    queue, commands = ctx.Queue(), ctx.Queue()
    with SharedBuffer(layout, 1, timeout_s=w.TIMEOUT) as shared, w.processes() as procs:
        shared.publish(w.make_state(1), 1)
        proc = w.start(procs, w.shared_reader, shared.name, commands, queue)
        commands.put(1)
        assert queue.get(timeout=w.TIMEOUT)[1] == "ok"
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(w.TIMEOUT)
        for version in (2, 3, 4):  # v3 and v4 reuse the dead reader's slots
            shared.publish(w.make_state(version), version)
        with SharedBufferReader.attach(shared.name) as fresh:  # its index is free again
            assert fresh.reader_index == 0
            assert fresh.refresh() == 4


def test_shared_reader_layout_checks() -> None:
    state = w.make_state(1)
    layout = w.layout_of(state, BUCKET)
    other = w.layout_of(dict(state, step=torch.zeros(3, dtype=torch.int64)), BUCKET)
    with SharedBuffer(layout, 1) as shared:
        with pytest.raises(LayoutMismatchError, match="'step'"):
            SharedBufferReader.attach(shared.name, expected_layout=other)
        with SharedBufferReader.attach(shared.name, expected_layout=layout) as reader:
            assert reader.refresh() == -1
            assert reader.tensors() == {}
            with pytest.raises(WeightSyncError, match="taken"):
                SharedBufferReader.attach(shared.name)
            bad = w.module_for(other)
            with pytest.raises(LayoutMismatchError, match="'step'"):
                reader.bind_module(bad)


def test_ring_into_a_shared_buffer_feeds_every_local_reader() -> None:
    state = w.make_state(2)
    layout = w.layout_of(state, BUCKET)
    modules = [w.module_for(layout) for _ in range(3)]
    with ShmRingSender(layout, 1, checksums=True) as sender, SharedBuffer(layout, 3) as shared:
        readers = [SharedBufferReader.attach(shared.name) for _ in modules]
        for reader, module in zip(readers, modules, strict=True):
            reader.bind_module(module)
        receiver = ShmRingReceiver.attach(sender.name, 0)
        thread = threading.Thread(target=receiver.receive, args=(shared, w.TIMEOUT))
        thread.start()
        assert sender.send(state, 2, w.TIMEOUT) == {0: "committed"}
        thread.join(w.TIMEOUT)
        for reader, module in zip(readers, modules, strict=True):
            assert reader.refresh() == 2
            assert checksum(dict(module.state_dict())) == checksum(state)
            reader.close()
        receiver.close()


# -- Shared: checksums and copying readers ----------------------------------------------------
def _flip_byte(shared: SharedBuffer, version: int, tensor: str) -> None:
    """Corrupt one byte of `tensor` in the committed slot holding `version` (as a stray write would)."""
    slot = shared._header.slot_holding(version)
    assert slot is not None
    offset = shared.layout[tensor].offset
    start = shared._starts[shared.layout[tensor].bucket]
    shared._slots[slot][start + offset] ^= 0x10


def _big_tensor(layout: Layout) -> str:
    return max(layout.tensors, key=lambda t: t.nbytes).name


def test_shared_checksums_keep_a_zero_copy_reader_on_its_version_when_the_next_is_corrupted() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    with SharedBuffer(layout, 1, timeout_s=w.TIMEOUT, checksums=True) as shared:
        reader = SharedBufferReader.attach(shared.name, expected_layout=layout)
        module = w.module_for(layout)
        reader.bind_module(module)
        assert reader.checksums
        shared.publish(w.make_state(1), 1)
        assert reader.refresh() == 1
        shared.publish(w.make_state(2), 2)
        assert reader.check_version(2, w.TIMEOUT) == 2  # intact: checked without binding
        assert reader.version == 1
        _flip_byte(shared, 2, _big_tensor(layout))
        reader._verified.clear()  # a fresh look, as another reader would take
        with pytest.raises(ChecksumMismatchError, match=r"bucket \d+ of version 2"):
            reader.check_version(2, w.TIMEOUT)
        with pytest.raises(ChecksumMismatchError, match=r"bucket \d+ of version 2"):
            reader.refresh()
        assert reader.version == 1
        assert checksum(dict(module.state_dict())) == checksum(w.make_state(1))
        shared.publish(w.make_state(3), 3)  # the corrupted slot is not in use: the writer reuses it
        assert reader.refresh() == 3
        assert checksum(dict(module.state_dict())) == checksum(w.make_state(3))
        reader.close()


def test_shared_without_checksums_does_not_verify() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    shared = SharedBuffer(layout, 1, timeout_s=w.TIMEOUT)
    with shared, SharedBufferReader.attach(shared.name) as reader:
        assert not reader.checksums
        shared.publish(w.make_state(1), 1)
        _flip_byte(shared, 1, _big_tensor(layout))
        assert reader.refresh() == 1  # nothing to check against: the caller chose speed


@pytest.mark.timeout(400)
def test_copying_readers_in_processes_take_each_version_privately_and_refuse_corruption() -> None:
    readers = 2
    layout = w.layout_of(w.make_state(1), BUCKET)
    ctx = w.context()
    queue = ctx.Queue()
    commands = [ctx.Queue() for _ in range(readers)]
    versions = (1, 2, 3)
    with SharedBuffer(layout, readers, timeout_s=w.TIMEOUT, checksums=True) as shared, w.processes() as procs:
        for i in range(readers):
            w.start(procs, w.copying_reader, shared.name, commands[i], queue)
        for version in versions:
            shared.publish(w.make_state(version), version)
            if version == 3:  # in memory after the writer's checksum, before any reader looks
                _flip_byte(shared, 3, _big_tensor(layout))
            for c in commands:
                c.put(version)
            results = [queue.get(timeout=w.TIMEOUT) for _ in range(readers)]
            for got, status, *rest in results:
                assert got == version
                if version < 3:
                    private, digest = rest
                    assert status == "ok"
                    assert private, "a copying reader keeps its own weights, not views of the segment"
                    assert digest == checksum(w.make_state(version))
                else:
                    message, digest = rest
                    assert status == "ChecksumMismatchError", message
                    assert "version 3" in message
                    assert digest == checksum(w.make_state(2))  # nothing applied
        for c in commands:
            c.put("stop")


def test_copy_version_pins_its_slot_and_checks_versions_and_layouts() -> None:
    layout = w.layout_of(w.make_state(1), BUCKET)
    with SharedBuffer(layout, 2, timeout_s=0.2) as shared:
        copier_reader = SharedBufferReader.attach(shared.name, 0)
        viewer = SharedBufferReader.attach(shared.name, 1)
        module = w.module_for(layout)
        target = DoubleBuffer(live_tensors(module), layout)
        shared.publish(w.make_state(1), 1)
        entered, release = threading.Event(), threading.Event()
        original = target.consume

        def slow_consume(index: int, data: torch.Tensor) -> None:
            entered.set()
            release.wait(w.TIMEOUT)
            original(index, data)

        target.consume = slow_consume  # type: ignore[method-assign]
        copier = threading.Thread(target=copier_reader.copy_version, args=(1, target, w.TIMEOUT))
        copier.start()
        assert entered.wait(w.TIMEOUT)
        shared.publish(w.make_state(2), 2)  # the other slot
        assert viewer.refresh() == 2
        with pytest.raises(SyncTimeoutError, match="reader 0"):
            shared.publish(w.make_state(3), 3)  # would overwrite v1 while it is copied
        release.set()
        copier.join(w.TIMEOUT)
        assert target.version == 1
        assert checksum(dict(module.state_dict())) == checksum(w.make_state(1))
        shared.publish(w.make_state(3), 3)  # v1's slot is free again
        assert checksum(viewer.tensors()) == checksum(w.make_state(2))
        with pytest.raises(VersionError, match="version 1 is no longer there"):
            copier_reader.copy_version(1, DoubleBuffer(live_tensors(w.module_for(layout)), layout), w.TIMEOUT)
        other = w.layout_of(dict(w.make_state(1), step=torch.zeros(3, dtype=torch.int64)), BUCKET)
        with pytest.raises(LayoutMismatchError, match="'step'") as caught:
            copier_reader.copy_version(3, DoubleBuffer(live_tensors(w.module_for(other)), other), w.TIMEOUT)
        assert caught.value.parameter == "step"  # as data, not only in the sentence
        # a buffer built from the model alone has the default bucket size: the error says what to
        # pass, and the reader holds the writer's layout for it
        alone = DoubleBuffer(w.module_for(layout))
        with pytest.raises(LayoutMismatchError, match=rf"SharedBufferReader\.layout.*bucket_bytes={BUCKET}"):
            copier_reader.copy_version(3, alone, w.TIMEOUT)
        assert copier_reader.layout.digest == layout.digest
        fitting = w.module_for(copier_reader.layout)
        fits = DoubleBuffer(fitting, layout=copier_reader.layout)
        assert copier_reader.copy_version(3, fits, w.TIMEOUT) == 3
        assert checksum(dict(fitting.state_dict())) == checksum(w.make_state(3))
        copier_reader.close()
        viewer.close()


def test_shared_writer_adopts_its_tensors_and_publishes_them_as_one_block() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    model.register_buffer("steps", torch.arange(5, dtype=torch.int64))
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.5)
    state = model.state_dict(keep_vars=True)
    before = checksum(state)
    layout = Layout.from_state_dict(state, 4096)
    with SharedBuffer(layout, 1, timeout_s=30) as shared, SharedBufferReader.attach(shared.name) as reader:
        shared.adopt(model)
        assert checksum(model.state_dict()) == before  # values kept
        assert list(model.parameters()) == params  # same Parameter objects: the optimizer still works
        block = flat_block(layout, model.state_dict())
        assert block is not None
        lo, hi = block.data_ptr(), block.data_ptr() + block.numel()
        assert all(lo <= t.data_ptr() < hi for t in model.state_dict().values())

        model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
        optimizer.step()  # trains in place, inside the block
        assert flat_block(layout, model.state_dict()) is not None  # still in the block
        shared.publish(model.state_dict(), 1)
        reader.refresh()
        assert checksum(reader.tensors()) == checksum(model.state_dict()) != before

        # a tensor moved out of the block, or a non-contiguous one: the per-tensor path, same bytes
        with torch.no_grad():
            model[0].weight.data = model[0].weight.data.t()
        assert flat_block(layout, model.state_dict()) is None
        shared.publish(model.state_dict(), 2)
        reader.refresh()
        assert checksum(reader.tensors()) == checksum(model.state_dict())

    with SharedBuffer(layout, 1, timeout_s=30) as shared, pytest.raises(LayoutMismatchError):
        shared.adopt({"0.weight": torch.zeros(3)})
