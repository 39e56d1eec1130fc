"""Streaming senders: a stream of (name, tensor) pairs read in the layout's order, bucket by bucket.

Every transport that takes a state dict takes a stream too: a gloo broadcast and a ShmRing to
other processes, the node's SharedBuffer, and an FSDP2 trainer gathering one parameter at a
time. A stream that breaks the layout (out of order, missing, unexpected, twice, wrong shape or
dtype, not a tensor, or a producer that raises) aborts the version through the protocol, names
the parameter, leaves every receiver on its previous version, and is drained to its end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import shm_workers as shm
import streaming_workers as s
import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    DoubleBuffer,
    Layout,
    LayoutMismatchError,
    LoadWeightsConsumer,
    SharedBuffer,
    SharedBufferReader,
    ShmRingSender,
    WeightStream,
    checksum,
    feed,
)
from rlfleet.weightsync.protocol._stream import StreamCursor

CASES = [*s.broken_streams(3), "raises"]


# -- the stream reader alone ---------------------------------------------------------------------
def test_a_stream_is_read_in_layout_order_and_once() -> None:
    state = w.make_state(1)
    layout = w.layout_of(state)
    stream = WeightStream(state.items())
    cursor = StreamCursor(stream, layout)
    assert [name for name, _ in cursor.ordered()] == list(layout.names)
    assert stream.pulled == len(layout)
    with pytest.raises(ValueError, match="read once"):
        StreamCursor(stream, layout)
    with pytest.raises(TypeError, match="state dict"):
        WeightStream(state)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="iterates"):
        WeightStream(3)  # type: ignore[arg-type]


def test_a_share_reads_only_its_buckets_tensors() -> None:
    state = w.make_state(1)
    layout = w.layout_of(state)
    share = [1, 2]
    names = [t.name for k in share for t in layout.buckets[k].tensors]
    cursor = StreamCursor(WeightStream((n, state[n]) for n in names), layout, share)
    assert [n for n, _ in cursor.ordered()] == names
    outside = layout.buckets[0].tensors[0].name
    cursor = StreamCursor(WeightStream([(outside, state[outside])]), layout, share)
    with pytest.raises(LayoutMismatchError, match="share") as caught:
        list(cursor.ordered())
    assert caught.value.parameter == outside


def test_a_dtensor_or_a_pair_that_is_not_one_is_named() -> None:
    state = w.make_state(1)
    layout = w.layout_of(state)
    first = layout.names[0]
    with pytest.raises(LayoutMismatchError, match="not a \\(name, tensor\\) pair"):
        list(StreamCursor(WeightStream([first]), layout).ordered())  # type: ignore[list-item]
    with pytest.raises(LayoutMismatchError, match="not a tensor") as caught:
        list(StreamCursor(WeightStream([(first, 1.0)]), layout).ordered())  # type: ignore[list-item]
    assert caught.value.parameter == first


# -- broadcast over gloo ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def broadcast_run() -> dict[int, Any]:
    return w.run_ranks(s.scenario_stream_broadcast, 3, timeout=200.0)


@pytest.mark.timeout(260)
def test_streamed_broadcast_is_bit_exact(broadcast_run: dict[int, Any]) -> None:
    sender = broadcast_run[0]
    assert sender["buckets"] > 4
    for step in ("v1", "v2", "v3", "mapping"):
        assert sender[step]["ok"], (step, sender[step])
    for rank in (1, 2):
        for step, version in (("v1", 1), ("v2", 2), ("v3", 3), ("mapping", 4)):
            got = broadcast_run[rank][step]
            assert got["ok"], (rank, step, got)
            assert got["applied"] == version
            assert got["checksum"] == checksum(w.make_state(version))
    assert sender["broken"] is None
    assert broadcast_run[1]["broken"] is None
    assert broadcast_run[2]["broken"] is None


@pytest.mark.timeout(260)
@pytest.mark.parametrize("case", CASES)
def test_a_broken_stream_aborts_the_version_and_names_the_parameter(
    broadcast_run: dict[int, Any], case: str
) -> None:
    error, parameter = s.BROKEN[case]
    got = broadcast_run[0][case]
    assert not got["ok"]
    assert got["type"] == error, got
    assert got["parameter"] == parameter, got
    if parameter is not None:
        assert repr(parameter) in got["message"]
    if case != "raises":
        assert got["drained"], "the rest of the stream was not read after the failure"
    for rank in (1, 2):
        seen = broadcast_run[rank][case]
        assert seen["type"] == "SyncAbortedError", seen
        assert seen["applied"] == 2  # the previous version, untouched
        assert seen["checksum"] == checksum(w.make_state(2))


@pytest.mark.timeout(260)
def test_a_stream_sent_twice_is_refused_before_the_wire(broadcast_run: dict[int, Any]) -> None:
    got = broadcast_run[0]["reused"]
    assert got["type"] == "ValueError"
    assert "read once" in got["message"]


# -- ShmRing to reader processes ---------------------------------------------------------------------
@pytest.mark.timeout(260)
def test_streamed_ring_is_bit_exact_and_a_broken_stream_keeps_the_previous_version() -> None:
    bucket = 16 * 1024
    layout = w.layout_of(w.make_state(0), bucket)
    queue = shm.context().Queue()
    steps = ["v1", "order", "missing_last", "extra_end", "v2"]
    with ShmRingSender(layout, 1, checksums=True) as sender, shm.processes() as procs:
        shm.start(procs, s.ring_reader, sender.name, 0, bucket, len(steps), queue)
        outcomes: dict[str, Any] = {}
        for step in steps:
            version = 1 if step == "v1" else 3 if step == "v2" else 2
            pairs = list(w.make_state(version).items()) if step.startswith("v") else s.broken_streams(2)[step]
            counted = s.Counted(pairs)
            try:
                outcomes[step] = sender.send(counted, version, shm.TIMEOUT)
            except LayoutMismatchError as exc:
                outcomes[step] = exc.parameter
            assert counted.taken == len(pairs), step  # drained after a failure
            _, ok, kind, applied, total = queue.get(timeout=shm.TIMEOUT)
            if step.startswith("v"):
                assert ok, step
                assert applied == version, step
                assert total == checksum(w.make_state(version)), step
            else:
                assert kind == "SyncAbortedError", (step, kind)
                assert applied == 1, step
                assert total == checksum(w.make_state(1)), step
    assert outcomes["v1"] == outcomes["v2"] == {0: "committed"}
    assert outcomes["order"] == s.BROKEN["order"][1]
    assert outcomes["missing_last"] == s.BROKEN["missing_last"][1]
    assert outcomes["extra_end"] == "not.in.layout"


# -- CUDA IPC (the host backend: the same state machine over shared memory) -------------------------
def _ipc_checks(results: dict[int, Any]) -> None:
    sender = results[0]
    for step, version in s.IPC_STEPS:
        if step.startswith("v"):
            assert sender[step]["ok"], (step, sender[step])
        else:
            assert sender[step]["type"] == "LayoutMismatchError", (step, sender[step])
            assert sender[step]["parameter"] == s.BROKEN[step][1]
            assert sender[step]["drained"]
        for rank in (1, 2):
            got = results[rank][step]
            applied = version if step.startswith("v") else 1
            assert got["applied"] == applied, (rank, step, got)
            assert got["checksum"] == checksum(w.make_state(applied))
            if not step.startswith("v"):
                assert got["type"] == "SyncAbortedError", (rank, step, got)


@pytest.mark.timeout(200)
def test_streamed_cuda_ipc_host_backend(tmp_path: Path) -> None:
    results = w.run_ranks(s.scenario_stream_ipc, 3, str(tmp_path / "channel"), "host", timeout=180.0)
    _ipc_checks(results)


@pytest.mark.gpu
@pytest.mark.timeout(200)
def test_streamed_cuda_ipc_on_a_gpu(tmp_path: Path) -> None:
    """The stream's tensors on the GPU, copied into the device slots on the current stream."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("cupy")
    results = w.run_ranks(s.scenario_stream_ipc, 3, str(tmp_path / "channel"), "cuda", timeout=180.0)
    _ipc_checks(results)


# -- SharedBuffer.publish: the node buffer fed by `feed` ----------------------------------------------
@pytest.mark.timeout(120)
def test_shared_buffer_publishes_a_stream_and_keeps_the_newest_version_on_a_broken_one() -> None:
    layout = w.layout_of(w.make_state(0), 16 * 1024)
    with SharedBuffer(layout, 1, checksums=True) as node:
        node.publish(WeightStream(w.make_state(1).items()), 1, 30.0)
        reader = SharedBufferReader.attach(node.name)
        try:
            reader.wait_for_version(1, 30.0)
            assert checksum(reader.tensors()) == checksum(w.make_state(1))
            for case in ("order", "missing", "twice", "dtype"):
                counted = s.Counted(s.broken_streams(2)[case])
                with pytest.raises(LayoutMismatchError) as caught:
                    node.publish(counted, 2, 30.0)
                assert caught.value.parameter == s.BROKEN[case][1], case
                assert counted.taken == len(counted.pairs)
                assert node.latest_version() == 1
            node.publish(iter(w.make_state(2).items()), 2, 30.0)
            reader.refresh(30.0)
            assert reader.version == 2
            assert checksum(reader.tensors()) == checksum(w.make_state(2))
        finally:
            reader.close()


def test_shared_buffer_lands_streamed_buckets_in_its_slot() -> None:
    """A consumer that offers its slot: `feed` writes there, with no bucket buffer of its own."""
    layout = w.layout_of(w.make_state(0), 16 * 1024)
    with SharedBuffer(layout, 1) as node:
        node.begin(1)
        region = node.bucket_target(0)
        assert region is not None
        assert region.numel() == layout.buckets[0].nbytes
        node.abort(RuntimeError("test"))
        assert node.bucket_target(0) is None  # no slot is written outside a version


# -- an FSDP2 trainer --------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_fsdp2_trainer_streams_over_broadcast_and_ring_bit_exact() -> None:
    versions, broken_at = 4, 3
    results = w.run_ranks(s.scenario_fsdp2_stream, 4, versions, broken_at, timeout=280.0)
    trainer = results[0]
    assert trainer["sharded"]
    assert results[1]["sharded"]
    for version in range(1, versions + 1):
        for transport in ("broadcast", "ring"):
            got = trainer[f"{transport}/v{version}"]
            if version == broken_at:
                assert got["type"] == "LayoutMismatchError", got
                assert got["parameter"] == "model.layers.1.mlp.up", got
            else:
                assert got["ok"], (transport, version, got)
                if transport == "ring":
                    assert got["value"] == {0: "committed"}
        for rank in (2, 3):  # 2: across the broadcast, 3: the ring's reader on the node
            seen = results[rank][f"v{version}"]
            if version == broken_at:
                assert seen["type"] == "SyncAbortedError", (rank, seen)
                assert seen["applied"] == broken_at - 1
            else:
                assert seen["ok"], (rank, seen)
                assert seen["applied"] == version
            assert seen["bit_exact"], (rank, version)


def _twice_after_its_bucket(layout: Layout, version: int, company: bool) -> tuple[str, list[tuple[str, Any]]]:
    """A stream of `version` in which one parameter comes again once its bucket was complete and
    handed over, with another value (the one that would win if it were taken): the parameter
    shares its bucket with others (`company`: the repeat leaves the bucket open) or not."""
    good = list(w.make_state(version).items())
    name = next(
        b.tensors[0].name
        for b in layout.buckets
        if (len(b.tensors) > 1) == company and b.index < len(layout.buckets) - 1
    )
    tensor = dict(good)[name]
    again = (name, ~tensor if tensor.dtype == torch.bool else torch.full_like(tensor, 7))
    return name, [*good[:-1], again, good[-1]]


@pytest.mark.parametrize("company", [True, False], ids=["bucket_of_several", "bucket_of_its_own"])
@pytest.mark.parametrize(
    "consumer", ["SharedBuffer", "DoubleBuffer", "load_weights staged", "load_weights stream"]
)
def test_a_parameter_named_twice_in_a_fed_stream_is_refused_and_nothing_applied(
    consumer: str, company: bool
) -> None:
    """`feed` into a node buffer, a Double buffer and an engine's load_weights: a name that comes
    a second time, after its bucket was complete, is a LayoutMismatchError naming it; the version
    is not committed (the previous one stays, bit-exact) and the engine is never called."""
    layout = w.layout_of(w.make_state(0), s.BUCKET)
    name, stream = _twice_after_its_bucket(layout, 2, company)
    loaded: list[str] = []
    target: Any
    if consumer == "SharedBuffer":
        target = SharedBuffer(layout, 1)
        target.publish(w.make_state(1), 1, 10.0)
    elif consumer == "DoubleBuffer":
        target = DoubleBuffer({k: v.clone() for k, v in w.make_state(1).items()}, layout)
        feed(target, w.make_state(1).items(), 1, 10.0)
    else:
        target = LoadWeightsConsumer(
            layout, lambda pairs: loaded.extend(n for n, _ in pairs), mode=consumer.split()[-1]
        )
        feed(target, w.make_state(1).items(), 1, 10.0)
        loaded.clear()
    try:
        with pytest.raises(LayoutMismatchError, match="twice") as info:
            feed(target, iter(stream), 2, 10.0)
        assert info.value.parameter == name
        assert target.version == 1
        if consumer == "SharedBuffer":
            assert target.latest_version() == 1
            with SharedBufferReader.attach(target.name) as reader:
                reader.refresh(10.0)
                assert checksum(reader.tensors()) == checksum(w.make_state(1))
        elif consumer == "DoubleBuffer":
            assert checksum(target.live) == checksum(w.make_state(1))
        elif consumer.endswith("staged"):
            assert loaded == []  # the engine never saw version 2
    finally:
        if isinstance(target, SharedBuffer):
            target.close()
